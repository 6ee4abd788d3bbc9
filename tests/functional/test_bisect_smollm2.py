"""SmolLM2 (30 layers), bf16 target: faults deep in the stack that layer outputs cannot show."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import bisect_dumps, make_dumps  # noqa: E402

from llmflow.localize.rank import first_jump  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "Tell me a story about a dragon."


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bisect-smollm2")
    make_dumps(tmp, "smollm2", prompt=PROMPT, max_new_tokens=10)
    return tmp / "golden"


def test_deep_fault_found_by_isolation_missed_by_layer_outputs(golden_dir, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, "smollm2", prompt=PROMPT, max_new_tokens=10, golden_dir=golden_dir,
                                patch="plugins/example_faults.py:scale_down_proj_layer_22"))
    assert v["first_bad_layer"] == "model.layers.22"
    assert v["first_bad_module"] == "model.layers.22.mlp.down_proj"
    assert v["first_bad_op"] == "model.layers.22.mlp.down_proj/mul.0"
    raw = {int(k): x for k, x in v["curves"]["relative L2 error"]["raw (layer output, dumps)"].items()}
    assert len(raw) == 30
    # the layer-output way: a jump detector and a plain 1% threshold both point elsewhere
    jump = first_jump([raw[i] for i in range(30)])
    assert jump != 22
    over = [i for i in range(30) if raw[i] >= 0.01]
    assert over and over[0] < 22, raw
    assert v["cost"]["bytes_fraction_of_full_api_dump"] < 0.10


def test_fault_in_attention_internals_names_the_container(golden_dir, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, "smollm2", prompt=PROMPT, max_new_tokens=10, golden_dir=golden_dir,
                                patch="plugins/example_faults.py:wrong_rope_layer_22"), estimate_cost=False)
    assert v["first_bad_module"] == "model.layers.22.self_attn"
    assert v["first_bad_op"].startswith("model.layers.22.self_attn/")


def test_plain_bf16_names_no_module(golden_dir, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, "smollm2", prompt=PROMPT, max_new_tokens=10, golden_dir=golden_dir),
                     estimate_cost=False)
    assert v["first_bad_module"] is None and "rounding" in v["diagnosis"]
    assert v["first_mismatch_token"] == 8  # ' tale' (fp32) against ' and' (bf16)
