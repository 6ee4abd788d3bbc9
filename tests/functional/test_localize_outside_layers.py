"""Faults outside the decoder layers (the input embedding, the final norm, lm_head) are named to
their module on every family: the bisect replays them at the prefill even where the golden dump
holds the decoder layers alone, and never calls such a port clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, golden_maker, make_dumps  # noqa: E402
from example_faults import OUTSIDE_FAULTS  # noqa: E402

from llmflow.models import load_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SIZE = "layers=4,hidden=64,intermediate=128,seed=3"
FAMILIES = ["llama", "qwen2", "gemma2", "gpt2", "phi3", "mixtral"]


def spec(family: str) -> str:
    return f"tiny-{family}:{SIZE}"


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return golden_maker(tmp_path_factory, spec)


@pytest.mark.parametrize("fault", sorted(OUTSIDE_FAULTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_fault_outside_the_layers_is_named_to_its_module(family, fault, goldens, tmp_path):
    dumps = make_dumps(tmp_path, spec(family), patch=f"plugins/example_faults.py:{fault}",
                       golden_dir=goldens(family))
    v = bisect_dumps(dumps, estimate_cost=False)
    want = OUTSIDE_FAULTS[fault][1](load_model(spec(family)).model)
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == want, [c["name"] for c in v["candidates"][:3]]
    assert v["first_bad_layer"] is None
    assert "median own error of the model's modules" in v["headline"], v["headline"]
    assert v["first_bad_op"] and v["first_bad_op"].startswith(want + "/")


def test_the_recipe_names_the_final_norm_from_the_command_line(tmp_path):
    """The user's way: the bisect workflow, a decoder-layer golden dump, a target whose final norm
    is wrong; FAILED (exit 1) naming the norm, never PASSED or a decoder layer."""
    model = spec("qwen2")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "llmflow", "run", str(REPO / "workflows" / "llama2_bisect.yaml"),
           "--run-dir", str(tmp_path / "run"), "--progress", "plain",
           "--set", f"golden_model={model}", "--set", f"target_model={model}",
           "--set", "max_new_tokens=4",
           "--set", f"target_patch={REPO / 'plugins' / 'example_faults.py'}:scale_final_norm"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    last = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert last.startswith("FAILED: model.norm is the fault"), last
    verdict = json.loads((tmp_path / "run" / "summary.json").read_text())["verdict"]
    assert verdict["first_bad_module"] == "model.norm" and verdict["replay"]["step"] == 0
