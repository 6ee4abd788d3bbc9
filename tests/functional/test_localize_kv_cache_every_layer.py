"""A KV cache kept in a lower precision in every layer (fp8 keys and values on the decode path, the
model in bf16): no layer stands out and the cache writes' error (~0.025) is under the bf16 limits of
a whole tensor, yet it is ~9x what a correct cache write carries. The bisect names the attention's
cache write in every layer as the fault, on the decode path; the same families' clean bf16 ports
are never blamed for their cache. Dense, MoE and GPT-NeoX naming."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, golden_maker, make_dumps  # noqa: E402
from example_faults import faulty_module  # noqa: E402

from llmflow.models import load_model  # noqa: E402
from llmflow.structure import module_type  # noqa: E402

# init=0.2: attention peaked enough that a decode-path fault moves the logits (test_localize_decode)
SIZE = "layers=4,hidden=64,intermediate=128,seed=3,init=0.2"
FAMILIES = ["llama", "mixtral", "gpt-neox"]
CACHE_WRITE = "the keys and values it writes to its KV cache"


def spec(family: str) -> str:
    return f"tiny-{family}:{SIZE}"


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return golden_maker(tmp_path_factory, spec)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_lossy_kv_cache_in_every_layer_is_the_attentions_fault(family, goldens, tmp_path):
    dumps = make_dumps(tmp_path, spec(family), golden_dir=goldens(family),
                       patch="plugins/example_faults.py:decode_cache_fp8_every_layer")
    v = bisect_dumps(dumps, estimate_cost=False)
    attention = faulty_module(load_model(spec(family)).model, "decode_cache_fp8", 0)
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == attention, v["headline"]
    assert v["headline"].startswith(f"{module_type(attention)} is the fault in every layer: {CACHE_WRITE}")
    assert v["replay"]["step"] > 0 and "fp8 or int8 KV cache quantization" in v["diagnosis"]
    assert "The prefill has it too" not in v["diagnosis"], v["diagnosis"]  # a decode-path fault


@pytest.mark.parametrize("family", FAMILIES)
def test_a_clean_bf16_port_is_not_blamed_for_its_kv_cache(family, goldens, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, spec(family), golden_dir=goldens(family)), estimate_cost=False)
    assert v["status"] == "pass", v["headline"]
    assert CACHE_WRITE not in v["headline"] and v["first_bad_module"] is None
