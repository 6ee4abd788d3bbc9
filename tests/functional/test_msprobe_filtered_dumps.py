"""Real msprobe L1 dumps filtered to one API (``"list": ["linear"]``, mindstudio-probe from PyPI, on
CPU): with no embedding call to tell forward passes apart, a folder is one pass (one step) whose
calls pair by their counters, not one token per linear call; with ``debugger.step()`` after each
forward, each folder is its token. The scaled weight's linear fails first, in both layouts, and a
filtered golden compares against an unfiltered target. A debugger that recorded nothing is no
dump that inspect passes."""

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

from llmflow.formats import open_dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BAD_MODULE = "model.layers.1.mlp.down_proj"
BAD_API = "/linear.13"  # q k v o gate up down per layer: layer 1's down_proj is the 14th linear call
LINEARS = 15  # 2 layers of 7, and lm_head
SCRIPT = """
import json, sys, torch
from llmflow.models import load_model
from msprobe.pytorch import PrecisionDebugger

for run, bad, only in (("golden", False, ["linear"]), ("bad", True, ["linear"]), ("full_bad", True, [])):
    for layout in ("one_folder", "per_step"):
        model = load_model("tiny-llama:layers=2,hidden=64,seed=0").model.eval()
        if bad:
            with torch.no_grad():
                model.get_parameter(sys.argv[1] + ".weight").mul_(1.5)
        cfg = {"task": "tensor", "dump_path": f"{layout}_{run}", "rank": [], "step": [], "level": "L1",
               "seed": 1234, "tensor": {"scope": [], "list": only, "data_mode": ["all"]}}
        json.dump(cfg, open("cfg.json", "w"))
        PrecisionDebugger._instance = None
        dbg = PrecisionDebugger(config_path="cfg.json")
        ids = torch.tensor([[1, 5, 7, 9]])
        with torch.no_grad():
            if layout == "one_folder":
                dbg.start(model=model)
            for _ in range(3):
                if layout == "per_step":
                    dbg.start(model=model)
                logits = model(ids, use_cache=False).logits
                if layout == "per_step":
                    dbg.stop()
                    dbg.step()
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
            if layout == "one_folder":
                dbg.stop()

# a debugger started and stopped with no forward pass between
model = load_model("tiny-llama:layers=2,hidden=64,seed=0").model.eval()
json.dump({"task": "tensor", "dump_path": "nothing", "rank": [], "step": [], "level": "L1", "seed": 1234,
           "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}, open("cfg.json", "w"))
PrecisionDebugger._instance = None
dbg = PrecisionDebugger(config_path="cfg.json")
dbg.start(model=model)
dbg.stop()
dbg.step()
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("msprobe_list")
    (d / "run.py").write_text(SCRIPT, encoding="utf-8")
    proc = subprocess.run([sys.executable, "run.py", BAD_MODULE], cwd=d, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


def _compare(golden: Path, target: Path, out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(golden), "-mp", str(target),
                           "-o", str(out), "--no-xlsx"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc, json.loads((out / "compare_summary.json").read_text())


@pytest.mark.parametrize(("layout", "steps"), [("one_folder", [0]), ("per_step", [0, 1, 2])])
def test_a_folder_of_one_api_is_one_pass_not_one_token_per_call(dumps, layout, steps):
    reader = open_dump(dumps / f"{layout}_golden")
    assert reader.steps() == steps
    outputs = [e for e in reader.entries() if e.kind == "output"]
    per_step = {s: {e.name for e in outputs if e.step == s} for s in steps}
    # three forwards: all in the one step, or one in each (msprobe numbers calls on per folder)
    assert {s: len(names) for s, names in per_step.items()} == {s: LINEARS * 3 // len(steps) for s in steps}


@pytest.mark.parametrize("layout", ["one_folder", "per_step"])
def test_the_scaled_weights_linear_fails_first(dumps, tmp_path, layout):
    proc, summary = _compare(dumps / f"{layout}_golden", dumps / f"{layout}_bad", tmp_path / "out")
    assert proc.returncode == 1, proc.stdout[-3000:]
    first = summary["levels"]["api"]["first_fail"]
    assert first["name"] == BAD_API and first["step"] == 0, first
    assert summary["coverage"]["state"] == "complete", summary["coverage"]


def test_a_filtered_golden_against_an_unfiltered_target_compares_every_linear(dumps, tmp_path):
    """One step each (steps after a token of one side's are not the other's): every golden linear
    call pairs with the target's of its counter."""
    proc, summary = _compare(dumps / "per_step_golden", dumps / "per_step_full_bad", tmp_path / "out")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert summary["levels"]["api"]["first_fail"]["name"] == BAD_API, summary["levels"]["api"]
    assert "have no target step" not in proc.stdout, proc.stdout[-2000:]


def test_a_dump_of_no_forward_pass_is_no_pass_for_inspect(dumps):
    proc = subprocess.run([sys.executable, "-m", "llmflow", "inspect", str(dumps / "nothing")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("FAILED: the dump holds no entries"), proc.stdout
