"""Cheap checks of whether an llmflow dump is whole: what ``LlmflowDumpReader.problems()`` says.

Nothing here reads tensor data. The reader checks each data file the index names with
``safetensors_files.read_table`` (``stat`` and the safetensors header: a missing, truncated,
non-regular (a FIFO) or foreign file, keys the file does not hold, one small read per file). Here:
the rank folder's own records (``rank.json``), which tell of a writer that never closed, capture
stopped by ``max_bytes`` and steps whose forward raised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
