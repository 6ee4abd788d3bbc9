"""The golden module's own rounding in the target's dtype: a module that stands out from its peers by
no more than that is set aside, one whose code is wrong is not (``localize/rounding.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from llmflow.dump.memory import Call
from llmflow.localize.conclude import StepReplay, shared_error
from llmflow.localize.rank import pick_candidate, rank_modules, set_aside
from llmflow.localize.replay import replay_call
from llmflow.localize.rounding import cast_copy, copy_bytes, rounding_row, to_rounding
from llmflow.models import build_tiny

CPU = torch.device("cpu")


def _mlp_call(seed: int = 0) -> tuple[nn.Module, Call]:
    """Layer 1's MLP of a tiny Llama with its golden (fp32) input and output."""
    model = build_tiny("llama", f"layers=2,seed={seed}").eval()
    mlp = model.model.layers[1].mlp
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = mlp(x)
    return mlp, Call("model.layers.1.mlp", "LlamaMLP", [x], outputs={"0": out})


def test_the_cast_copy_computes_as_the_module_cast_whole_and_leaves_it_untouched() -> None:
    mlp, call = _mlp_call()
    seen: list[int] = []
    mlp.register_forward_pre_hook(lambda *_: seen.append(1))
    cast = cast_copy(mlp, CPU, torch.bfloat16)
    whole = copy.deepcopy(mlp).to(torch.bfloat16)
    x = call.args[0].to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(cast(x), whole(x))
    assert len(seen) == 1  # the whole copy kept the hook; the cast copy has none
    assert all(p.dtype == torch.float32 for p in mlp.parameters())
    assert all(p.dtype == torch.bfloat16 for p in cast.parameters())
    assert copy_bytes(mlp, torch.bfloat16) == sum(p.numel() for p in mlp.parameters()) * 2


def test_a_clean_lower_dtype_module_is_its_golden_rounding_and_a_faulty_one_is_not() -> None:
    mlp, call = _mlp_call()
    target = copy.deepcopy(mlp).to(torch.bfloat16)
    clean = replay_call(target, call, device=CPU, dtype=torch.bfloat16)
    reference = rounding_row(mlp, call, device=CPU, dtype=torch.bfloat16)
    assert clean["rel_l2"] > 0 and reference["rel_l2"] > 0
    assert to_rounding(clean, reference, kv_cache=False) == pytest.approx(1.0)
    with torch.no_grad():
        target.down_proj.weight.mul_(1.1)  # a 10% wrong scale: far beyond bf16's rounding
    faulty = replay_call(target, call, device=CPU, dtype=torch.bfloat16)
    assert to_rounding(faulty, reference, kv_cache=False) > 10


def test_where_both_sides_compute_alike_nothing_is_set_aside() -> None:
    mlp, call = _mlp_call()
    reference = rounding_row(mlp, call, device=CPU, dtype=torch.float32)
    row = replay_call(mlp, call, device=CPU, dtype=torch.float32)
    assert to_rounding(row, reference, kv_cache=False) is None  # the rounding is 0: no ratio
    assert to_rounding({"rel_l2": 0.1}, {"replayable": False}, kv_cache=False) is None


def test_a_kv_cache_write_is_measured_against_the_golden_modules_own_write() -> None:
    cand = {"name": "model.layers.1.self_attn/kv_cache", "rel_l2": 0.02}
    assert to_rounding(cand, {"replayable": True, "kv_cache_rel_l2": 0.01}, kv_cache=True) == 2.0
    assert to_rounding(cand, {"replayable": True, "rel_l2": 0.5}, kv_cache=True) is None


def _rows() -> list[dict]:
    """Six layers' attention and MLP; layer 1's attention 6x its peers, layer 3's MLP 4x."""
    rows = []
    for i in range(6):
        rows.append({"name": f"model.layers.{i}.self_attn", "rel_l2": 0.006 if i == 1 else 0.001})
        rows.append({"name": f"model.layers.{i}.mlp", "rel_l2": 0.004 if i == 3 else 0.001})
    return rows


def test_a_candidate_set_aside_gives_way_to_the_next_one_that_stands_out() -> None:
    ranked = rank_modules(_rows(), ratio_threshold=3.0)
    first = pick_candidate(ranked)
    assert first["name"] == "model.layers.1.self_attn" and first["anomalous"]
    ranked = set_aside(ranked, first)
    second = pick_candidate(ranked)
    assert second["name"] == "model.layers.3.mlp" and second["anomalous"]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    ranked = set_aside(ranked, second)
    last = pick_candidate(ranked)  # none stands out: the top of the ranking, not anomalous
    assert last["name"] == "model.layers.1.self_attn" and not last["anomalous"]


def test_an_overflow_keeps_its_place_when_another_row_is_set_aside() -> None:
    rows = _rows() + [{"name": "model.layers.4.mlp.act_fn", "rel_l2": float("inf"), "nonfinite": 3}]
    ranked = rank_modules(rows, ratio_threshold=3.0)
    assert ranked[0]["overflow"]
    ranked = set_aside(ranked, next(r for r in ranked if r["name"] == "model.layers.1.self_attn"))
    assert ranked[0]["name"] == "model.layers.4.mlp.act_fn" and ranked[1]["name"] == "model.layers.3.mlp"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_mask_past_the_lower_dtypes_range_is_its_faithful_cast_not_an_overflow(dtype: torch.dtype) -> None:
    from llmflow.localize.own_error import own_error

    golden = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    golden[0, :5] = torch.finfo(torch.float32).min  # a causal mask as float32's minimum: -inf in bf16
    row = own_error(golden, golden.to(dtype))
    assert row["nonfinite"] == 0 and 0 < row["rel_l2"] < 0.01
    upcast = own_error(golden, golden.to(torch.bfloat16).float())  # a softmax's float32 upcast of it
    assert upcast["nonfinite"] == 0
    overflow = golden.to(dtype)
    overflow[1, 0] = float("inf")  # a value the golden holds in range: a real overflow
    assert own_error(golden, overflow)["nonfinite"] == 1


def test_tokens_that_print_alike_are_told_apart_by_their_ids() -> None:
    from llmflow.localize.conclude import _token_sentence
    from llmflow.results.verdict import TokenDetail

    alike = TokenDetail(step=1, golden_token="\ufffd", target_token="\ufffd", golden_id=231, target_id=232,
                        golden_margin=0.1)
    assert "token ids 231 -> 232" in _token_sentence(1, alike)
    plain = TokenDetail(step=1, golden_token=" a", target_token=" b", golden_id=3, target_id=4,
                        golden_margin=0.1)
    assert "token ids" not in _token_sentence(1, plain) and "' a' -> ' b'" in _token_sentence(1, plain)


@pytest.mark.parametrize("seed", range(3))
def test_a_router_whose_weights_jump_in_bf16_is_measured_against_the_golden_routers_jump(seed: int) -> None:
    """PhiMoE's router weighs a token's experts by the softmax of the logits within a margin of the
    best: where bf16 moves a logit across it, a weight jumps though the experts agree. The golden
    router cast to bf16 jumps alike (ratio 1); one computing its weights wrong does not, nor one
    whose logits are wrong where the golden's weights jump too (each part against its own)."""
    model = build_tiny("phimoe", "layers=2,hidden=64,intermediate=128,seed=1,init=0.2")
    router = model.get_submodule("model.layers.1.mlp.router").eval()
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        outputs = dict(enumerate(router(hidden)))
    call = Call("model.layers.1.mlp.router", type(router).__name__, [hidden],
                outputs={str(i): t for i, t in outputs.items()})
    target = cast_copy(router, CPU, torch.bfloat16)
    clean = replay_call(target, call, device=CPU, dtype=torch.bfloat16)
    reference = rounding_row(router, call, device=CPU, dtype=torch.bfloat16)
    assert clean.get("routing_weights") and clean["rel_l2"] > 0, clean
    assert to_rounding(clean, reference, kv_cache=False) == pytest.approx(1.0)
    forward = target.forward

    def unnormalised(x):  # the weights as the softmax over every expert (no margin)
        logits, _weights, experts = forward(x)
        return logits, torch.softmax(logits.float(), -1).gather(-1, experts).to(logits.dtype), experts
    target.forward = unnormalised
    faulty = replay_call(target, call, device=CPU, dtype=torch.bfloat16)
    assert to_rounding(faulty, reference, kv_cache=False) > 3
    scaled = cast_copy(router, CPU, torch.bfloat16)
    with torch.no_grad():
        scaled.weight[0].mul_(1.2)  # one expert's logits 20% off
    wrong_logits = replay_call(scaled, call, device=CPU, dtype=torch.bfloat16)
    assert to_rounding(wrong_logits, reference, kv_cache=False) > 3


def test_copies_set_aside_as_rounding_are_no_shared_error() -> None:
    """A module type beyond the dtype's limit in some layers, each copy set aside as the golden
    module's own rounding there: no fault the layers share."""
    errors = {f"model.layers.{i}.{t}": e for i in range(4) for t, e in
              (("q_proj", 0.003), ("mlp", 0.005), ("input_layernorm", 0.001))}
    errors |= {f"model.layers.{i}.mlp.router": 0.065 if i else 0.003 for i in range(4)}
    rows = [{"name": n, "rel_l2": e, "replayable": True} for n, e in errors.items()]
    step = StepReplay(step=0, why="test", rows=rows)
    assert shared_error(step, None, "bfloat16") is not None
    step.rounding = [{"name": f"model.layers.{i}.mlp.router"} for i in (1, 2, 3)]
    assert shared_error(step, None, "bfloat16") is None
