"""Files written whole or not at all: the text goes to a temporary file beside the target, then one
``os.replace`` puts it in place, so a reader (or a run killed half-way) sees the old file or the
new one, never half. The rename replaces a link at the target rather than writing through it.

(Directories are installed the same way by their owners: ``workflow/rundir.py`` for stage
directories, ``compare/output.py`` for a compare's output.)
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600
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
