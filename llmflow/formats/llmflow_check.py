"""Cheap checks of whether an llmflow dump is whole: what ``LlmflowDumpReader.problems()`` says.

Nothing here reads tensor data. A data file is checked with ``stat`` and its safetensors header
(8 bytes giving the header's length, then a JSON object naming every tensor and its byte range):
that finds a missing, truncated, non-regular (a FIFO) or foreign file, and keys the file does not
hold, for one small read per data file. The rank folder's own records (``rank.json``) tell of a
writer that never closed, capture stopped by ``max_bytes`` and steps whose forward raised.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from llmflow.errors import DumpFormatError
from llmflow.formats._safe import open_regular, regular_file
from llmflow.safetensors_files import SAFETENSORS_DTYPES

MAX_HEADER = 100 << 20  # the most a safetensors header may take (the library's own limit)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: its dtype (the format's name: ``"F32"``), shape, and the
    absolute byte range of its data in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def safetensors_table(path: Path) -> tuple[dict[str, StoredTensor], str | None]:
    """The tensors of a safetensors file whose bytes are all there, and None; or an empty table
    and why the file cannot be used (``"missing"``, ``"not a regular file"``, ``"truncated..."``).
    Each tensor's byte range lies in the file and matches its dtype and shape where the dtype is
    one torch holds, so a load can map it without further checks."""
    st = regular_file(path)
    if st is None:
        return {}, "missing" if not os.path.lexists(path) else "not a regular file"
    size = st.st_size
    if size < 8:
        return {}, f"truncated ({size} bytes, not even a safetensors header)"
    try:
        with open_regular(path) as f:
            n = int.from_bytes(f.read(8), "little")
            if n > min(size - 8, MAX_HEADER):
                return {}, f"truncated or not a safetensors file (a {n}-byte header in {size} bytes)"
            head = f.read(n)
    except (OSError, DumpFormatError) as exc:
        return {}, f"unreadable ({getattr(exc, 'strerror', None) or exc})"
    try:
        header = orjson.loads(head)  # (a real dump's data file names thousands of tensors)
    except orjson.JSONDecodeError:
        return {}, "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return {}, "not a safetensors file (its header is not a JSON object)"
    table: dict[str, StoredTensor] = {}
    start = 8 + n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
            return {}, f"not a safetensors file (tensor {key[:60]!r} has no byte range)"
        dtype, shape = info.get("dtype"), info.get("shape")
        if type(dtype) is not str or type(shape) is not list or \
                not all(type(d) is int for d in shape) or (shape and min(shape) < 0):
            return {}, f"not a safetensors file (tensor {key[:60]!r} has no dtype or shape)"
        torch_dtype = SAFETENSORS_DTYPES.get(dtype)
        if torch_dtype is not None and math.prod(shape) * torch_dtype.itemsize != offsets[1] - offsets[0]:
            return {}, (f"not a safetensors file (tensor {key[:60]!r}: {offsets[1] - offsets[0]} bytes "
                        f"for {dtype}{shape})")
        table[key] = StoredTensor(dtype, tuple(shape), start + offsets[0], start + offsets[1])
    end = max((t.end for t in table.values()), default=start)
    if end > size:
        return {}, f"truncated ({size} bytes on disk, its header describes {end})"
    return table, None


def rank_problems(rank_dir: Path, rank_meta: Any) -> list[str]:
    """What a rank folder's ``rank.json`` and its data folder say about the dump's wholeness."""
    out: list[str] = []
    where = rank_dir / "rank.json"
    if not isinstance(rank_meta, dict):
        out.append(f"{where}: missing or not a JSON object: this rank's writer never started properly")
        rank_meta = {}
    elif not rank_meta.get("complete"):
        out.append(f"{where}: the writer never closed this dump (complete: false): the process was "
                   "killed or is still running, so what it had not yet written is missing")
    if rank_meta.get("truncated"):
        out.append(f"{where}: capture stopped early ({_text(rank_meta.get('stop_reason')) or 'truncated'})")
    errors = rank_meta.get("errors")
    for err in errors if isinstance(errors, list) else []:
        if isinstance(err, dict):
            module = _text(err.get("module"))
            out.append(f"{where}: step {_text(err.get('step'))}: the model's forward raised "
                       f"{_text(err.get('error'))}{f' in {module}' if module else ''}; that step holds only "
                       "what was captured before it")
    data = rank_dir / "data"
    try:
        leftovers = sorted(p.name for p in data.iterdir() if p.name.endswith(".tmp"))
    except OSError:
        leftovers = []
    for name in leftovers:
        out.append(f"{data / name}: an unfinished data file (the writer stopped while writing it; "
                   "its tensors were never indexed)")
    return out


def _text(value: Any) -> str:
    """A value from a dump's JSON, as one short line of text."""
    return " ".join(str(value).split())[:300] if value is not None else ""
