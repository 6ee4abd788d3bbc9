"""``quantized.unsmooth`` on a model smoothed by hand the way anti-outlier smooths one: a norm's
weight divided by a per-channel scale, the Linear layers reading it multiplied by it. Moving the
smoothing back leaves what the model computes unchanged and gives the norm the float weight; a
norm whose reader is not a Linear layer handed its very output (the final norm, read by lm_head
through a slice) is left as it is."""

from __future__ import annotations

import torch

from llmflow.models import build_tiny, logits_of
from llmflow.quantized import NormBias, unsmooth

IDS = torch.tensor([[3, 14, 15, 92, 65, 35]])


def _smoothed(norm_name: str, readers: list[str]) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = build_tiny("llama", "layers=2,hidden=64,intermediate=128,seed=5").eval()
    modules = dict(model.named_modules())
    norm = modules[norm_name]
    golden = {norm_name: norm.weight.detach().clone()}
    scale = torch.linspace(0.5, 2.0, norm.weight.shape[0])
    with torch.no_grad():
        norm.weight.div_(scale)
        for name in readers:
            modules[name].weight.mul_(scale)  # each input column takes the scale on
    parent, _, attr = norm_name.rpartition(".")
    setattr(model.get_submodule(parent), attr, NormBias(norm, torch.zeros(norm.weight.shape[0])))
    return model, golden


def test_the_smoothing_moves_into_the_readers_and_the_model_computes_the_same():
    name = "model.layers.1.input_layernorm"
    model, golden = _smoothed(name, [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"])
    with torch.no_grad():
        before = logits_of(model(IDS))
    moved = unsmooth(model, golden, lambda: logits_of(model(IDS)), tolerance=1e-5)
    assert moved == [name]
    assert torch.allclose(model.get_submodule(name).module.weight, golden[name])
    with torch.no_grad():
        after = logits_of(model(IDS))
    assert float((after - before).norm() / before.norm()) < 1e-5
    # the attention now sees the float model's input: its norm output is the unsmoothed one
    q = model.get_submodule("model.layers.1.self_attn.q_proj")
    assert q._forward_pre_hooks, "q_proj computes x / s first"


def test_a_norm_no_linear_layer_reads_directly_is_left_as_it_is():
    model, golden = _smoothed("model.norm", [])  # lm_head reads a slice of its output
    weight = model.get_submodule("model.norm").module.weight.detach().clone()
    assert unsmooth(model, golden, lambda: logits_of(model(IDS)), tolerance=1e-5) == []
    assert torch.equal(model.get_submodule("model.norm").module.weight, weight)
