"""Files written whole or not at all: the text goes to a temporary file beside the target, then one
``os.replace`` puts it in place, so a reader (or a run killed half-way) sees the old file or the
new one, never half. The rename replaces a link at the target rather than writing through it.

A finished staging folder goes into place the same way, by renames only (``install_staged``):
``workflow/rundir.py`` installs a stage's folder with it, ``compare/output.py`` each file of a
compare's output.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` can only be read by setting it,
    which would race with threads creating files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)  # no /proc: read it once, at import, before any thread exists
    os.umask(old)
    return old


_UMASK = _umask()


def atomic_write_text(path: Path, text: str, *, durable: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all; ``durable`` also syncs it to disk
    before the rename (a state file that must survive a power cut, not only a kill). The file gets
    the mode ``open`` would give it (0666 less the umask)."""
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())

    atomic_write_with(path, write)


def atomic_write_with(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` fills a temporary file beside ``path`` (made here, so only it is ever removed;
    a library that writes to a path name: safetensors), which then replaces ``path`` whole with the
    mode ``open`` would give it (0666 less the umask); on any error the temporary file goes."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, data: Any, *, indent: int | None = None, durable: bool = False) -> None:
    """``data`` as JSON (values JSON does not know written as text), whole or not at all; with
    ``indent``, pretty-printed and ending in a newline."""
    text = json.dumps(data, indent=indent, default=str)
    atomic_write_text(path, text + "\n" if indent is not None else text, durable=durable)


def install_staged(staged: Path, final: Path) -> None:
    """Put ``staged``, a file or folder llmflow has finished writing, at ``final`` by renames only,
    replacing what is there: a reader (or a run killed half-way) finds the old one whole or the new
    one whole, never a mix.

    A file, or a ``final`` that does not exist: one ``os.replace`` (a link at ``final`` is
    replaced, never written through). A folder over a folder, which one rename cannot replace: the
    old folder is renamed aside, beside ``staged`` (in the caller's staging area, on the same
    file system), the new one renamed in, then the old one removed; should the second rename fail,
    the old folder is renamed back before the error goes on. A file never replaces a folder, nor a
    folder a link or a file (``OSError``, ``final`` untouched).

    The old ``final`` is the one thing removed, and the caller vouches that llmflow wrote it
    (``workflow/rundir.py``: a stage folder holding its state file, not a link; ``compare/output.py``:
    a file its list of outputs names, unchanged since).
    """
    if not (os.path.isdir(staged) and os.path.isdir(final) and not os.path.islink(final)):
        os.replace(staged, final)
        return
    aside = staged.parent / f"{final.name}-old-{secrets.token_hex(4)}"
    os.replace(final, aside)
    try:
        os.replace(staged, final)
    except BaseException:
        os.replace(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)
