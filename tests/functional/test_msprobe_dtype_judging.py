"""An msprobe user's most common compare: an fp32 golden against a bf16 port, both dumped with
msprobe's own PrecisionDebugger (mindstudio-probe from PyPI, on CPU), compared with the CLI. An
msprobe dump records no model dtype: the rows are judged at the dtype most of the target's outputs
are in, so a bf16 model's float32 upcasts (its RMSNorm's) pass as the bf16 values they come from,
a clean port passes and a scaled weight still fails first at its module."""

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
BAD_MODULE = "model.layers.1.mlp.down_proj"
RUNS = (("L1", "tensor"), ("mix", "tensor"), ("mix", "statistics"))
SCRIPT = """
import json, sys, torch
from llmflow.models import load_model
from msprobe.pytorch import PrecisionDebugger

for level, task in json.loads(sys.argv[1]):
    for run, dtype, bad in (("golden", torch.float32, False), ("port", torch.bfloat16, False),
                            ("bad", torch.bfloat16, True)):
        # a fresh model each time: msprobe's module hooks stay on a model it has seen
        model = load_model("tiny-llama:layers=2,hidden=64,seed=0").model.eval().to(dtype)
        if bad:
            with torch.no_grad():
                model.get_parameter(sys.argv[2] + ".weight").mul_(1.5)
        cfg = {"task": task, "dump_path": f"{level}_{task}_{run}", "rank": [], "step": [], "level": level,
               "seed": 1234, task: {"scope": [], "list": [], "data_mode": ["all"]}}
        json.dump(cfg, open("cfg.json", "w"))
        PrecisionDebugger._instance = None  # one debugger per configuration
        dbg = PrecisionDebugger(config_path="cfg.json")
        ids = torch.tensor([[1, 5, 7, 9]])
        with torch.no_grad():
            for _ in range(2):
                dbg.start(model=model)
                logits = model(ids, use_cache=False).logits
                dbg.stop()
                dbg.step()
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("msprobe_dtypes")
    (d / "run.py").write_text(SCRIPT, encoding="utf-8")
    proc = subprocess.run([sys.executable, "run.py", json.dumps(RUNS), BAD_MODULE], cwd=d,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


def _compare(dumps: Path, golden: str, target: str, out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(dumps / golden), "-mp",
                           str(dumps / target), "-o", str(out), "--no-xlsx"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc, json.loads((out / "compare_summary.json").read_text())


@pytest.mark.parametrize(("level", "task"), RUNS)
def test_a_clean_bf16_port_passes_judged_at_bf16(dumps, tmp_path, level, task):
    proc, summary = _compare(dumps, f"{level}_{task}_golden", f"{level}_{task}_port", tmp_path / "out")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0 and last.startswith("PASSED"), proc.stdout[-3000:]
    judged = summary["judged_as"]
    assert judged["dtype"] == "bfloat16" and judged["given"] is None, judged
    assert "(golden float32 in most of its outputs and target bfloat16 in most of its outputs)" in \
        judged["source"], judged


@pytest.mark.parametrize(("level", "task"), [("L1", "tensor"), ("mix", "tensor")])
def test_a_scaled_weight_in_the_bf16_port_still_fails_at_its_module(dumps, tmp_path, level, task):
    proc, summary = _compare(dumps, f"{level}_{task}_golden", f"{level}_{task}_bad", tmp_path / "out")
    assert proc.returncode == 1, proc.stdout[-3000:]
    first = {lv: s["first_fail"] for lv, s in summary["levels"].items() if s.get("first_fail")}
    if level == "mix":
        assert first["module"]["name"] == BAD_MODULE, first
    else:  # the down_proj linear of layer 1: q k v o gate up down per layer, the 14th linear call
        assert first["api"]["name"] == "/linear.13", first
