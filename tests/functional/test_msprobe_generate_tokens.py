"""``llmflow compare`` on msprobe dumps of a whole ``generate()`` (one ``debugger.start()`` around
it, mindstudio-probe from PyPI on CPU, a user's script run as a subprocess): msprobe records no
logits and no generated tokens, yet the compare reads the logits level from the model's output
head (``lm_head``'s output at levels L0, the last vocabulary-wide ``linear`` at L1) and dates
where the texts part from the token ids each step's embedding receives, so rows after it are
marked diverged and never chosen as first or worst. A rerun passes with every token agreeing."""

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
NEW_TOKENS, FAULT_STEP = 6, 2
SCRIPT = f"""
import json, sys, torch
from msprobe.pytorch import PrecisionDebugger
from llmflow.models import load_model

out, level, task = sys.argv[1], sys.argv[2], sys.argv[3]
for run in ("golden", "rerun", "fault"):  # one process: torch and msprobe imported once
    path = f"{{out}}_{{run}}"
    model = load_model("tiny-llama:layers=2,hidden=64,seed=0").model.eval()  # fresh: no hooks of before
    if run == "fault":  # layer 1's MLP output blown up from decode step {FAULT_STEP} on: the texts part there
        calls = {{"n": -1}}
        model.register_forward_pre_hook(lambda m, a: calls.__setitem__("n", calls["n"] + 1))
        model.model.layers[1].mlp.register_forward_hook(
            lambda m, a, o: o * 40.0 if calls["n"] >= {FAULT_STEP} else None)
    config = {{"task": task, "dump_path": path, "rank": [], "step": [], "level": level,
               task: {{"scope": [], "list": [], "data_mode": ["all"]}}}}
    with open(path + ".json", "w") as f:
        json.dump(config, f)
    PrecisionDebugger._instance = None  # one debugger per dump
    debugger = PrecisionDebugger(config_path=path + ".json")
    debugger.start(model=model)
    with torch.no_grad():
        ids = model.generate(torch.tensor([[1, 17, 42, 99, 5, 63, 7]]), max_new_tokens={NEW_TOKENS},
                             do_sample=False)
    debugger.stop()
    with open(path + ".ids.json", "w") as f:
        json.dump(ids[0, 7:].tolist(), f)
"""
CASES = [("L0", "tensor"), ("L1", "tensor"), ("L0", "statistics")]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("msprobe_generate")
    script = out / "dump_generate.py"
    script.write_text(SCRIPT, encoding="utf-8")
    for level, task in CASES:
        args = [str(script), str(out / f"{level}_{task}"), level, task]
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
                              cwd=out, env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def _compare(dumps: Path, level: str, task: str, run: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = dumps / f"compare_{level}_{task}_{run}"
    args = ["compare", "-gp", str(dumps / f"{level}_{task}_golden"),
            "-mp", str(dumps / f"{level}_{task}_{run}"), "-o", str(out), "--no-xlsx"]
    proc = subprocess.run([sys.executable, "-m", "llmflow", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    return proc, json.loads((out / "compare_summary.json").read_text())


@pytest.mark.parametrize(("level", "task"), CASES)
def test_a_rerun_agrees_on_every_token(dumps, level, task):
    proc, summary = _compare(dumps, level, task, "rerun")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED"), proc.stdout[-500:]
    assert summary["divergence"] is None
    if task == "tensor":  # the logits level, from the output head: one row a new token
        assert summary["logits"]["steps"] == NEW_TOKENS and summary["logits"]["top1_agreement"] == 1.0


@pytest.mark.parametrize(("level", "task"), CASES)
def test_the_first_differing_token_is_dated_and_later_rows_marked(dumps, level, task):
    golden = json.loads((dumps / f"{level}_{task}_golden.ids.json").read_text())
    faulty = json.loads((dumps / f"{level}_{task}_fault.ids.json").read_text())
    parted = next(i for i, (g, t) in enumerate(zip(golden, faulty, strict=True)) if g != t)
    assert parted >= FAULT_STEP  # (the fault starts there; the texts part there or after)
    proc, summary = _compare(dumps, level, task, "fault")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    divergence = summary["divergence"]
    assert divergence["first_differing_token"] == parted, divergence
    assert divergence["golden_file"] is None and "token ids" in divergence["source"], divergence
    assert f"diverged: the texts part at token {parted}" in proc.stdout
    levels = summary["levels"]
    assert sum(s["diverged"] for s in levels.values()) > 0
    assert all(s["first_fail"] is None or s["first_fail"]["step"] <= parted for s in levels.values())
    if task == "tensor":
        assert summary["logits"]["first_token_mismatch_step"] == parted, summary["logits"]
