"""One vocabulary for dtypes: their names, the torch dtype a name stands for, and how close a
tensor of each dtype must come to its golden.

A dtype reaches llmflow as a ``torch.dtype`` (a live tensor), a numpy dtype, or text in a dump:
``"torch.bfloat16"`` (msprobe's dump.json, msit's statistics.csv), ``"bfloat16"`` (llmflow's own
index), torch's aliases (``"half"``). ``dtype_name`` turns each into one canonical name, the one
every table and file of llmflow is keyed by; ``torch_dtype`` goes back from a name to a
``torch.dtype``. Nothing here imports torch at import time: ``llmflow validate`` and ``plan``
reach this module and must start without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any

#: torch's own second names for its dtypes (``torch.half is torch.float16``); ``str()`` of a
#: dtype never gives them, but a hand-written or foreign dump may.
TORCH_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64",
                 "int": "int32", "short": "int16", "chalf": "complex32", "cfloat": "complex64",
                 "cdouble": "complex128"}

#: safetensors' dtype codes (the ``dtype`` of a tensor in a safetensors header) by canonical name
SAFETENSORS_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                     "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                     "bool": "BOOL", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
                     "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32", "uint64": "U64"}
DTYPE_OF_SAFETENSORS_CODE = {code: name for name, code in SAFETENSORS_CODES.items()}


@lru_cache(maxsize=512)  # a run meets a handful of dtypes, once per tensor
def dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype: ``torch.bfloat16``, ``"torch.bfloat16"``, ``"bfloat16"`` ->
    ``"bfloat16"``; ``numpy.dtype("float32")`` -> ``"float32"``; ``"half"`` -> ``"float16"``.

    Text that names no dtype llmflow knows comes back as given, less a ``torch.`` prefix (a
    reader keeps what its dump says)."""
    name = str(dtype).strip().removeprefix("torch.")
    return TORCH_ALIASES.get(name, name)


def torch_dtype(name: Any) -> Any:
    """The ``torch.dtype`` a name stands for (any spelling ``dtype_name`` reads; a torch.dtype is
    returned as is), or None when it names none (``"Tensor"``, ``"contiguous_format"``, ``""``).
    Looked up as an attribute of torch, never evaluated."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    found = getattr(torch, dtype_name(name), None) if name is not None else None
    return found if isinstance(found, torch.dtype) else None


# -- how close is close enough, per dtype --------------------------------------------------------
#
# Three tables answer three different questions, so they stay three; they sit side by side so
# that a change of one is made knowing the others:
#
# * DEFAULT_THRESHOLDS (the compare, compare/thresholds.py): the warn/fail limits of a whole
#   tensor's metrics (cosine similarity, relative Euclidean distance) against its golden, by
#   dtype class. Loose: a tensor at the end of a layer carries the rounding of every op before it.
# * OP_ERROR_FLOOR (the op bisection, localize/ops.py): the relative error ONE correct op shows in
#   the target dtype, about half an ulp times a margin; an op's own error is read in units of it,
#   and a module's own error under it is never a fault (localize/rank.py).
# * SMALL_VALUE, SMALL_VALUE_ATOL (the op precheck, checks/precheck.py; msprobe's small-value
#   rule): |x| below which a value counts as small, and the absolute error a small value may
#   carry, since a relative error of a value near zero says nothing.


def _lim(warn: float, fail: float) -> dict[str, float]:
    return {"warn": warn, "fail": fail}


DEFAULT_THRESHOLDS: dict[str, dict[str, dict[str, float]]] = {
    "float64": {"cosine_similarity": _lim(0.999999, 0.9999),
                "relative_euclidean_distance": _lim(1e-5, 1e-3), "norm_rel_diff": _lim(1e-5, 1e-3)},
    "float32": {"cosine_similarity": _lim(0.99999, 0.999),
                "relative_euclidean_distance": _lim(1e-4, 1e-2), "norm_rel_diff": _lim(1e-4, 1e-2)},
    "float16": {"cosine_similarity": _lim(0.9999, 0.99),
                "relative_euclidean_distance": _lim(5e-3, 5e-2), "norm_rel_diff": _lim(5e-3, 5e-2)},
    "bfloat16": {"cosine_similarity": _lim(0.999, 0.98),
                 "relative_euclidean_distance": _lim(3e-2, 2e-1), "norm_rel_diff": _lim(3e-2, 2e-1)},
    "float8": {"cosine_similarity": _lim(0.99, 0.95),
               "relative_euclidean_distance": _lim(1e-1, 3e-1), "norm_rel_diff": _lim(1e-1, 3e-1)},
    "int8": {"cosine_similarity": _lim(0.99, 0.95),
             "relative_euclidean_distance": _lim(1e-1, 3e-1), "norm_rel_diff": _lim(1e-1, 3e-1)},
    "int4": {"cosine_similarity": _lim(0.98, 0.9),
             "relative_euclidean_distance": _lim(2e-1, 5e-1), "norm_rel_diff": _lim(2e-1, 5e-1)},
    # token ids, positions, masks: any difference is a failure (statistics-only rows: max and min
    # are exact, and what a dump records of them where it leaves the mean and norm out)
    "integer": {"max_absolute_error": _lim(0.0, 0.0), "norm_rel_diff": _lim(0.0, 0.0),
                "max_diff": _lim(0.0, 0.0), "min_diff": _lim(0.0, 0.0)},
}

#: the class of names that are not a class themselves: short spellings, torch's aliases and
#: quantization schemes (judged at the precision of their weights)
CLASS_ALIASES = {
    "fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32", "tf32": "float32",
    "fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp8": "float8", "w8a8": "int8",
    "w8a16": "int8", "w4a16": "int4", "uint8": "integer", "int16": "integer", "int32": "integer",
    "int64": "integer", "bool": "integer", "long": "integer", "int": "integer",
}

#: the dtype name that judges a quantized model's tensors, by its Linear layers' weight type (the
#: msModelSlim names): a model whose matmuls run in int8 or int4 cannot be held to its activations'
#: dtype; of several types the coarsest judges, activation quantization before weight-only
QUANTIZATION_DTYPES = {"W4A16": "w4a16", "W4A8": "w4a16", "W8A16": "w8a16", "W8A8": "w8a8", "W8A8S": "w8a8",
                       "W8A8_DYNAMIC": "w8a8", "W8A8_MIX": "w8a8"}


def quantization_dtype(weight_types: Iterable[str]) -> str | None:
    """The dtype name (a ``CLASS_ALIASES`` key) judging a model whose Linear layers have these
    quantized weight types; None for none."""
    names = {QUANTIZATION_DTYPES.get(t.upper(), "w8a8") for t in weight_types}
    return min(names, key=lambda n: ({"w4a16": 0, "w8a8": 1, "w8a16": 2}[n], n)) if names else None


OP_ERROR_FLOOR = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 4e-3, "float16": 5e-4}

SMALL_VALUE = {"float16": 1e-3, "bfloat16": 1e-3, "float32": 1e-6, "float64": 1e-12}
SMALL_VALUE_ATOL = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-9, "float64": 1e-15}


@lru_cache(maxsize=1024)  # called for every compared row with a handful of names
def dtype_class(dtype: Any) -> str:
    """The threshold class (a key of DEFAULT_THRESHOLDS) of a dtype: ``"torch.bfloat16"``,
    ``"bf16"`` -> ``"bfloat16"``; ``"int4"`` -> ``"int4"``; ``"float8_e5m2"`` -> ``"float8"``;
    ``"int32"`` -> ``"integer"``; a name it does not know (or None) -> ``"float32"``."""
    name = dtype_name(str(dtype or "float32").lower())
    if name in DEFAULT_THRESHOLDS:
        return name
    if name in CLASS_ALIASES:
        return CLASS_ALIASES[name]
    if name.startswith("float8"):
        return "float8"
    if name.startswith(("int", "uint")):
        return "integer"
    return "float32"
