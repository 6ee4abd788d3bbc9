"""Ranking on synthetic own-error tables: the faulty module must come first."""

from __future__ import annotations

import random
from statistics import median

import pytest

from llmflow.localize.rank import (
    first_jump,
    layer_curve,
    layer_of,
    module_type,
    pick_candidate,
    rank_modules,
)

TYPES = {  # bf16 noise differs by module type: a realistic spread of own errors
    "input_layernorm": 0.002, "self_attn.q_proj": 0.004, "self_attn.o_proj": 0.005,
    "self_attn": 0.006, "mlp.gate_proj": 0.004, "mlp.down_proj": 0.03, "mlp": 0.02,
    "mlp.act_fn": 0.003,
}


def _table(n_layers: int, fault: tuple[int, str, float] | None = None, seed: int = 0):
    rng = random.Random(seed)
    rows = []
    for layer in range(n_layers):
        for suffix, base in TYPES.items():
            err = base * rng.uniform(0.7, 1.4)
            if fault and fault[0] == layer and fault[1] == suffix:
                err *= fault[2]
            rows.append({"name": f"model.layers.{layer}.{suffix}", "rel_l2": err})
    rows.append({"name": "lm_head", "rel_l2": 0.004})
    rows.append({"name": "model.norm", "rel_l2": 0.002})
    return rows


def test_layer_and_type_names():
    assert layer_of("model.layers.7.mlp.down_proj") == "model.layers.7"
    assert layer_of("model.layers.12") == "model.layers.12"
    assert layer_of("lm_head") is None
    assert layer_of("model.layers.3.self_attn/matmul.0") == "model.layers.3"
    assert module_type("model.layers.7.mlp.down_proj") == "model.layers.*.mlp.down_proj"
    assert module_type("transformer.h.0.attn") == "transformer.h.*.attn"
    assert module_type("lm_head") == "lm_head"


def test_fault_in_small_module_beats_noisier_types():
    # down_proj is noisy (0.03) everywhere; a 5x fault in a q_proj (0.02) is below that in
    # absolute terms but must still rank first, because it is compared with other q_projs.
    ranked = rank_modules(_table(30, (22, "self_attn.q_proj", 5.0)))
    assert ranked[0]["name"] == "model.layers.22.self_attn.q_proj"
    assert ranked[0]["anomalous"] and ranked[0]["score"] > 3
    assert ranked[0]["z"] is not None and ranked[0]["z"] > 3
    assert not any(r["anomalous"] for r in ranked[2:])  # the container may follow, nothing else


def test_leaf_is_preferred_over_its_container():
    rows = _table(6, (2, "mlp.act_fn", 50.0))
    for r in rows:  # the container inherits the fault and even scores higher
        if r["name"] == "model.layers.2.mlp":
            r["rel_l2"] = 0.02 * 200
    ranked = rank_modules(rows)
    assert ranked[0]["name"] == "model.layers.2.mlp"
    assert pick_candidate(ranked)["name"] == "model.layers.2.mlp.act_fn"


def test_two_layers_use_leave_one_out():
    ranked = rank_modules(_table(2, (1, "mlp.down_proj", 10.0)))
    assert ranked[0]["name"] == "model.layers.1.mlp.down_proj"
    assert ranked[0]["score"] > 5


def test_no_fault_means_nothing_anomalous():
    ranked = rank_modules(_table(30))
    assert not any(r["anomalous"] for r in ranked)
    assert pick_candidate(ranked)["name"] == ranked[0]["name"]


def test_unreplayable_rows_go_last():
    rows = _table(3) + [{"name": "model.layers.0.self_attn.rotary", "rel_l2": None}]
    ranked = rank_modules(rows)
    assert ranked[-1]["name"] == "model.layers.0.self_attn.rotary"
    assert ranked[-1]["score"] is None and ranked[-1]["rank"] == len(ranked)
    assert pick_candidate(rank_modules([{"name": "x", "rel_l2": None}])) is None


def test_layer_curve_takes_worst_module_per_layer():
    ranked = rank_modules(_table(4, (3, "mlp", 100.0)))
    curve = layer_curve(ranked, key="score")
    assert list(curve) == [0, 1, 2, 3]
    assert max(curve, key=curve.get) == 3


def test_first_jump():
    assert first_jump([0.001, 0.002, 0.0015, 0.05, 0.06]) == 3
    assert first_jump([0.001, 0.002, 0.003]) is None
    assert first_jump([None, 0.001, float("nan"), 0.01]) == 3
    assert first_jump([0.5, 0.5], floor=0.01) == 0  # the first op itself is far above noise
    assert first_jump([1e-9, 1e-6], floor=1e-3) is None  # jumps inside the noise floor don't count


def test_an_overflow_ranks_first_whatever_its_peers_do():
    rows = _table(6, (2, "mlp.down_proj", 50.0))  # a plain fault elsewhere scores high
    for r in rows:
        if r["name"] in ("model.layers.4.self_attn", "model.layers.5.self_attn"):
            r.update(rel_l2=float("inf"), nonfinite=120, numel=512)
    ranked = rank_modules(rows)
    assert [r["name"] for r in ranked[:2]] == ["model.layers.4.self_attn", "model.layers.5.self_attn"]
    top = ranked[0]
    assert top["overflow"] and top["anomalous"] and top["score"] == float("inf")
    assert "overflow" in top["reason"] and "120 of 512" in top["reason"]
    assert 0 < top["typical"] < 0.1  # the type's finite errors, for reference
    assert ranked[2]["name"] == "model.layers.2.mlp.down_proj" and not ranked[2].get("overflow")
    assert pick_candidate(ranked)["name"] == "model.layers.4.self_attn"


def test_below_an_overflow_only_an_overflowing_descendant_is_picked():
    rows = _table(6, (4, "self_attn.o_proj", 20.0))  # anomalous, but finite: not where the Inf came from
    for r in rows:
        if r["name"] == "model.layers.4.self_attn":
            r.update(rel_l2=float("inf"), nonfinite=3, numel=64)
    assert pick_candidate(rank_modules(rows))["name"] == "model.layers.4.self_attn"
    for r in rows:
        if r["name"] == "model.layers.4.self_attn.q_proj":
            r.update(rel_l2=float("inf"), nonfinite=3, numel=64)
    assert pick_candidate(rank_modules(rows))["name"] == "model.layers.4.self_attn.q_proj"


def _sized_rows(norms: list[float], rel: list[float]) -> list[dict]:
    """One module type over the layers: output norm ``norms[i]``, relative error ``rel[i]``."""
    return [{"name": f"model.layers.{i}.self_attn.q_proj", "rel_l2": e, "l2": e * n, "norm": n}
            for i, (n, e) in enumerate(zip(norms, rel, strict=True))]


def test_outputs_growing_layer_by_layer_keep_their_own_relative_error():
    # no norm before the attention: its projections see the residual stream, 50x larger by the
    # last layer; the same bf16 rounding everywhere must stand out nowhere
    ranked = rank_modules(_sized_rows([0.7, 2.7, 15.6, 37.0], [0.0029, 0.0031, 0.0027, 0.0030]))
    assert not any(r["anomalous"] for r in ranked), [(r["name"], r["score"]) for r in ranked]
    errors = {r["name"]: r["error"] for r in ranked}
    kept = [round(errors[f"model.layers.{i}.self_attn.q_proj"], 4) for i in (1, 2, 3)]
    assert kept == [0.0031, 0.0027, 0.0030]


def test_an_output_of_almost_nothing_does_not_divide_by_almost_nothing():
    # a gate's output near 0 in one layer: its rounding is measured against its type's size
    ranked = rank_modules(_sized_rows([1.0, 1.2, 1e-4, 0.9, 1.1], [0.003, 0.003, 0.3, 0.003, 0.003]))
    tiny = next(r for r in ranked if r["name"] == "model.layers.2.self_attn.q_proj")
    assert tiny["error"] < 0.003 and not tiny["anomalous"]


def test_a_module_no_other_layer_has_is_ranked_against_all_modules():
    rows = _table(4) + [{"name": "model.layers.0.mlp.dense_only", "rel_l2": 0.5}]  # a dense first layer
    ranked = rank_modules(rows)
    assert ranked[0]["name"] == "model.layers.0.mlp.dense_only" and ranked[0]["peers"] == 0
    assert ranked[0]["anomalous"] and ranked[0]["typical"] == pytest.approx(median(r["rel_l2"] for r in rows))
    assert {r["peers"] for r in ranked if r["name"].endswith("mlp.down_proj")} == {3}


def test_a_one_value_output_is_measured_against_its_types_usual_size():
    # a one-value gate at a decode step sits near 0 in one layer: its rounding over that value is
    # one draw, measured against the gate's usual size, not against almost nothing
    sized = _sized_rows([1.0, 1.2, 0.05, 0.9, 1.1], [0.003, 0.003, 0.3, 0.003, 0.003])
    rows = [{**r, "numel": 1} for r in sized]
    gate = next(r for r in rank_modules(rows) if r["name"] == "model.layers.2.self_attn.q_proj")
    assert gate["error"] == pytest.approx(0.3 * 0.05 / 1.0) and not gate["anomalous"]


def _layers(errors: list[float], updates: list[float]) -> list[dict]:
    """Decoder layers replayed whole: own error ``errors[i]`` of an output of norm 1, the layer
    adding ``updates[i]`` to the residual stream."""
    return [{"name": f"model.layers.{i}", "rel_l2": e, "l2": e, "norm": 1.0, "update": u}
            for i, (e, u) in enumerate(zip(errors, updates, strict=True))]


def test_a_layer_adding_much_to_the_stream_is_not_blamed_for_rounding_it():
    # a clean layer that adds ten times the others' share rounds ten times as much: its error
    # stands out against its output, not against what it adds
    ranked = rank_modules(_layers([0.001, 0.001, 0.01, 0.001, 0.001], [0.1, 0.1, 1.0, 0.1, 0.1]))
    top = pick_candidate(ranked)
    assert top["name"] == "model.layers.2" and top["score"] > 3 and not top["anomalous"]
    assert top["update_score"] == pytest.approx(1.0)


def test_a_layer_adding_little_is_not_blamed_for_the_streams_rounding():
    ranked = rank_modules(_layers([0.001, 0.001, 0.001, 0.001, 0.001], [0.1, 0.1, 0.01, 0.1, 0.1]))
    assert not any(r["anomalous"] for r in ranked)


def test_a_faulty_layer_stands_out_both_ways():
    ranked = rank_modules(_layers([0.001, 0.001, 0.05, 0.001, 0.001], [0.1, 0.1, 0.1, 0.1, 0.1]))
    top = pick_candidate(ranked)
    assert top["name"] == "model.layers.2" and top["anomalous"] and top["update_score"] == pytest.approx(50)


def test_an_anomalous_module_ranks_before_a_peerless_one_scoring_higher_without_standing_out():
    # lm_head at 8x the median is under the 3 x SINGLETON_MARGIN a module without peers needs;
    # a down_proj at 5x its peers stands out: the step's candidate is the down_proj
    rows = [r for r in _table(6, fault=(3, "mlp.down_proj", 5.0)) if r["name"] != "lm_head"]
    typical = median(r["rel_l2"] for r in rows)
    ranked = rank_modules([*rows, {"name": "lm_head", "rel_l2": 8 * typical}])
    head = next(r for r in ranked if r["name"] == "lm_head")
    assert not head["anomalous"] and head["score"] > 5
    assert pick_candidate(ranked)["name"] == "model.layers.3.mlp.down_proj"


def test_an_error_under_one_ops_rounding_is_never_a_fault_where_the_rest_match_exactly():
    """A clean fp32 tensor-parallel port: every module matches the golden bit for bit but lm_head,
    whose vocabulary split sums its GEMM in another order (1.3e-8 relative, measured on a Xeon
    with AMX). Against a typical error of 0 any error is a huge ratio; under the error one fp32 op
    shows (dtypes.OP_ERROR_FLOOR) it is rounding, not a fault. A real fault still stands out."""
    from llmflow.dtypes import OP_ERROR_FLOOR

    rows = [{"name": f"model.layers.{i}.mlp", "rel_l2": 0.0} for i in range(4)]
    rows.append({"name": "lm_head", "rel_l2": 1.28e-8})
    assert rank_modules(rows)[0]["anomalous"]  # (what a ratio to 0 alone says)
    ranked = rank_modules(rows, op_floor=OP_ERROR_FLOOR["float32"])
    assert not any(r["anomalous"] for r in ranked)
    faulty = [*rows[:-1], {"name": "lm_head", "rel_l2": 0.05}]
    top = rank_modules(faulty, op_floor=OP_ERROR_FLOOR["float32"])[0]
    assert top["name"] == "lm_head" and top["anomalous"]


def test_a_tie_ranks_the_inner_module_before_its_container():
    """A container whose one module does all its work has that module's error to the bit: the
    inner module is listed first (it is the more specific answer), not the name that sorts first."""
    rows = [{"name": f"model.layers.{i}.mlp{part}", "rel_l2": 1e-3 * (1 + i % 2)}
            for i in range(1, 4) for part in ("", ".down_proj")]
    rows += [{"name": "model.layers.0.mlp", "rel_l2": 0.34},
             {"name": "model.layers.0.mlp.down_proj", "rel_l2": 0.34}]
    ranked = rank_modules(rows)
    assert [r["name"] for r in ranked[:2]] == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp"]
    assert pick_candidate(ranked)["name"] == "model.layers.0.mlp.down_proj"
