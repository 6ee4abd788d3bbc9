"""`llmflow precheck` on real msprobe tensor dumps (mindstudio-probe from PyPI, on CPU) of a tiny
seeded bf16 Llama at levels L1 (API records only) and mix (API records inside their modules): the
clean model has no failing call; with layer 1's silu answered by a lossy kernel behind torch's own
``F.silu`` (``precheck_faults.lossy_torch_silu``, what msprobe wraps), exactly that call fails,
named by msprobe's record and, at mix, by its module; its repro reproduces in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

pytest.importorskip("msprobe.pytorch", reason="mindstudio-probe is not installed (optional: "
                                              "pip install mindstudio-probe)")

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
ENV = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
# msprobe keeps API hook state across the debuggers of one process (an L1 debugger records a
# later debugger's API calls too): the mix dumps come first
RUNS = (("mix", "clean"), ("mix", "lossy"), ("L1", "clean"), ("L1", "lossy"))
SCRIPT = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import precheck_faults
from llmflow.models import load_model
from msprobe.pytorch import PrecisionDebugger

for level, run in json.loads(sys.argv[1]):
    # a fresh model each time: msprobe's module hooks stay on a model it has seen
    model = load_model("tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64",
                       dtype="bfloat16").model.eval()
    if run == "lossy":
        precheck_faults.lossy_torch_silu(model)
    cfg = {"task": "tensor", "dump_path": f"{level}_{run}", "rank": [], "step": [], "level": level,
           "seed": 1234, "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}
    json.dump(cfg, open("cfg.json", "w"))
    PrecisionDebugger._instance = None  # one debugger per configuration
    dbg = PrecisionDebugger(config_path="cfg.json")
    with torch.no_grad():
        dbg.start(model=model)
        model(torch.tensor([[1, 5, 7, 9]]), use_cache=False)
        dbg.stop()
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("msprobe_precheck")
    (d / "run.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "run.py", json.dumps(RUNS), str(TESTS)], cwd=d,
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


def precheck(dump: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "llmflow", "precheck", str(dump), "-o", str(out), *args],
                          capture_output=True, text=True, timeout=600, env=ENV)
    report = json.loads((out / "precheck.json").read_text()) if (out / "precheck.json").is_file() else {}
    return proc, report


@pytest.mark.parametrize("level", ["L1", "mix"])
def test_clean_model_has_no_failing_call(dumps, tmp_path, level):
    proc, report = precheck(dumps / f"{level}_clean", tmp_path / "out")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED")
    totals = report["totals"]
    assert totals["fail"] == 0 and totals["checked"] == totals["calls"] > 50  # linears: weights are inputs
    # each API group replays through its own callable: F.linear, torch.rsqrt, the Tensor dunder
    csv_text = (tmp_path / "out" / "precheck.csv").read_text()
    for implementation in ("torch.nn.functional.linear", "torch.rsqrt", "Tensor.__mul__", "Tensor.__add__"):
        assert f",{implementation}," in csv_text


@pytest.mark.parametrize("level", ["L1", "mix"])
def test_lossy_silu_is_named_and_its_repro_reproduces(dumps, tmp_path, level):
    proc, report = precheck(dumps / f"{level}_lossy", tmp_path / "out", "--repro")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert report["totals"]["fail"] == 1  # exactly that call: layer 0's silu and everything else pass
    first = report["first_fail"]
    assert first["record"].startswith("Functional.silu.") and first["record"].endswith(".forward")
    if level == "mix":
        assert (first["name"], first["module"]) == ("model.layers.1.mlp.act_fn/silu.0",
                                                    "model.layers.1.mlp.act_fn")
    else:  # L1 records carry no module: the second silu of the pass
        assert (first["name"], first["module"]) == ("/silu.1", "")
    assert first["record"] in proc.stdout.strip().splitlines()[-1]
    script = tmp_path / "out" / report["repros"][0]["script"]
    fresh = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert fresh.returncode == 1 and "REPRODUCED" in fresh.stdout, fresh.stdout + fresh.stderr
    call = json.loads((script.parent / "call.json").read_text())
    assert call["implementation"] == "torch.nn.functional.silu"
