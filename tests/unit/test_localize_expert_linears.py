"""Experts, finer than their module: a fused experts module's own error is also measured over the
tokens of its worst expert (``moe.expert_token_error``), so that a fault in an expert few tokens
reach is not diluted by the others; a quantized checkpoint's experts (held expert by expert,
``UnfusedExperts``) against the golden's fused experts: each expert's Linear layers replayed alone
on the golden expert's inputs (``moe.expert_linear_errors``) name the projection at fault, scored
against the same projection in the other experts; where the expert's Linear layers err alike,
none is named."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from llmflow.dump.memory import Call
from llmflow.localize.conclude import _per_token_sentence, expert_of_tokens
from llmflow.localize.moe import expert_linear_errors, expert_token_error, worst_expert_linear
from llmflow.localize.own_error import ranked_l2
from llmflow.localize.quantized_words import expert_linear_clause
from llmflow.localize.replay import replay_call
from llmflow.models import build_tiny
from llmflow.quantized import UnfusedExperts
from llmflow.results.verdict import ExpertLinearRow

SIZE = "layers=2,hidden=64,intermediate=128,seed=5"
NAME = "model.layers.1.mlp.experts"


def _call(fused: torch.nn.Module, tokens: int = 40, top_k: int = 2, rare: int | None = None) -> Call:
    """The experts' call on random tokens, routed top-k (``rare``: an expert few tokens reach)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, fused.down_proj.shape[1], generator=gen)
    logits = torch.randn(tokens, fused.gate_up_proj.shape[0], generator=gen)
    if rare is not None:
        logits[:, rare] -= 2.0
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    with torch.no_grad():
        out = fused(hidden, index, weights)
    return Call(NAME, type(fused).__name__, [hidden, index, weights], outputs={"0": out})


def _pair(family: str) -> tuple[torch.nn.Module, UnfusedExperts]:
    fused = build_tiny(family, SIZE).get_submodule(NAME).eval()
    return fused, UnfusedExperts(fused, names=("w1", "w3", "w2") if family == "mixtral" else
                                 ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("projection", ["gate_proj", "up_proj", "down_proj"])
def test_the_projection_whose_weight_is_off_is_named(family, projection):
    fused, split = _pair(family)
    own = dict(zip(("gate_proj", "up_proj", "down_proj"), split.names, strict=True))[projection]
    with torch.no_grad():
        getattr(split.get_submodule("2"), own).weight.mul_(1.5)
    side = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    rows, inputs = expert_linear_errors(fused, split, _call(fused), name=NAME, golden=side, target=side,
                                        expert=2)
    assert {r.expert for r in rows} == set(range(fused.gate_up_proj.shape[0]))
    worst = worst_expert_linear(rows, 2, ratio=10.0)
    assert worst is not None and worst.projection == projection and worst.name == f"{NAME}.2.{own}"
    assert worst.rel_l2 == pytest.approx(0.5, rel=1e-3)  # (the weight 1.5x: every output 1.5x)
    assert worst.score > 1e4  # the other experts' copies compute exactly
    assert sorted(inputs) == sorted(f"{NAME}.2.{n}" for n in split.names)
    assert inputs[f"{NAME}.2.{split.names[2]}"].shape[-1] == fused.down_proj.shape[-1]  # the SwiGLU's width
    said = expert_linear_clause(worst, rows, 2, lambda n: n.replace("mlp", "block_sparse_moe"))
    assert said.startswith(f", and of its Linear layers, {projection} (stored as "
                           f"model.layers.1.block_sparse_moe.experts.2.{own}): replayed alone"), said


def test_an_expert_whose_linear_layers_err_alike_names_none():
    """Every expert's Linear layers carry weight noise of one size (as an honest quantization's
    rounding): none of the expert's stands out from its projection in the other experts."""
    fused, split = _pair("qwen3-moe")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for linear in split.modules():
            if isinstance(linear, torch.nn.Linear):
                linear.weight.add_(torch.randn(linear.weight.shape, generator=gen) * 1e-3)
    side = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    rows, _ = expert_linear_errors(fused, split, _call(fused), name=NAME, golden=side, target=side, expert=2)
    assert worst_expert_linear(rows, 2, ratio=10.0) is None
    said = expert_linear_clause(None, rows, 2, str)
    assert said.startswith("; its Linear layers, each replayed alone on the golden expert's input, "
                           "err alike (gate_proj "), said


def test_experts_not_split_are_not_replayed_by_linear_layer():
    fused, _ = _pair("qwen3-moe")
    side = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    assert expert_linear_errors(fused, fused, _call(fused), name=NAME, golden=side, target=side,
                                expert=0) == ([], {})


# -- the experts module ranked by its worst expert's tokens ------------------------------------------------

def test_an_expert_few_tokens_reach_is_ranked_by_its_tokens():
    """A fault in one expert moves only the tokens routed to it: over every token it is diluted,
    the mean over that expert's tokens shows it whole."""
    fused, _ = _pair("qwen3-moe")
    rare = 2
    call = _call(fused, rare=rare)
    index = call.args[1]
    broken = copy.deepcopy(fused)
    with torch.no_grad():
        broken.down_proj[rare].mul_(2.0)
    row = replay_call(broken, call, device=torch.device("cpu"), dtype=torch.float32)
    reached = int((index == rare).any(dim=-1).sum())
    assert 0 < reached < len(index) // 4
    assert row["expert_worst"] == rare
    assert row["expert_rel"] > 3 * row["token_rel"]  # (its tokens only, each part of its output 2x)
    assert row["rel_l2"] == row["expert_rel"]
    assert ranked_l2(row) == pytest.approx(row["expert_rel"] * row["norm"])
    said = _per_token_sentence(row)
    assert said.startswith(f" Its error is in the tokens routed to expert {rare}: their outputs are"), said


def test_experts_that_round_alike_give_the_tokens_error():
    fused, _ = _pair("qwen3-moe")
    call = _call(fused)
    noisy = copy.deepcopy(fused)
    with torch.no_grad():
        for weight in (noisy.gate_up_proj, noisy.down_proj):
            weight.mul_(1 + 1e-3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)))
    row = replay_call(noisy, call, device=torch.device("cpu"), dtype=torch.float32)
    assert row["expert_rel"] < 2 * row["token_rel"]
    assert _per_token_sentence(row) == ""


def test_a_module_called_without_routing_has_no_expert_error():
    alone = Call("m", args=[torch.ones(4, 32)])
    assert expert_token_error(torch.ones(4, 32), torch.ones(4, 32), torch.nn.Identity(), alone) is None


@pytest.mark.parametrize("seed", range(8))
def test_the_expert_named_is_the_faulty_one_not_one_its_bad_tokens_also_reach(seed):
    """Top 4 of 16: each bad token also reaches three other experts, some reached by no other
    token (their mean is that bad token's whole error); the faulty expert holds every bad token."""
    fused = build_tiny("qwen3-moe", "layers=2,hidden=64,intermediate=128,seed=5,experts=16,top_k=4"
                       ).get_submodule(NAME).eval()
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(20, 64, generator=gen)
    weights, index = torch.randn(20, 16, generator=gen).softmax(-1).topk(4, dim=-1)
    with torch.no_grad():
        call = Call(NAME, type(fused).__name__, [hidden, index, weights],
                    outputs={"0": fused(hidden, index, weights)})
    broken_expert = int(index[0, 0])
    broken = copy.deepcopy(fused)
    with torch.no_grad():
        broken.down_proj[broken_expert].mul_(1.3)
    row = replay_call(broken, call, device=torch.device("cpu"), dtype=torch.float32)
    assert row["expert_worst"] == broken_expert


def test_an_expert_linear_layer_is_named_beyond_twice_the_bisects_ratio():
    """An honest quantization's projections spread 4-5x around their median over experts of few
    tokens: under twice the ratio nothing is named."""
    def rows(score: float) -> list[ExpertLinearRow]:
        return [ExpertLinearRow(name=f"e.0.{p}", expert=0, projection=p, tokens=10, rel_l2=0.1,
                                typical=0.1 / s, score=s)
                for p, s in (("gate_proj", 1.0), ("down_proj", score))]
    assert worst_expert_linear(rows(4.6), 0, ratio=3.0) is None
    assert worst_expert_linear(rows(7.0), 0, ratio=3.0).projection == "down_proj"


class Experts(torch.nn.Module):
    """Stands for a fused experts module (told by its class name and its call's routing)."""


def test_the_tokens_an_expert_does_not_reach_are_measured_at_the_median() -> None:
    """Top-2 of 4 experts: expert 1 reaches half the tokens. A fault in it puts error in every one
    of them (its median far above the others'); one bad token that reaches it too puts error in
    one (its median that of the others): only the first names the expert."""

    torch.manual_seed(0)
    tokens = 32
    index = torch.stack([torch.arange(tokens) % 4, (torch.arange(tokens) + 1) % 4], dim=1)
    weights = torch.full((tokens, 2), 0.5)
    call = Call("model.layers.0.mlp.experts", args=[torch.randn(tokens, 32), index, weights])
    golden = torch.randn(tokens, 32)
    rounding = golden * (1 + 1e-3 * torch.randn(tokens, 32))
    faulty = rounding.clone()
    reached = (index == 1).any(dim=-1)
    faulty[reached] *= 1.3
    experts = Experts()
    worst, mean, median, rest = expert_token_error(golden, faulty, experts, call)
    row = {"expert_worst": worst, "expert_rel": mean, "expert_median_rel": median, "expert_rest_rel": rest,
           "token_rel": mean * reached.float().mean().item()}
    assert worst == 1 and median > 3 * rest and expert_of_tokens(row) == 1
    one_bad = rounding.clone()
    one_bad[1] *= 2.0  # token 1 reaches experts 1 and 2
    worst, mean, median, rest = expert_token_error(golden, one_bad, experts, call)
    row = {"expert_worst": worst, "expert_rel": mean, "expert_median_rel": median, "expert_rest_rel": rest,
           "token_rel": 2.0 / tokens}
    assert expert_of_tokens(row) is None, row


def test_llama4s_experts_called_expert_by_expert_name_the_faulty_one() -> None:
    """Llama 4's MoE hands its experts every token once per expert, expert by expert, each copy
    scaled by its routing score (0 where the router did not pick the expert): the rows of one
    expert are its tokens, the zero rows no one's, and the expert with the error is named."""
    model = build_tiny("llama4", "layers=2,hidden=64,intermediate=128,seed=5,experts=4,top_k=1")
    moe = model.get_submodule("model.layers.1.feed_forward").eval()
    hidden = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    captured: dict[str, torch.Tensor] = {}
    handle = moe.experts.register_forward_pre_hook(lambda _m, args: captured.update(x=args[0]))
    with torch.no_grad():
        moe(hidden)
    handle.remove()
    x = captured["x"]
    assert x.shape[0] == 4 * 24 and int((x.abs().amax(-1) > 0).sum()) == 24  # top 1: one live copy a token
    call = Call("model.layers.1.feed_forward.experts", type(moe.experts).__name__, [x])
    with torch.no_grad():
        call.outputs = {"0": moe.experts(x)}
    broken = copy.deepcopy(moe.experts)
    with torch.no_grad():
        broken.down_proj[2].mul_(1.3)
    row = replay_call(broken, call, device=torch.device("cpu"), dtype=torch.float32)
    assert row["expert_worst"] == 2 and expert_of_tokens(row) == 2, row
    assert row["expert_rest_rel"] == 0.0 and row["expert_median_rel"] > 0.2, row
    clean = replay_call(copy.deepcopy(moe.experts), call, device=torch.device("cpu"), dtype=torch.float32)
    assert expert_of_tokens(clean) is None, clean


def test_experts_given_bare_rows_of_another_layout_are_not_taken_expert_by_expert() -> None:
    """An experts module called on one tensor of rows whose count divides by its experts is not
    Llama 4's layout unless each token's copies are one row scaled with one zero at least (JetMoE's
    rows are grouped by expert in groups of uneven sizes)."""
    class ParallelExperts(torch.nn.Module):
        num_experts = 4

    rows = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    call = Call("model.layers.0.mlp.output_linear", "ParallelExperts", [rows])
    assert expert_token_error(rows, rows * 1.5, ParallelExperts(), call) is None
    token = torch.randn(4, 32)
    scores = torch.tensor([[0.7, 0.0, 0.3, 0.0]] * 4).T.reshape(4, 4, 1)  # top 2 of 4: experts 0 and 2
    copies = (token.unsqueeze(0) * scores).reshape(16, 32)
    faulty = copies.clone()
    faulty[8:12] *= 1.3  # expert 2's rows
    call = Call("model.layers.0.feed_forward.experts", "ParallelExperts", [copies])
    assert expert_token_error(copies, faulty, ParallelExperts(), call)[0] == 2


def test_jetmoes_experts_given_rows_grouped_by_expert_name_the_faulty_one() -> None:
    """JetMoE calls its experts (``input_linear``, ``output_linear``) on rows sorted by expert with
    the groups' sizes as a list: each row's expert is its group's, and the expert with the error is
    named; a size list that does not add up to the rows is not taken as one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("jetmoe", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, kv_channels=16,
                               num_local_experts=4, num_experts_per_tok=2, vocab_size=64)
    torch.manual_seed(2)
    moe = AutoModelForCausalLM.from_config(cfg).model.layers[0].mlp.eval()
    captured: dict[str, tuple] = {}
    handle = moe.output_linear.register_forward_pre_hook(lambda _m, args: captured.update(args=args))
    with torch.no_grad():
        moe(torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(1)))
    handle.remove()
    rows, sizes = captured["args"]
    assert isinstance(sizes, list) and sum(sizes) == rows.shape[0] == 24 and sizes[1] > 0, sizes
    call = Call("model.layers.0.mlp.output_linear", type(moe.output_linear).__name__, [rows, sizes])
    with torch.no_grad():
        call.outputs = {"0": moe.output_linear(rows, sizes)}
    broken = copy.deepcopy(moe.output_linear)
    with torch.no_grad():
        broken.weight[1].mul_(1.3)
    row = replay_call(broken, call, device=torch.device("cpu"), dtype=torch.float32)
    assert row["expert_worst"] == 1 and expert_of_tokens(row) == 1, row
    cpu = torch.device("cpu")
    clean = replay_call(copy.deepcopy(moe.output_linear), call, device=cpu, dtype=torch.float32)
    assert expert_of_tokens(clean) is None, clean
    uneven = Call(call.name, call.module_type, [rows, [*sizes[:-1], sizes[-1] + 1]], outputs=call.outputs)
    assert expert_token_error(call.outputs["0"], call.outputs["0"] * 1.5, moe.output_linear, uneven) is None

    class Packed(torch.nn.Module):  # (rows of sequences and their lengths: not experts, whatever its fields)
        num_experts = 4

    packed = Call("model.layers.0.packed", "Packed", [rows, sizes], outputs=call.outputs)
    assert expert_token_error(call.outputs["0"], call.outputs["0"] * 1.5, Packed(), packed) is None
