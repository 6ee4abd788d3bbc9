"""Faults that no module inside a decoder layer explains are named all the same, on every family
and from the command line, never PASSED:

* outside the decoder layers (the input embedding, the final norm, lm_head): the bisect replays
  them at the prefill even where the golden dump holds the decoder layers alone;
* in a decoder layer's own code (between its modules: a residual add, a scale): no module stands
  out alone, the layer replayed whole on the golden inputs does, at the prefill or, for a fault
  on the decode path only, at a decode step (the golden re-run's KV cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, golden_maker, make_dumps  # noqa: E402
from example_faults import OUTSIDE_FAULTS  # noqa: E402

from llmflow.models import load_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAYER = 2
SIZE = "layers=5,hidden=64,intermediate=128,seed=3"
FAMILIES = ["llama", "qwen2", "gemma2", "gpt2", "phi3", "mixtral"]


def spec(family: str) -> str:
    return f"tiny-{family}:{SIZE}"


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return golden_maker(tmp_path_factory, spec)


def _run_recipe(tmp_path: Path, model: str, patch: str) -> tuple[subprocess.CompletedProcess, str]:
    """``llmflow run llama2_bisect`` as a user types it: the process and its last line."""
    cmd = [sys.executable, "-m", "llmflow", "run", str(REPO / "workflows" / "llama2_bisect.yaml"),
           "--run-dir", str(tmp_path / "run"), "--progress", "plain", "--set", f"golden_model={model}",
           "--set", f"target_model={model}", "--set", "max_new_tokens=4",
           "--set", f"target_patch={REPO / 'plugins' / 'example_faults.py'}:{patch}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    return done, done.stdout.strip().splitlines()[-1]


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


@pytest.mark.parametrize("fault", ["scale_layer_code", "decode_layer_code"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_whose_own_code_is_wrong_is_named(family, fault, goldens, tmp_path):
    dumps = make_dumps(tmp_path, spec(family), golden_dir=goldens(family),
                       patch=f"plugins/example_faults.py:{fault}_layer_{LAYER}")
    v = bisect_dumps(dumps, estimate_cost=False)
    layer = v["first_bad_layer"]
    assert v["status"] == "fail", v["headline"]
    assert layer is not None and layer.endswith(f".{LAYER}") and v["first_bad_module"] == layer
    assert v["headline"].startswith(f"{layer}'s own code is the fault"), v["headline"]
    assert not any(c.get("anomalous") for c in v["candidates"])  # no module stood out alone
    if fault.startswith("decode_"):  # the prefill is untouched: named at a decode step
        assert v["replay"]["step"] > 0, v["headline"]


def test_the_recipe_names_the_final_norm_from_the_command_line(tmp_path):
    done, last = _run_recipe(tmp_path, spec("qwen2"), "scale_final_norm")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert last.startswith("FAILED: model.norm is the fault"), last
    verdict = json.loads((tmp_path / "run" / "summary.json").read_text())["verdict"]
    assert verdict["first_bad_module"] == "model.norm" and verdict["replay"]["step"] == 0


def test_the_recipe_names_the_layer_from_the_command_line(tmp_path):
    done, last = _run_recipe(tmp_path, spec("llama"), f"scale_layer_code_layer_{LAYER}")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert last.startswith(f"FAILED: model.layers.{LAYER}'s own code is the fault"), last
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["verdict"]["first_bad_layer"] == f"model.layers.{LAYER}"
    assert (tmp_path / "run" / "report" / "report.html").is_file()
