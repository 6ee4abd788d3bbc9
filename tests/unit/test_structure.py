"""Decoder layers found from a model's structure, in live models and in dumps' topology."""

from __future__ import annotations

import pytest
from torch import nn

from llmflow.dump.topology import module_tree
from llmflow.errors import UserError
from llmflow.models import build_tiny
from llmflow.structure import (
    block_roles,
    find_layer_stack,
    layer_index,
    layer_of,
    module_type,
    resolve_module_classes,
)

WHERE = {"llama": ("model.layers", "LlamaDecoderLayer"), "gpt2": ("transformer.h", "GPT2Block"),
         "gpt-neox": ("gpt_neox.layers", "GPTNeoXLayer"), "falcon": ("transformer.h", "FalconDecoderLayer"),
         "mixtral": ("model.layers", "MixtralDecoderLayer")}


@pytest.mark.parametrize("family", sorted(WHERE))
def test_the_layer_list_is_found_in_the_model_and_in_its_topology(family):
    model = build_tiny(family, "layers=3")
    stack = find_layer_stack(model)
    assert (stack.path, stack.classes[0]) == WHERE[family]
    assert stack.layers == tuple(f"{stack.path}.{i}" for i in range(3))
    assert find_layer_stack(module_tree(model)) == stack
    assert resolve_module_classes(model, ["auto"]) == [WHERE[family][1]]


def test_a_list_of_experts_is_not_taken_for_the_layers():
    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(8))  # more children than layers
            self.attn = nn.Linear(8, 8)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(3)))

    assert find_layer_stack(Net()).path == "blocks"


def test_names_map_to_layers_exactly_or_by_their_digits():
    stack = find_layer_stack(build_tiny("gpt2", "layers=3"))
    assert layer_of("transformer.h.2.attn.c_attn", stack) == "transformer.h.2"
    assert layer_of("transformer.h.2.attn/matmul.0", stack) == "transformer.h.2"
    assert layer_of("transformer.ln_f", stack) is None and layer_index("transformer.h.1.mlp", stack) == 1
    assert module_type("transformer.h.1.mlp.c_fc", stack) == "transformer.h.*.mlp.c_fc"
    # names alone: the first all-digit segment
    assert layer_of("model.layers.7.mlp.down_proj") == "model.layers.7"
    assert layer_of("lm_head") is None and layer_index("model.layers.12") == 12


def test_block_roles_by_class_and_attribute_names():
    gpt2 = build_tiny("gpt2", "layers=2")
    roles = block_roles(gpt2.transformer.h[1], "transformer.h.1")
    assert roles["attention"] == ["transformer.h.1.attn"] and roles["mlp"] == ["transformer.h.1.mlp"]
    assert roles["norm"] == ["transformer.h.1.ln_1", "transformer.h.1.ln_2"]
    moe = block_roles(build_tiny("mixtral", "layers=2").model.layers[0], "model.layers.0")
    assert moe["moe"] == ["model.layers.0.mlp"] and moe["router"] == ["model.layers.0.mlp.gate"]
    assert moe["experts"] == ["model.layers.0.mlp.experts"] and "mlp" not in moe


def test_a_layer_class_that_matches_nothing_is_an_error_naming_the_classes():
    model = build_tiny("qwen2", "layers=2")
    with pytest.raises(UserError) as err:
        resolve_module_classes(model, ["LlamaDecoderLayer"])
    assert "Qwen2DecoderLayer" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="transformer.h"):
        find_layer_stack(model, "transformer.h")
    assert find_layer_stack(model, "model.layers").path == "model.layers"  # the override


def test_a_model_without_a_list_of_blocks():
    with pytest.raises(UserError, match="no list of repeated blocks"):
        resolve_module_classes(nn.Sequential(nn.Linear(2, 2)), ["auto"])
    assert find_layer_stack(nn.Linear(2, 2)) is None
