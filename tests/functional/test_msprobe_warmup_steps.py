"""An msprobe target dumped from a later step (``"step": [2]`` after two warm-up calls) against a
golden dumped from step 0: no step pairs, and the error names the warmup that pairs them, as the
CLI flag and the workflow parameter; given, the compare passes. Dumps made by msprobe itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

pytest.importorskip("msprobe.pytorch", reason="mindstudio-probe is not installed")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, torch
from llmflow.models import load_model
from msprobe.pytorch import PrecisionDebugger

for run, steps, calls in (("golden", [], 1), ("target", [2], 3)):
    model = load_model("tiny-llama:layers=2,hidden=64,seed=0").model.eval()
    cfg = {"task": "statistics", "dump_path": run, "rank": [], "step": steps, "level": "L0", "seed": 1234,
           "statistics": {"scope": [], "list": [], "data_mode": ["all"]}}
    json.dump(cfg, open("cfg.json", "w"))
    PrecisionDebugger._instance = None  # one debugger per configuration
    dbg = PrecisionDebugger(config_path="cfg.json")
    with torch.no_grad():
        for _ in range(calls):
            dbg.start(model=model)
            model(torch.tensor([[1, 5, 7, 9]]), use_cache=False)
            dbg.stop()
            dbg.step()
"""


def _llmflow(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": checkout_path(REPO)})


def test_a_target_dumped_from_a_later_step_names_the_warmup_that_pairs_it(tmp_path):
    (tmp_path / "run.py").write_text(SCRIPT, encoding="utf-8")
    made = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert made.returncode == 0, made.stderr[-3000:]
    assert [p.name for p in (tmp_path / "target").iterdir()] == ["step2"]
    proc = _llmflow("compare", "-gp", "golden", "-mp", "target", "-o", "out", "--no-xlsx", cwd=tmp_path)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "pair with --warmup 2 (workflow parameter warmup: 2)" in last, last
    proc = _llmflow("compare", "-gp", "golden", "-mp", "target", "-o", "out", "--no-xlsx", "--warmup", "2",
                    cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("PASSED"), proc.stdout
    assert json.loads((tmp_path / "out" / "compare_summary.json").read_text())["counts"]["pass"] > 50
