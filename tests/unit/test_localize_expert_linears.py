"""A quantized checkpoint's experts (held expert by expert, ``UnfusedExperts``) against the golden's
fused experts: each expert's Linear layers replayed alone on the golden expert's inputs
(``moe.expert_linear_errors``) name the projection at fault, scored against the same projection
in the other experts; where the expert's Linear layers err alike, none is named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmflow.dump.memory import Call
from llmflow.localize.conclude import _expert_linear_clause
from llmflow.localize.moe import expert_linear_errors, worst_expert_linear
from llmflow.models import build_tiny
from llmflow.quantized import UnfusedExperts

SIZE = "layers=2,hidden=64,intermediate=128,seed=5"
NAME = "model.layers.1.mlp.experts"


def _call(fused: torch.nn.Module, tokens: int = 40, top_k: int = 2) -> Call:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, fused.down_proj.shape[1], generator=gen)
    logits = torch.randn(tokens, fused.gate_up_proj.shape[0], generator=gen)
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
    said = _expert_linear_clause(worst, rows, 2, lambda n: n.replace("mlp", "block_sparse_moe"))
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
    said = _expert_linear_clause(None, rows, 2, str)
    assert said.startswith("; its Linear layers, each replayed alone on the golden expert's input, "
                           "err alike (gate_proj "), said


def test_experts_not_split_are_not_replayed_by_linear_layer():
    fused, _ = _pair("qwen3-moe")
    side = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    assert expert_linear_errors(fused, fused, _call(fused), name=NAME, golden=side, target=side,
                                expert=0) == ([], {})
