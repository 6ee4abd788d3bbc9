"""Fused experts split back into one Linear layer per expert projection (``quantized.unfuse_experts``),
as a checkpoint quantized expert by expert stores them: the split model computes what the fused one
does, in every MoE family whose experts are SwiGLU without biases; other layouts are left fused. A
checkpoint in the layout transformers saves (its older one: Mixtral's ``block_sparse_moe`` and
``w1``/``w3``/``w2``) names each tensor of the split model once renamed (``checkpoint_renaming``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from llmflow.errors import UserError
from llmflow.models import build_tiny, empty_hf_model
from llmflow.quantized import UnfusedExperts, checkpoint_renaming, unfuse_experts
from llmflow.safetensors_files import SafetensorsFiles

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


@pytest.mark.parametrize("family", ["mixtral", "minimax", "qwen3-moe", "deepseek-v3", "granite-moe"])
def test_a_saved_checkpoints_names_renamed_are_the_split_models_own(family, tmp_path):
    """transformers saves a MoE checkpoint in the layout msModelSlim's transformers 4 model has
    (per-expert tensors, older module names); renamed as transformers renames them on load, each
    names a tensor of the model whose experts are split where the checkpoint holds them one by one."""
    build_tiny(family, SIZE).save_pretrained(str(tmp_path))
    files = SafetensorsFiles(tmp_path)
    model, _ = empty_hf_model(tmp_path, torch.float32)
    rename = checkpoint_renaming(model)
    renamed = files.renamed(rename) if rename is not None else files
    unfuse_experts(model, lambda key: key in renamed)
    own = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in model.named_buffers(remove_duplicate=False)}
    stored = set(renamed.stored)
    assert stored <= own and {n for n, _ in model.named_parameters(remove_duplicate=False)} <= stored
    if family == "mixtral":
        name = "model.layers.0.mlp.experts.1.up_proj.weight"
        assert renamed.stored_name(name) == "model.layers.0.block_sparse_moe.experts.1.w3.weight"


def test_two_tensors_renamed_to_one_name_are_refused(tmp_path):
    save_file({"a.w1.weight": torch.ones(2), "a.gate_proj.weight": torch.ones(2)},
              str(tmp_path / "m.safetensors"))
    with pytest.raises(UserError, match="'a.gate_proj.weight' and 'a.w1.weight' both stand for"):
        SafetensorsFiles(tmp_path).renamed(lambda n: n.replace("w1", "gate_proj"))
