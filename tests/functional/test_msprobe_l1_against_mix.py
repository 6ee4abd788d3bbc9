"""msprobe dumps of one model at two levels, as teams have them: an L1 golden (API calls with no
module: ``/linear.3``) against a mix target (the same calls inside their modules:
``model.layers.0.mlp.up_proj/linear.0``). The k-th call of an API in a step pairs with the k-th:
the same clean run passes with its API calls paired, and a halved weight fails (a user's msprobe
script run as a subprocess for each dump)."""

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from workflow_helpers import REPO, llmflow  # noqa: E402

SCRIPT = """
import json, sys, torch
from msprobe.pytorch import PrecisionDebugger
from llmflow.models import encode_prompt, load_model

out, level, fault = sys.argv[1], sys.argv[2], sys.argv[3] == "fault"
lm = load_model("tiny-qwen2:layers=2,hidden=32,intermediate=64,seed=3")
if fault:
    with torch.no_grad():
        lm.model.model.layers[1].mlp.down_proj.weight.mul_(0.5)
config = {"task": "tensor", "dump_path": out, "rank": [], "step": [], "level": level,
          "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}
with open(out + ".json", "w") as f:
    json.dump(config, f)
debugger = PrecisionDebugger(config_path=out + ".json")
ids, past = torch.tensor([encode_prompt(lm.tokenizer, "hello there")]), None
with torch.no_grad():
    for _ in range(2):
        debugger.start(model=lm.model)
        result = lm.model(input_ids=ids, past_key_values=past, use_cache=True)
        debugger.stop()
        debugger.step()
        past, ids = result.past_key_values, result.logits[:, -1:].argmax(-1)
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("msprobe_levels")
    (out / "dump.py").write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
    for name, level, fault in (("golden_L1", "L1", "clean"), ("clean_mix", "mix", "clean"),
                               ("fault_mix", "mix", "fault")):
        proc = subprocess.run([sys.executable, str(out / "dump.py"), str(out / name), level, fault],
                              capture_output=True, text=True, timeout=300, cwd=out, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_an_l1_golden_pairs_with_a_mix_target_of_the_same_run(tmp_path, dumps):
    proc = llmflow("compare", "-gp", str(dumps / "golden_L1"), "-mp", str(dumps / "clean_mix"),
                   "-o", str(tmp_path / "out"), "--no-xlsx")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    api = summary["levels"]["api"]
    assert api["counts"]["pass"] == api["rows"] > 0 and api["match"] == {"order": api["rows"]}, api


def test_a_halved_weight_fails_against_the_l1_golden(tmp_path, dumps):
    proc = llmflow("compare", "-gp", str(dumps / "golden_L1"), "-mp", str(dumps / "fault_mix"),
                   "-o", str(tmp_path / "out"), "--no-xlsx")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("FAILED"), proc.stdout[-3000:]
    assert "found no partner" not in last
