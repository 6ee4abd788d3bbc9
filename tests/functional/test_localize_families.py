"""The bisect on every decoder family, with no layer or class hint: a clean bf16 target blames
nothing, and a fault at a deep layer is named to its layer and module (tiny seeded models)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, golden_maker, make_dumps  # noqa: E402
from example_faults import faulty_module  # noqa: E402

from llmflow.models import load_model  # noqa: E402

LAYER = 4
SIZE = "layers=6,hidden=64,intermediate=128,seed=3"
CUSTOM = "tests/fixtures/custom_model.py:build"  # a hand-written decoder with other names
# bloom and codegen write their causal masks as float32's minimum, which bf16 holds as -inf: the
# faithful cast, never the first bad op
DENSE = ["llama", "qwen2", "mistral", "phi3", "gemma2", "gpt2", "gpt-neox", "falcon", "bloom", "codegen"]
DENSE_FAULTS = ["scale_down_proj", "wrong_act", "wrong_eps", "scale_attn_out"]
MOE = ["mixtral", "qwen2-moe"]
MOE_FAULTS = ["scale_expert", "wrong_router", "scale_attn_out", "wrong_eps"]


def spec(family: str) -> str:
    return CUSTOM if family == "custom" else f"tiny-{family}:{SIZE}"


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    """One golden dump per family, made on first use."""
    return golden_maker(tmp_path_factory, spec)


def _bisect(family: str, fault: str | None, goldens, tmp_path: Path) -> dict:
    patch = f"plugins/example_faults.py:{fault}_layer_{LAYER}" if fault else None
    return bisect_dumps(make_dumps(tmp_path, spec(family), patch=patch, golden_dir=goldens(family)),
                        estimate_cost=False)


@pytest.mark.parametrize("family", [*DENSE, *MOE, "custom"])
def test_clean_bf16_target_blames_nothing(family, goldens, tmp_path):
    v = _bisect(family, None, goldens, tmp_path)
    assert v["status"] == "pass", v["headline"]
    assert v["first_bad_module"] is None and v["replay"]["replayed"] > 0
    assert v["replay"]["not_replayable"] == 0, v["replay"]["reasons"]


@pytest.mark.parametrize("fault", DENSE_FAULTS)
@pytest.mark.parametrize("family", [*DENSE, "custom"])
def test_fault_named_to_layer_and_module(family, fault, goldens, tmp_path):
    v = _bisect(family, fault, goldens, tmp_path)
    want = faulty_module(load_model(spec(family)).model, fault, LAYER)
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == want, [c["name"] for c in v["candidates"][:3]]
    assert v["first_bad_layer"] and want.startswith(v["first_bad_layer"] + ".")
    assert v["first_bad_op"] and v["first_bad_op"].startswith(want)
    op = next(o for o in v["ops"] if o["name"] == v["first_bad_op"])
    assert op["iso"] is None or op["iso"] != "inf", op  # no overflow planted: no op overflows


@pytest.mark.parametrize("fault", MOE_FAULTS)
@pytest.mark.parametrize("family", MOE)
def test_moe_fault_named(family, fault, goldens, tmp_path):
    v = _bisect(family, fault, goldens, tmp_path)
    want = faulty_module(load_model(spec(family)).model, fault, LAYER)
    assert v["status"] == "fail" and v["first_bad_module"] == want, v["headline"]
    if fault == "scale_expert":  # one expert of the fused experts module: it is named
        assert v["first_bad_expert"] == 1 and "expert 1" in v["headline"]
        assert {r["expert"] for r in v["experts"]} >= {1}


def test_every_expert_wrong_names_the_module_not_one_expert(goldens, tmp_path):
    v = _bisect("mixtral", "scale_experts", goldens, tmp_path)
    assert v["first_bad_module"] == f"model.layers.{LAYER}.mlp.experts"
    assert v["first_bad_expert"] is None and len(v["experts"]) >= 2
