"""Faults that live only on the decode path (the kernel that attends one new token to the KV
cache; the prefill untouched): the bisect replays the step where the divergence starts with the
golden KV cache and names the layer's attention, on several families and cache classes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, golden_maker, make_dumps  # noqa: E402
from example_faults import DECODE_FAULTS, faulty_module  # noqa: E402

from llmflow.models import load_model  # noqa: E402

# init=0.2: attention peaked enough that a decode-kernel fault moves the numbers, as in a trained
# model (a default-initialised tiny model attends almost uniformly)
SIZE = "layers=6,hidden=64,intermediate=128,seed=3,init=0.2"
STATIC = Path(__file__).resolve().parents[1] / "fixtures" / "static_cache_model.py"


def spec(family: str) -> str:
    return f"{STATIC}:build" if family == "static-cache" else f"tiny-{family}:{SIZE}"


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    """One golden dump per family, made on first use."""
    return golden_maker(tmp_path_factory, spec)


CASES = [(family, fault, layer) for family in ("llama", "qwen2", "gpt-neox", "static-cache")
         for fault in DECODE_FAULTS for layer in (1, 4)]
CASES += [(family, fault, 4) for family in ("gpt2", "gemma2", "phi3")
          for fault in DECODE_FAULTS if not (family == "gpt2" and fault == "decode_rope_shift")]


@pytest.mark.parametrize(("family", "fault", "layer"), CASES)
def test_decode_fault_is_named_at_a_decode_step(family, fault, layer, goldens, tmp_path):
    dumps = make_dumps(tmp_path, spec(family), golden_dir=goldens(family),
                       patch=f"plugins/example_faults.py:{fault}_layer_{layer}")
    v = bisect_dumps(dumps, estimate_cost=False)
    want = faulty_module(load_model(spec(family)).model, fault, layer)
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == want, [c["name"] for c in v["candidates"][:3]]
    assert v["replay"]["step"] > 0 and v["replay"]["source"] == "golden re-run"
    assert f"decode step {v['replay']['step']}" in v["headline"]
    assert v["replay"]["golden_rerun_max_abs_diff"] == 0.0  # the re-run reproduces the golden dump
    assert v["first_bad_op"] and v["first_bad_op"].startswith(want)


def test_clean_run_replays_a_decode_step_too_and_blames_nothing(goldens, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, spec("llama"), golden_dir=goldens("llama")), estimate_cost=False)
    assert v["status"] == "pass" and v["first_bad_module"] is None
    assert any(s > 0 for s in v["replay"]["steps_tried"]), v["replay"]


def test_prefill_fault_is_replayed_at_the_prefill(goldens, tmp_path):
    dumps = make_dumps(tmp_path, spec("llama"), golden_dir=goldens("llama"),
                       patch="plugins/example_faults.py:scale_down_proj_layer_4")
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["first_bad_module"] == "model.layers.4.mlp.down_proj"
    assert v["replay"]["step"] == 0 and v["replay"]["steps_tried"] == [0]


def test_replaying_another_step_than_the_divergence_is_inconclusive(goldens, tmp_path):
    dumps = make_dumps(tmp_path, spec("llama"), golden_dir=goldens("llama"),
                       patch="plugins/example_faults.py:decode_attn_scale_layer_4")
    v = bisect_dumps(dumps, estimate_cost=False, replay_step=0)
    assert v["status"] == "inconclusive", v["headline"]
    assert v["first_bad_module"] is None and v["inconclusive"]["next"]
    assert "replay_step" in v["inconclusive"]["next"]


def test_decode_step_without_the_golden_model_is_inconclusive(goldens, tmp_path):
    dumps = make_dumps(tmp_path, spec("llama"), golden_dir=goldens("llama"),
                       patch="plugins/example_faults.py:decode_attn_scale_layer_4")
    dumps["golden_spec"] = {**dumps["golden_spec"], "model": str(tmp_path / "gone")}
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "inconclusive", v["headline"]
    assert "golden model cannot be loaded" in v["inconclusive"]["reason"]


@pytest.mark.parametrize(("fault", "prefill_too"),
                         [("decode_softmax_scale", False), ("scale_down_proj", True)])
def test_own_error_per_step_tells_decode_faults_from_every_call_ones(fault, prefill_too, goldens, tmp_path):
    """The chosen module replayed at each step from the prefill on: a decode-kernel fault leaves
    the prefill at the dtype's rounding, a fault in every forward call stands out at step 0 too;
    the other layers' median stays at the rounding throughout."""
    dumps = make_dumps(tmp_path, spec("llama"), golden_dir=goldens("llama"),
                       patch=f"plugins/example_faults.py:{fault}_layer_1")
    v = bisect_dumps(dumps, estimate_cost=False, own_error_steps=4)
    own = v["own_error_steps"]
    assert v["status"] == "fail" and own["module"] == v["first_bad_module"] and own["metric"] == "rel_l2"
    rows = {r["step"]: r for r in own["rows"]}
    assert sorted(rows) == [0, 1, 2, 3] and all(r["peers"] == 5 for r in rows.values())
    rounding = max(r["peer_median"] for r in rows.values())
    assert rounding < 0.02
    assert all(rows[s]["own_error"] > 10 * rounding for s in (1, 2, 3)), own
    assert (rows[0]["own_error"] > 10 * rounding) == prefill_too, own
    assert "module: own error per step" in v["cost"]["bisect_phase_seconds"]
