"""Opening only regular files: a path that names a FIFO or a device never blocks a reader.

Opening a FIFO for reading waits for a writer forever, and a device file may never end. Dumps and
checkpoints come from other machines and other people's tools, so every reader of their data
files goes through these two.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from llmflow.errors import DumpFormatError


def open_regular(path: Path | str) -> BinaryIO:
    """``open(path, "rb")`` for a regular file only: a ``DumpFormatError`` for anything else.

    The file is opened without blocking and checked on the open descriptor: a ``stat`` before
    ``open`` leaves a window in which the file can be swapped for a FIFO.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DumpFormatError(f"{path}: not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def regular_file(path: Path | str) -> os.stat_result | None:
    """``stat`` of ``path`` when it is a regular file (symlinks followed), else None."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None
