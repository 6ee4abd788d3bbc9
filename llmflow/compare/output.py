"""The output directory of ``llmflow compare``, written all at once or not at all.

A compare writes into a hidden temporary directory beside ``-o OUT`` and moves it into place at
the end, as the workflow stages do: a run killed halfway leaves ``OUT`` as it was (an earlier
compare's CSVs, XLSX and summary together, never new CSVs beside an old summary), and a refused
compare leaves nothing. A bad ``-o`` (a file, a path under a file, a folder it cannot write in)
is a one-line error before any work.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import TracebackType

from llmflow.errors import UserError


def _check(out: Path, flag: str) -> Path:
    """The existing ancestor ``out`` will be created in; UserError naming what is in the way."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out}: exists and is not a directory")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {out}: {parent} is a file, not a directory")
    return parent


class StagedDir:
    """``with StagedDir(out) as tmp:`` write into ``tmp``; on success ``tmp`` replaces ``out``."""

    def __init__(self, out: str | Path, flag: str = "-o"):
        self.out = Path(out).absolute()
        self.flag = flag
        _check(self.out, flag)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"

    def __enter__(self) -> Path:
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.tmp.mkdir()
        except OSError as exc:
            raise UserError(f"{self.flag} {self.out}: cannot write in {self.out.parent} "
                            f"({exc.strerror or exc})") from exc
        return self.tmp

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.replace(self.out, old)  # a directory cannot be replaced in one rename: two, then delete
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
