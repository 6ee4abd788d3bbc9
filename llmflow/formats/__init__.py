"""Dump formats: one reader (and where we write it, one writer) per format.

``open_dump(path)`` tries each registered reader's ``detect`` in order and opens the first match.
Readers are registered in the ``llmflow.formats`` entry-point group; the built-in ones are listed
in pyproject.toml like any plugin.
"""

from __future__ import annotations

from pathlib import Path

from llmflow.errors import UserError
from llmflow.formats.base import DumpReader, Entry

__all__ = ["DumpReader", "Entry", "open_dump", "reader_types"]


def reader_types() -> dict[str, type[DumpReader]]:
    """Format name -> reader class; llmflow's own format is detected first.

    Detection tries readers in this order, and the native format is the most
    specific (it has a manifest), so it goes first; the rest keep plugin order.
    """
    from llmflow.plugins import load_group

    types = load_group("llmflow.formats")
    return dict(sorted(types.items(), key=lambda kv: kv[0] != "llmflow"))


def open_dump(path: str | Path, format: str | None = None) -> DumpReader:
    """Open a dump directory (or a single dump file) of any known format."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such dump file or directory")
    types = reader_types()
    if format:
        if format not in types:
            raise UserError(f"{p}: unknown dump format {format!r} (known: {', '.join(types)})")
        return types[format](p)
    for cls in types.values():
        if cls.detect(p):
            return cls(p)
    raise UserError(f"{p}: not a dump of any known format ({', '.join(types)})")
