"""SmolLM2 (30 layers), bf16 target: faults deep in the stack that layer outputs cannot show, on
the prefill and on the decode path, and the demo target's planted bug. Nothing here depends on
whether this CPU's bf16 kernels make the plain fp32 and bf16 texts part."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, make_dumps  # noqa: E402
from example_faults import DECODE_FAULTS  # noqa: E402

from llmflow.formats import open_dump  # noqa: E402
from llmflow.localize.rank import first_jump  # noqa: E402
from llmflow.localize.target_dump import raw_errors_joined  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "Tell me a story about a dragon."
DEMO_TARGET = f"{Path(__file__).resolve().parents[2] / 'plugins' / 'demo_bug.py'}:smollm2_with_planted_bug"


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bisect-smollm2")
    make_dumps(tmp, "smollm2", prompt=PROMPT, max_new_tokens=10)
    return tmp / "golden"


def test_deep_fault_found_by_isolation_missed_by_layer_outputs(golden_dir, tmp_path):
    dumps = make_dumps(tmp_path, "smollm2", prompt=PROMPT, max_new_tokens=10, golden_dir=golden_dir,
                       patch="plugins/example_faults.py:scale_down_proj_layer_22")
    v = bisect_dumps(dumps)
    assert v["first_bad_layer"] == "model.layers.22"
    assert v["first_bad_module"] == "model.layers.22.mlp.down_proj"
    assert v["first_bad_op"] == "model.layers.22.mlp.down_proj/mul.0"
    # the layer outputs of the prefill, as a dump comparison sees them: each whole tensor
    errors = raw_errors_joined(open_dump(dumps["golden_dump"]), open_dump(dumps["target_dump"]), 0, 0)
    raw = {int(n.rsplit(".", 1)[1]): m["l2"] / m["norm"] for n, m in errors.items()}
    assert len(raw) == 30
    # the layer-output way: a jump detector and a plain 1% threshold both point elsewhere
    jump = first_jump([raw[i] for i in range(30)])
    assert jump != 22
    over = [i for i in range(30) if raw[i] >= 0.01]
    assert over and over[0] < 22, raw
    assert v["cost"]["bytes_fraction_of_full_api_dump"] < 0.10


def test_a_fault_that_spares_the_token_of_massive_activation_is_named_by_its_tokens(golden_dir, tmp_path):
    """Every layer's down projection quantizes its input to int8 with one scale for the whole
    prompt: where one token's massive activation sets the scale (SmolLM2's layer 11 sees thousands
    at one token, about 1 at the others), every other token rounds to zero. Measured over the
    whole output, that layer is ~1% off (the massive token carries the norm) and other layers'
    coarser rounding looks worse; per token it has lost almost everything."""
    dumps = make_dumps(tmp_path, "smollm2", prompt=PROMPT, max_new_tokens=10, golden_dir=golden_dir,
                       patch="plugins/example_faults.py:per_tensor_int8_every_layer")
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "fail", v["headline"]
    assert v["replay"]["step"] == 0  # at a decode step the one token is its own tensor: no fault
    assert v["first_bad_module"] == "model.layers.11.mlp.down_proj", v["candidates"][:3]
    top = v["candidates"][0]
    assert top["token_rel"] > 0.5 and top["whole_rel"] < 0.05, top
    assert "the average token's output is" in v["diagnosis"]


def test_fault_in_attention_internals_names_the_container(golden_dir, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, "smollm2", prompt=PROMPT, max_new_tokens=10, golden_dir=golden_dir,
                                patch="plugins/example_faults.py:wrong_rope_layer_22"), estimate_cost=False)
    assert v["first_bad_module"] == "model.layers.22.self_attn"
    assert v["first_bad_op"].startswith("model.layers.22.self_attn/")


def test_plain_bf16_names_no_module(golden_dir, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, "smollm2", prompt=PROMPT, max_new_tokens=10, golden_dir=golden_dir),
                     estimate_cost=False)
    assert v["status"] == "pass" and v["first_bad_module"] is None, v["headline"]
    # whether the texts part is the CPU's business; what the verdict says of it is ours
    if v["first_mismatch_token"] is None:
        assert "matches" in v["diagnosis"] and 1 in v["replay"]["steps_tried"]
    else:
        assert "rounding" in v["diagnosis"] and v["replay"]["step"] == v["first_mismatch_token"]


# each decode fault once on the real model, in an early or a late layer (both layers for every
# fault, on the tiny families: test_localize_decode.py)
DECODE_CASES = [(fault, (3, 25)[i % 2]) for i, fault in enumerate(DECODE_FAULTS)]


@pytest.mark.parametrize(("fault", "layer"), DECODE_CASES)
def test_decode_fault_named_with_its_step(fault, layer, golden_dir, tmp_path):
    dumps = make_dumps(tmp_path, "smollm2", prompt=PROMPT, max_new_tokens=10, golden_dir=golden_dir,
                       patch=f"plugins/example_faults.py:{fault}_layer_{layer}")
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == f"model.layers.{layer}.self_attn", v["candidates"][:3]
    assert v["replay"]["step"] > 0 and f"decode step {v['replay']['step']}" in v["headline"]
    assert v["replay"]["golden_rerun_max_abs_diff"] == 0.0


def test_demo_target_planted_bug_is_found_and_said(golden_dir, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, "smollm2", prompt=PROMPT, max_new_tokens=10, golden_dir=golden_dir,
                                target_model=DEMO_TARGET), estimate_cost=False)
    assert v["status"] == "fail"
    assert v["first_bad_module"] == "model.layers.17.self_attn"
    assert v["first_bad_op"] == "model.layers.17.self_attn/scaled_dot_product_attention.0"
    assert v["replay"]["step"] > 0
    assert "planted bug" in v["diagnosis"] and v["notes"]
