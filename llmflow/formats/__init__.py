"""Dump formats: one reader (and where we write it, one writer) per format.

``open_dump(path)`` tries each registered reader's ``detect`` in order and opens the first match.
A folder no reader claims may be the ``dump_path`` a dump was written under (``DumpConfig``
puts the dump in ``<dump_path>/<dump_tag>``, ``<dump_tag>_1`` for a second dialogue turn): the
one dump among its sub-folders is opened, several are listed. Readers are registered in the
``llmflow.formats`` entry-point group; the built-in ones are listed in pyproject.toml like any
plugin.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmflow.errors import UserError
from llmflow.formats.base import DumpReader, Entry
from llmflow.plugins import broken_plugins

__all__ = ["DumpReader", "Entry", "dump_around", "locator", "locator_prefix", "open_dump", "reader_types"]


def reader_types() -> dict[str, type[DumpReader]]:
    """Format name -> reader class; llmflow's own format is detected first.

    Detection tries readers in this order, and the native format is the most
    specific (it has a manifest), so it goes first; the rest keep plugin order. A format plugin
    that fails to import is left out with a warning (``llmflow.plugins.load_group``).
    """
    from llmflow.plugins import load_group

    types = load_group("llmflow.formats")
    return dict(sorted(types.items(), key=lambda kv: kv[0] != "llmflow"))


def _detected(p: Path, types: dict[str, type[DumpReader]]) -> type[DumpReader] | None:
    return next((cls for cls in types.values() if cls.detect(p)), None)


def dump_around(path: str | Path) -> tuple[Path, str] | None:
    """The dump folder ``path`` is or lies inside (its nearest existing folder or any above it),
    with the dump's format; None where no reader claims any of them."""
    types = reader_types()
    here = Path(os.path.realpath(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    for folder in (here, *here.parents):
        if folder.is_dir() and (cls := _detected(folder, types)) is not None:
            dump = Path(os.path.realpath(cls.dump_folder(folder)))
            if here == dump or here.is_relative_to(dump):  # (else a folder beside the dump, in its
                return dump, cls.format                    # dump_path: the user's)
    return None


def open_dump(path: str | Path, format: str | None = None) -> DumpReader:
    """Open a dump directory (or a single dump file) of any known format, or the one dump in a
    folder of dumps (a ``dump_path``)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such dump file or directory")
    if not (p.is_dir() or p.is_file()):
        raise UserError(f"{p}: not a regular file or directory (a FIFO or device is never read)")
    types = reader_types()
    if format:
        if format not in types:
            broken = broken_plugins("llmflow.formats")
            if format in broken:
                raise UserError(f"{p}: {broken[format]}")
            raise UserError(f"{p}: unknown dump format {format!r} (known: {', '.join(types)})")
        return types[format](p)
    cls = _detected(p, types)
    if cls is not None:
        return cls(p)
    found = []
    if p.is_dir():
        subdirs = sorted((d for d in p.iterdir() if d.is_dir() and not d.name.startswith(".")),
                         key=lambda d: d.name)
        found = [(d, c) for d in subdirs if (c := _detected(d, types)) is not None]
    if len(found) == 1:
        d, cls = found[0]
        return cls(d)
    if found:
        names = ", ".join(f"{d} ({c.format})" for d, c in found)
        raise UserError(f"{p}: holds {len(found)} dumps, name one: {names}")
    # a rank, step or data folder of a dump: the readers take the dump whole (a rank: --rank/-r)
    for parent in p.absolute().parents[:2]:
        if (cls := _detected(parent, types)) is not None:
            what = "a folder" if p.is_dir() else "a file"
            raise UserError(f"{p}: {what} inside the {cls.format} dump {parent}: give the dump itself "
                            "(its ranks are read from it; compare takes one rank with -r/--rank N)")
    broken = "".join(f"; format plugin {name!r} failed to import"
                     for name in broken_plugins("llmflow.formats"))
    raise UserError(f"{p}: not a dump of any known format ({', '.join(types)}), nor a folder holding one"
                    f"{broken}")


def locator_prefix(reader: DumpReader) -> str:
    """The folder entry keys are relative to, relative to ``reader.path`` ("" when it is that path):
    foreign readers key their files from the ``torch_tensors``/``tensors`` folder they found."""
    base = getattr(reader, "tensors_dir", None)
    if base is None:
        return ""
    rel = os.path.relpath(base, reader.path)
    return "" if rel == "." else Path(rel).as_posix() + "/"


def locator(reader: DumpReader, entry: Entry, prefix: str | None = None) -> str:
    """Where an entry's bytes lie, relative to the dump directory ``reader.path``: the file (msit
    ``.pth``, ATB ``.bin``, msprobe ``.pt``/``.npy``) or ``file:key`` of llmflow's safetensors
    batches (``rank0/data/000003.safetensors:1234``). "" for an entry without tensor data.
    ``prefix``: ``locator_prefix(reader)``, when the caller has it already."""
    if not entry.has_data or not entry.key:
        return ""
    return (locator_prefix(reader) if prefix is None else prefix) + entry.key
