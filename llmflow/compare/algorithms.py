"""Custom compare algorithms: extra report columns computed by user code.

An algorithm is ``func(golden, target) -> (value, message)`` on two float32 CPU tensors of the same
shape (msit's ``-alg file.py:func`` contract). It is referenced as ``path/to/file.py:func``
(relative to the workflow file or the current directory) or by the name of an entry point in the
``llmflow.algorithms`` group. Its value lands in a column named after it and its message in
``<name>_message``; an exception is caught and written to the message column of that row, so a
broken algorithm never stops the compare.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmflow.errors import UserError
from llmflow.plugins import is_file_ref, load_file_ref, load_plugin

if TYPE_CHECKING:  # (torch is imported where an algorithm runs: validate names columns without it)
    import torch

Algorithm = Callable[["torch.Tensor", "torch.Tensor"], Any]


def algorithm_name(ref: str) -> str:
    """The column name of an algorithm reference: the function name, or the entry-point name."""
    return ref.rpartition(":")[2] if is_file_ref(ref) else ref


def load_algorithms(refs: Sequence[str], base_dir: str | Path = ".") -> dict[str, Algorithm]:
    """Column name -> callable, for every reference; UserError for unknown or non-callable ones."""
    out: dict[str, Algorithm] = {}
    for ref in refs or ():
        func = load_file_ref(ref, base_dir) if is_file_ref(ref) else load_plugin("llmflow.algorithms", ref)
        if not callable(func):
            raise UserError(f"algorithm {ref!r} is not callable")
        name = algorithm_name(ref)
        if name in out:
            raise UserError(f"algorithm {ref!r}: another algorithm already uses the column {name!r}")
        out[name] = func
    return out


def run_algorithm(name: str, func: Algorithm, golden: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    """``{name: value, name_message: message}``; errors become the message, value NaN."""
    import torch

    try:
        result = func(golden, target)
        value, message = result if isinstance(result, tuple) and len(result) == 2 else (result, "")
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else str(value.tolist())
        elif value is not None and not isinstance(value, (int, float, str, bool)):
            value = str(value)
        return {name: value, f"{name}_message": "" if message is None else str(message)}
    except Exception as exc:  # user code: report it on the row, keep going
        return {name: math.nan, f"{name}_message": f"error: {type(exc).__name__}: {exc}"}
