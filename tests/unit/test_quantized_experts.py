"""Fused experts split back into one Linear layer per expert projection (``quantized.unfuse_experts``),
as a checkpoint quantized expert by expert stores them: the split model computes what the fused one
does, in every MoE family whose experts are SwiGLU without biases; other layouts are left fused."""

from __future__ import annotations

import pytest
import torch

from llmflow.models import build_tiny
from llmflow.quantized import UnfusedExperts, unfuse_experts

SIZE = "layers=2,hidden=64,intermediate=128,seed=5"
IDS = torch.tensor([[5, 9, 30, 41, 7, 12, 3, 77, 15, 2]])


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v3", "glm4-moe",
                                    "granite-moe"])
def test_split_experts_compute_what_the_fused_ones_compute(family):
    model = build_tiny(family, SIZE).eval()
    with torch.no_grad():
        fused = model(IDS).logits
    names = unfuse_experts(model, lambda key: True)
    assert names and all(isinstance(model.get_submodule(n), UnfusedExperts) for n in names)
    first = names[0]
    linear = model.get_submodule(f"{first}.0.down_proj")
    assert isinstance(linear, torch.nn.Linear) and linear.weight.shape[0] == model.config.hidden_size
    with torch.no_grad():
        split = model(IDS).logits
    torch.testing.assert_close(split, fused, rtol=1e-5, atol=1e-5)


def test_experts_the_checkpoint_does_not_store_one_by_one_stay_fused():
    model = build_tiny("qwen3-moe", SIZE)
    only_layer_1 = unfuse_experts(model, lambda key: key.startswith("model.layers.1."))
    assert only_layer_1 == ["model.layers.1.mlp.experts"]
    assert not isinstance(model.get_submodule("model.layers.0.mlp.experts"), UnfusedExperts)


def test_experts_with_biases_are_left_fused():
    """gpt-oss's experts carry biases and a clamped activation: not a layout the split computes."""
    model = build_tiny("gpt-oss", SIZE)
    assert unfuse_experts(model, lambda key: True) == []
