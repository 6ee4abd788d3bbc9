"""Injected faults in a tiny Llama with a bf16 target: the verdict names the layer, module and op."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, make_dumps  # noqa: E402
from example_faults import FAULT_MODULES  # noqa: E402

MODEL = "tiny-llama:layers=6,hidden=64,intermediate=128,seed=3"
LAYER = 4


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bisect-golden")
    make_dumps(tmp, MODEL)
    return tmp / "golden"


# wrong_rope is left to the SmolLM2 test: a randomly initialised model's attention is nearly
# uniform, so rotating q and k the wrong way barely changes its output
@pytest.mark.parametrize("fault", sorted(set(FAULT_MODULES) - {"wrong_rope"}))
def test_fault_is_named(fault, golden_dir, tmp_path):
    patch = f"plugins/example_faults.py:{fault}_layer_{LAYER}"
    dumps = make_dumps(tmp_path, MODEL, patch=patch, golden_dir=golden_dir)
    v = bisect_dumps(dumps, estimate_cost=False)
    module = f"model.layers.{LAYER}.{FAULT_MODULES[fault]}"
    assert v["first_bad_layer"] == f"model.layers.{LAYER}", v["diagnosis"]
    assert v["first_bad_module"] == module, v["candidates"][:3]
    assert v["first_bad_op"] and v["first_bad_op"].startswith(module), v["ops"]
    assert v["evidence"][0]["name"] == module and v["evidence"][0]["score"] >= 3
    assert module in v["diagnosis"]


def test_ops_pin_the_wrong_op(golden_dir, tmp_path):
    eps = bisect_dumps(make_dumps(tmp_path, MODEL, golden_dir=golden_dir,
                                  patch=f"plugins/example_faults.py:wrong_eps_layer_{LAYER}"),
                       estimate_cost=False)
    assert eps["first_bad_op"] == f"model.layers.{LAYER}.post_attention_layernorm/add.0"
    act = bisect_dumps(make_dumps(tmp_path / "act", MODEL, golden_dir=golden_dir,
                                  patch=f"plugins/example_faults.py:wrong_act_layer_{LAYER}"),
                       estimate_cost=False)
    assert act["first_bad_op"] == f"model.layers.{LAYER}.mlp.act_fn/relu.0"
    row = next(r for r in act["ops"] if r["name"] == act["first_bad_op"])
    assert (row["golden_api"], row["target_api"], row["status"]) == ("silu", "relu", "different api")


def test_no_fault_names_nothing(golden_dir, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, MODEL, golden_dir=golden_dir))
    assert v["first_bad_layer"] is None and v["first_bad_module"] is None and v["first_bad_op"] is None
    assert "stands out" in v["diagnosis"]
    assert all(not r["anomalous"] for r in v["candidates"] if r.get("score") is not None)
    cost = v["cost"]
    assert cost["bytes_dumped"] > 0 and cost["full_api_dump_bytes_estimate"] > cost["bytes_dumped"]
    assert cost["full_api_dump_estimate_method"] == "one layer x N"
    assert cost["model_runs"]["full_generations"] == 2


def test_full_golden_dump_and_recomputed_layers_agree(golden_dir, tmp_path):
    # the recipe dumps only the decoder layers and recomputes their modules in memory; a full
    # module dump must give exactly the same own errors
    patch = f"plugins/example_faults.py:noisy_q_proj_layer_{LAYER}"
    slim = bisect_dumps(make_dumps(tmp_path / "slim", MODEL, patch=patch, golden_dir=golden_dir),
                        estimate_cost=False, own_error_steps=0)
    full_dumps = make_dumps(tmp_path / "full", MODEL, patch=patch, golden_all=True)
    full = bisect_dumps(full_dumps, estimate_cost=False, own_error_steps=0)
    assert slim["cost"]["model_runs"]["golden_layers_recomputed"] == 6
    assert full["cost"]["model_runs"]["golden_layers_recomputed"] == 0
    # (the slim dump holds the layers at every step, the full one every module at the prefill)
    assert full["cost"]["golden_dump_bytes"] > 3 * slim["cost"]["golden_dump_bytes"]
    errs = {r["name"]: r["error"] for r in full["candidates"] if r.get("layer")}
    for r in slim["candidates"]:
        if r["name"] in errs:
            assert r["error"] == errs[r["name"]], r["name"]
    assert slim["first_bad_op"] == full["first_bad_op"] == f"model.layers.{LAYER}.self_attn.q_proj/randn.0"


def test_verdict_carries_report_data(golden_dir, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, MODEL, golden_dir=golden_dir,
                                patch=f"plugins/example_faults.py:scale_down_proj_layer_{LAYER}"),
                     estimate_cost=False)
    iso = v["curves"]["relative L2 error"]["isolated (worst module, replay)"]
    raw = v["curves"]["relative L2 error"]["raw (layer output, dumps)"]
    assert sorted(map(int, iso)) == list(range(6)) and sorted(map(int, raw)) == list(range(6))
    assert max(iso, key=iso.get) == str(LAYER)
    assert len(v["texts"]["golden"]["tokens"]) == len(v["token_rows"]) or v["token_rows"]
    assert v["token_rows"][0]["step"] == 0 and "kl" in v["token_rows"][0]
