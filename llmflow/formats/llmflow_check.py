"""Cheap checks of whether an llmflow dump is whole: what ``LlmflowDumpReader.problems()`` says.

Nothing here reads tensor data. A data file is checked with ``stat`` and its safetensors header
(8 bytes giving the header's length, then a JSON object naming every tensor and its byte range):
that finds a missing, truncated, non-regular (a FIFO) or foreign file, and keys the file does not
hold, for one small read per data file. The rank folder's own records (``rank.json``) tell of a
writer that never closed, capture stopped by ``max_bytes`` and steps whose forward raised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llmflow.errors import DumpFormatError
from llmflow.formats._safe import open_regular, regular_file

MAX_HEADER = 100 << 20  # the most a safetensors header may take (the library's own limit)


def safetensors_keys(path: Path) -> tuple[frozenset[str], str | None]:
    """The tensor keys of a safetensors file whose bytes are all there, and None; or an empty set
    and why the file cannot be used (``"missing"``, ``"not a regular file"``, ``"truncated..."``)."""
    st = regular_file(path)
    if st is None:
        return frozenset(), "missing" if not os.path.lexists(path) else "not a regular file"
    size = st.st_size
    if size < 8:
        return frozenset(), f"truncated ({size} bytes, not even a safetensors header)"
    try:
        with open_regular(path) as f:
            n = int.from_bytes(f.read(8), "little")
            if n > min(size - 8, MAX_HEADER):
                return frozenset(), f"truncated or not a safetensors file (a {n}-byte header in {size} bytes)"
            head = f.read(n)
    except (OSError, DumpFormatError) as exc:
        return frozenset(), f"unreadable ({getattr(exc, 'strerror', None) or exc})"
    try:
        header = json.loads(head)
    except (ValueError, RecursionError):
        return frozenset(), "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return frozenset(), "not a safetensors file (its header is not a JSON object)"
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int and o >= 0 for o in offsets)):
            return frozenset(), f"not a safetensors file (tensor {key[:60]!r} has no byte range)"
        end = max(end, offsets[1])
    if 8 + n + end > size:
        return frozenset(), f"truncated ({size} bytes on disk, its header describes {8 + n + end})"
    return frozenset(k for k in header if k != "__metadata__"), None


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
