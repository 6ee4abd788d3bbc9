"""The environment a dump was taken in (env.json): what env-check diffs between two dumps.

Flat-ish on purpose: ``{"versions", "env_vars", "torch_settings", "model_config", "generation",
"seed", "tokenizer"}``, each a flat dict of JSON values (model_config is the HF config's
``to_dict()``).

env.json travels with the dump to other people and machines, so the value of any recorded
variable whose name says it holds a secret (``llmflow.redaction``: TOKEN, PASSWORD, KEY, PIN,
AUTH, ... as a part of the name) is written as ``<redacted>``, and so are credentials inside a
URL in any value; the name stays, so env-check still sees that it differs in presence.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from collections import Counter
from typing import Any

import torch

import llmflow
from llmflow.dtypes import dtype_name, quantization_dtype
from llmflow.redaction import redact_env

ENV_PREFIXES = ("ATB_", "HCCL_", "LCCL_", "ASCEND_", "CUDA_", "CUBLAS_", "TORCH_")
ENV_NAMES = ("NVIDIA_TF32_OVERRIDE", "PYTHONHASHSEED", "OMP_NUM_THREADS")


def recorded_env_vars(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables env.json records (``ENV_PREFIXES``, ``ENV_NAMES``), sorted, with
    the values of secret-looking names redacted."""
    environ = os.environ if environ is None else environ
    return redact_env({k: v for k, v in sorted(environ.items())
                       if k.startswith(ENV_PREFIXES) or k in ENV_NAMES})


@functools.cache  # installed versions do not change under a running process; reading the
def _version(dist: str) -> str | None:  # metadata took ~4 ms a dump (2% of a tiny model's run)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def collect_env(model: torch.nn.Module | None = None, *, generation: dict[str, Any] | None = None,
                tokenizer: Any = None, seed: dict[str, Any] | None = None,
                quantized: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything about this process that can change a model's numbers. ``quantized``: the model's
    quantized Linear layers and their weight types (an msModelSlim checkpoint's,
    ``LoadedModel.quantized``): recorded with the dtype that judges its tensors."""
    versions = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": _version("transformers"), "torch_npu": _version("torch_npu"),
        # the code that runs (a checkout on PYTHONPATH, an editable install), not the metadata
        # an earlier install left behind
        "llmflow": llmflow.__version__, "cuda": torch.version.cuda,
        "platform": platform.platform(), "executable": sys.executable,
    }
    env_vars = recorded_env_vars()
    settings: dict[str, Any] = {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "num_threads": torch.get_num_threads(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cuda_matmul_allow_bf16_reduced_precision":
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cuda_matmul_allow_fp16_reduced_precision":
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    }
    model_config: dict[str, Any] = {}
    if model is not None:
        first = next(model.parameters(), None)
        if first is not None:
            settings["model_dtype"] = dtype_name(first.dtype)
            settings["model_device"] = str(first.device)
        if quantized:
            settings["quantization"] = quantization_dtype(quantized.values())
            settings["quantized_linears"] = dict(sorted(Counter(quantized.values()).items()))
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            model_config = _jsonable(config.to_dict())
        model_config.setdefault("model_class", type(model).__name__)
    tok: dict[str, Any] = {}
    if tokenizer is not None:
        tok = {"class": type(tokenizer).__name__,
               "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
               "vocab_size": getattr(tokenizer, "vocab_size", None),
               "has_chat_template": bool(getattr(tokenizer, "chat_template", None))}
    return {"versions": versions, "env_vars": env_vars, "torch_settings": settings,
            "model_config": model_config, "generation": _jsonable(generation or {}),
            "seed": _jsonable(seed or {}), "tokenizer": tok}


def _jsonable(value: Any) -> Any:
    """Plain JSON values: dtypes and other objects become strings."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
