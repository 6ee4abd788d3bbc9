"""``dump_bisect`` on dumps a user's msit-style script made (``from llmflow import DumpConfig,
register_hook``, the hook never removed), run as a subprocess, the golden model given:

* a fault small enough that the logits stay within their thresholds and the texts never part
  (one module's output 2% off at one decode step): the compare fails that module's rows at that
  step, and the bisect replays the step of the compare's first failing row when nothing stands
  out where the logits point, so it names the module there instead of passing (two families);
* msit's default ``token_range=[0]`` with a fault at a decode step: INCONCLUSIVE, saying the dump
  holds no module at that step and to dump it with the step in the token range;
* statistics dumps (``data_mode statistics``): INCONCLUSIVE, saying the dump holds statistics
  alone and to dump tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LLAMA = "tiny-llama:layers=2,hidden=64,seed=0"
SCRIPT = """
import sys, torch
from llmflow import DumpConfig, register_hook
from llmflow.models import load_model

out, spec, step, scale, tokens, data_mode = sys.argv[1:7]
step, scale = int(step), float(scale)
model = load_model(spec).model.eval()
if step >= 0:  # layer 0's MLP output scaled at one forward pass only
    calls = {"n": -1}
    model.register_forward_pre_hook(lambda m, a: calls.__setitem__("n", calls["n"] + 1))
    model.model.layers[0].mlp.register_forward_hook(
        lambda m, a, o: o * scale if calls["n"] == step else None)
register_hook(model, DumpConfig(dump_path=out, token_range=[int(t) for t in tokens.split(",")],
                                tensor_part=2, data_mode=data_mode))
ids = torch.tensor([[1, 17, 42, 99, 5, 63, 7]])
with torch.no_grad():
    model.generate(ids, max_new_tokens=6, do_sample=False)
"""


def _dump_and_bisect(tmp_path: Path, spec: str, *, fault_step: int, scale: float, tokens: str = "0,1,2,3,4,5",
                     data_mode: str = "tensor") -> subprocess.CompletedProcess:
    script = tmp_path / "dump_like_msit.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name, step in (("golden", -1), ("target", fault_step)):
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / name), spec, str(step), str(scale),
                               tokens, data_mode], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    args = ["run", "dump_bisect", "--run-dir", str(tmp_path / "run"),
            "--set", f"golden_dump={tmp_path / 'golden'}", "--set", f"target_dump={tmp_path / 'target'}",
            "--set", f"golden_model={spec}"]
    return subprocess.run([sys.executable, "-m", "llmflow", *args], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path, env=env)


@pytest.mark.parametrize("spec", [LLAMA, "tiny-qwen2:layers=3,hidden=64,intermediate=128,seed=1"])
def test_dump_bisect_names_a_fault_the_logits_do_not_show(tmp_path, spec):
    proc = _dump_and_bisect(tmp_path, spec, fault_step=3, scale=1.02)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last.startswith("FAILED: model.layers.0.mlp is the fault") and "decode step 3" in last, last
    verdict = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    # the logits never said where: no step's logits fail, and the texts agree
    assert verdict["first_bad_token"] is None and verdict["first_mismatch_token"] is None, verdict


def test_a_step_outside_the_token_range_is_named_with_the_dump_to_make(tmp_path):
    proc = _dump_and_bisect(tmp_path, LLAMA, fault_step=3, scale=1.3, tokens="0")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert lines[-1].startswith("INCONCLUSIVE: the target dump holds no module at step "), lines[-1]
    assert "dumped at step 0 only (its token range)" in lines[-1], lines[-1]
    nxt = next(line for line in lines if line.startswith("next:"))
    assert "in the token range" in nxt, nxt


def test_statistics_dumps_ask_for_tensors(tmp_path):
    proc = _dump_and_bisect(tmp_path, LLAMA, fault_step=0, scale=1.3, data_mode="statistics")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert lines[-1].startswith("INCONCLUSIVE: the target dump holds statistics alone at step 0"), lines[-1]
    nxt = next(line for line in lines if line.startswith("next:"))
    assert "data_mode tensor" in nxt, nxt
