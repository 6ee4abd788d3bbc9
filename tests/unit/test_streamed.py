"""A model loaded streamed (each decoder layer's weights read from its safetensors checkpoint while
it runs) computes bit for bit what the whole model computes, in a layer's forward and in a
sub-module run alone, and holds at most one layer's parameters at any time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmflow.dump.memory import OpRecorder
from llmflow.errors import UserError
from llmflow.models import build_tiny, greedy_generate, load_model
from llmflow.streamed import SafetensorsFiles, load_streamed

PROMPT = list(range(1, 24))


def save_tiny(directory: Path, family: str, *, stored: torch.dtype = torch.float32, tied: bool = False,
              max_shard_size: str | None = None) -> Path:
    """A seeded tiny model of ``family`` written with ``save_pretrained`` (safetensors)."""
    if tied:  # build_tiny unties the embeddings: make a config that ties them
        config = AutoConfig.for_model(family, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                                      tie_word_embeddings=True, initializer_range=0.2)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
    else:
        model = build_tiny(family, "layers=3,init=0.2")
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(stored).save_pretrained(str(directory), **kwargs)
    return directory


def generate_logits(model: torch.nn.Module, steps: int = 5) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy generation with the KV cache: the new ids and every step's logits."""
    seen: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda _m, _a, out: seen.append(out.logits.detach().clone()))
    try:
        ids = greedy_generate(model, PROMPT, steps)
    finally:
        handle.remove()
    return ids, seen


CASES = {  # family, stored dtype, tied embeddings, shards
    "llama-fp32": ("llama", torch.float32, False, None),
    "qwen2-fp16-tied-sharded": ("qwen2", torch.float16, True, "60KB"),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> Path:
    family, stored, tied, shard = CASES[request.param]
    return save_tiny(tmp_path_factory.mktemp(request.param), family, stored=stored, tied=tied,
                     max_shard_size=shard)


def test_streamed_generation_is_bit_identical_to_whole(checkpoint):
    whole = load_model(str(checkpoint), dtype="float32")
    streamed = load_streamed(str(checkpoint), dtype="float32")
    w_ids, w_logits = generate_logits(whole.model)
    s_ids, s_logits = generate_logits(streamed.model)
    assert s_ids == w_ids and len(s_logits) == len(w_logits) == 5
    assert all(torch.equal(a, b) for a, b in zip(w_logits, s_logits, strict=True))
    assert all(t.dtype == torch.float32 for t in s_logits)
    lm_head, embed = streamed.model.lm_head.weight, streamed.model.model.embed_tokens.weight
    assert (lm_head is embed) == (whole.model.lm_head.weight is whole.model.model.embed_tokens.weight)
    assert streamed.model.streamed_weights.materialized() == 0  # every layer dropped after its run


def test_layer_weights_are_cast_to_the_requested_dtype(checkpoint):
    streamed = load_streamed(str(checkpoint), dtype="float32")
    seen = []
    layer = streamed.model.model.layers[1]
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda m, _a: seen.append(m.weight.dtype))
    streamed.model(torch.tensor([PROMPT]))
    handle.remove()
    assert seen == [torch.float32]
    assert layer.mlp.down_proj.weight.device.type == "meta"


def test_a_sub_module_run_alone_gets_its_layer_weights(checkpoint):
    """What the bisect's op level and layer recompute do: one module inside a layer run directly."""
    whole = load_model(str(checkpoint), dtype="float32")
    streamed = load_streamed(str(checkpoint), dtype="float32")
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0))
    for name in ("model.layers.1.mlp", "model.layers.2.mlp.down_proj", "model.layers.0.input_layernorm"):
        w_mod, s_mod = whole.model.get_submodule(name), streamed.model.get_submodule(name)
        inp = x if not name.endswith("down_proj") else torch.randn(1, 7, 128)
        assert torch.equal(w_mod(inp), s_mod(inp)), name
        w_ops, s_ops = OpRecorder(w_mod, name).run(inp), OpRecorder(s_mod, name).run(inp)
        # the same ops, none of them the weights being read
        assert [o.name for o in s_ops] == [o.name for o in w_ops] and s_ops, name
        assert all(torch.equal(a.output, b.output) for a, b in zip(w_ops, s_ops, strict=True))
    assert streamed.model.streamed_weights.materialized() == 0


def test_a_layer_reads_its_weights_once_per_forward_and_holds_one_layer_at_most(checkpoint):
    streamed = load_streamed(str(checkpoint), dtype="float32")
    model, attached = streamed.model, streamed.model.streamed_weights
    per_layer = {len(lw.slots) for lw in attached.layers.values()}
    assert len(per_layer) == 1
    held: list[int] = []
    handles = [m.register_forward_pre_hook(lambda _m, _a: held.append(attached.materialized()))
               for m in model.modules()]
    handles += [m.register_forward_hook(lambda _m, _a, _o: held.append(attached.materialized()))
                for m in model.modules()]
    model(torch.tensor([PROMPT]))
    for h in handles:
        h.remove()
    layer_params = per_layer.pop()
    assert max(held) == layer_params and min(held) == 0
    assert [lw.loads for lw in attached.layers.values()] == [1, 1, 1]
    # counted directly: non-meta parameters inside the layers, never more than one layer's
    in_layers = [p for layer in model.model.layers for p in layer.parameters()]
    assert all(p.device.type == "meta" for p in in_layers)


def test_weights_are_dropped_when_a_layer_raises(checkpoint):
    streamed = load_streamed(str(checkpoint), dtype="float32")
    with pytest.raises(RuntimeError):
        streamed.model.model.layers[0].mlp(torch.randn(1, 3, 5))  # wrong width
    assert streamed.model.streamed_weights.materialized() == 0
    assert all(lw.running == 0 for lw in streamed.model.streamed_weights.layers.values())


def test_sharded_checkpoint_is_read_through_its_index(tmp_path):
    directory = save_tiny(tmp_path / "m", "llama", max_shard_size="60KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = SafetensorsFiles(directory)
    assert set(files.stored) == set(index["weight_map"])
    assert {s.file.name for s in files.stored.values()} == set(index["weight_map"].values())
    assert len(set(index["weight_map"].values())) > 1
    whole = load_model(str(directory))
    name = "model.layers.2.self_attn.k_proj.weight"
    assert torch.equal(files.read(name), whole.model.get_submodule(name.rsplit(".", 1)[0]).weight)


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="no safetensors checkpoint"):
        load_streamed("tiny-llama")
    directory = save_tiny(tmp_path / "m", "llama")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_streamed(str(directory))
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(UserError, match=r"model\.safetensors: unreadable safetensors file"):
        load_streamed(str(directory))


@pytest.mark.parametrize("stored_as", ["model.embed_tokens.weight", "lm_head.weight"])
def test_tied_weights_stored_under_either_name(tmp_path, stored_as):
    """save_pretrained keeps the embedding; safetensors' save_model (SmolLM2's cache) keeps lm_head."""
    from safetensors.torch import load_file, save_file

    directory = save_tiny(tmp_path / "m", "qwen2", tied=True)
    tensors = load_file(str(directory / "model.safetensors"))
    embed = tensors.pop("model.embed_tokens.weight")
    save_file({**tensors, stored_as: embed}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    whole, streamed = load_model(str(directory)), load_streamed(str(directory))
    assert streamed.model.lm_head.weight is streamed.model.model.embed_tokens.weight
    assert torch.equal(streamed.model.lm_head.weight, embed)
    x = torch.tensor([PROMPT])
    assert torch.equal(whole.model(x).logits, streamed.model(x).logits)
