"""The output folder of ``llmflow compare -o OUT`` (and ``precheck -o``): llmflow's own files in it,
never anything else.

OUT may hold the user's files (msit made ``-o ./`` a habit). llmflow creates OUT when it is
missing and never removes or renames it; inside, it writes only its own files and keeps a list of
them, ``OUT/.llmflow-outputs.json`` (name, size and mtime of each; a folder, such as precheck's
``repro/``, by the same of each file in it), so a rerun replaces exactly
its earlier outputs, removes those it no longer writes and leaves everything else alone. A file at
one of its names that the list does not vouch for (the user's, or one of llmflow's edited since)
is refused before any work, as is an OUT that is or lies inside one of the inputs (one that holds
an input, ``-o .`` beside the dumps, is fine: nothing below OUT's top is ever written) or inside
any other dump.

Writing is all or nothing:

1. the command writes into a staging folder of llmflow's own inside OUT,
   ``.llmflow-staging-<random>/``, which its process keeps locked (``flock``) while it lives;
2. when the command is done, the new list is written into the staging folder: the commit point;
3. with SIGINT and SIGTERM held off, each new file is renamed over its old self in the order it
   was written (the summary comes last), earlier outputs no longer written are removed, the new
   list replaces the old one and the staging folder goes.

An error, Ctrl-C or SIGTERM before 2 removes the staging folder and leaves OUT as it was. A process
killed outright (``kill -9``) leaves its staging folder: the next command writing to OUT removes
it when it holds no list (OUT is still the previous set) and otherwise finishes its commit first
(a kill in the middle of 3, a few renames long, is the only moment OUT holds a mix).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from llmflow import interrupts
from llmflow.atomic import atomic_write_text, install_staged
from llmflow.errors import UserError

OUTPUTS_LIST = ".llmflow-outputs.json"
STAGING_PREFIX = ".llmflow-staging-"
_FORMAT = "llmflow-outputs"


def _existing_ancestor(out: Path, flag: str) -> Path:
    """The existing folder ``out`` will be created in; UserError naming what is in the way."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out}: exists and is not a directory")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {out}: {parent} is a file, not a directory")
    return parent


def _refuse_overlap(out: Path, flag: str, inputs: Mapping[str, str | Path], suggest: str) -> None:
    """UserError when ``out`` is or lies inside one of ``inputs`` ({flag: path}). An OUT that holds
    an input (``-o .`` beside the dumps, msit's habit) is fine: only llmflow's own names at its top
    are written, never anything below."""
    real_out = Path(os.path.realpath(out))
    for in_flag, path in inputs.items():
        real = Path(os.path.realpath(path))
        if real == real_out:
            where = f"is the {in_flag} input"
        elif real_out.is_relative_to(real):
            where = f"lies inside the {in_flag} input {path}"
        else:
            continue
        raise UserError(f"{flag} {out}: {where}; write the tables to a folder of their own "
                        f"(e.g. {flag} {suggest})")


def _refuse_inside_dump(out: Path, flag: str, suggest: str) -> None:
    """UserError when ``out`` is or lies inside a dump (any format a reader claims), an input or
    not: tables written there would become part of a dump that took device time to make."""
    from llmflow.formats import dump_around

    found = dump_around(out)
    if found is not None:
        folder, fmt = found
        where = "is" if Path(os.path.realpath(out)) == folder else "lies inside"
        raise UserError(f"{flag} {out}: {where} the {fmt} dump {folder}; write the tables to a folder of "
                        f"their own (e.g. {flag} {suggest})")


def _fingerprint(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _entry_fingerprint(path: Path) -> dict[str, Any] | None:
    """What the outputs list records of an output: a regular file's size and mtime; a folder's
    files, each by its relative path, size and mtime (a file added, changed or removed inside
    makes it another folder), with their total size and latest mtime. None for anything else."""
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        return _fingerprint(st)
    if not stat.S_ISDIR(st.st_mode):
        return None
    tree: dict[str, list[int]] = {}
    for top, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            inner = os.lstat(os.path.join(top, name))
            tree[os.path.relpath(os.path.join(top, name), path)] = [inner.st_size, inner.st_mtime_ns]
    return {"size": sum(v[0] for v in tree.values()),
            "mtime_ns": max((v[1] for v in tree.values()), default=0), "tree": tree}


def _read_list(path: Path, flag: str) -> dict[str, dict[str, Any]]:
    """{name: fingerprint} of the outputs list at ``path``; {} when there is none."""
    if not os.path.lexists(path):
        return {}
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise ValueError("not a regular file")
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data.get("files") if isinstance(data, dict) and data.get("format") == _FORMAT else None
        if not isinstance(files, dict):
            raise ValueError("not llmflow's list of its outputs")
        return {str(k): dict(v) for k, v in files.items()}
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{flag} {path}: {exc}; llmflow keeps the list of its outputs there (move it away)") \
            from None


def _is_ours(path: Path, written: Mapping[str, dict[str, Any]]) -> bool:
    """Whether ``path`` is the regular file or folder llmflow's list says it wrote, unchanged since."""
    try:
        return written.get(path.name) == _entry_fingerprint(path)
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _flocked(path: Path, blocking: bool = True) -> Iterator[bool]:
    """An exclusive flock on the folder ``path`` for the block; yields False when another process
    holds it and ``blocking`` is off."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # OUT may be a link to a folder
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _finish_commit(out: Path, staging: Path, flag: str) -> None:
    """Step 3 of the module docstring for a staging folder that holds its list (idempotent: a
    commit cut short is finished by running it again)."""
    previous = _read_list(out / OUTPUTS_LIST, flag)
    new = _read_list(staging / OUTPUTS_LIST, flag)
    for name in sorted(new, key=lambda n: (new[n]["mtime_ns"], n)):
        if os.path.lexists(staging / name):
            install_staged(staging / name, out / name)
    for name in previous:
        if name not in new and _is_ours(out / name, previous):
            if os.path.isdir(out / name):
                shutil.rmtree(out / name, ignore_errors=True)
            else:
                os.unlink(out / name)
    install_staged(staging / OUTPUTS_LIST, out / OUTPUTS_LIST)
    shutil.rmtree(staging, ignore_errors=True)


def _staging_dirs(out: Path) -> list[Path]:
    with os.scandir(out) as entries:
        return [Path(e.path) for e in entries
                if e.name.startswith(STAGING_PREFIX) and e.is_dir(follow_symlinks=False)]


def recover(out: Path, flag: str = "-o") -> None:
    """Deal with the staging folders of processes that died: finish a committed one, remove the
    others. A staging folder still locked belongs to a live process and is left to it."""
    for staging in _staging_dirs(out):
        with _flocked(staging, blocking=False) as mine:
            if not mine:
                continue
            if os.path.lexists(staging / OUTPUTS_LIST):
                with _flocked(out):
                    _finish_commit(out, staging, flag)
            else:
                shutil.rmtree(staging, ignore_errors=True)


class StagedDir:
    """``with StagedDir(out, names=..., inputs=...) as tmp:`` write into ``tmp``; when the block
    ends without an error, the files in ``tmp`` replace llmflow's earlier outputs in ``out``.

    ``names``: every file name the command may write (checked for files that are not llmflow's
    before any work); ``inputs``: {flag: path} of what the command reads, which ``out`` must
    neither be nor lie inside; ``suggest``: the folder name a refusal offers instead. Bad
    ``out``: a one-line UserError naming ``flag``.
    """

    def __init__(self, out: str | Path, flag: str = "-o", names: Iterable[str] = (),
                 inputs: Mapping[str, str | Path] | None = None, suggest: str = "compare_out"):
        self.out = Path(os.path.abspath(out))  # abspath folds "..": -o .. names a real folder
        self.flag = flag
        self.names = list(names)
        self._ancestor = _existing_ancestor(self.out, flag)
        _refuse_overlap(self.out, flag, inputs or {}, suggest)
        _refuse_inside_dump(self.out, flag, suggest)
        self.tmp: Path | None = None
        self._created: list[Path] = []  # folders this command created, deepest last
        self._lock_fd: int | None = None

    def _where(self, exc: OSError) -> UserError:
        return UserError(f"{self.flag} {self.out}: cannot write in {self._ancestor} ({exc.strerror or exc})")

    def __enter__(self) -> Path:
        missing = []
        parent = self.out
        while parent != self._ancestor:
            missing.append(parent)
            parent = parent.parent
        try:
            for folder in reversed(missing):
                folder.mkdir()
                self._created.append(folder)
            recover(self.out, self.flag)
            self._refuse_foreign(self.names)
            self.tmp = self.out / f"{STAGING_PREFIX}{secrets.token_hex(4)}"
            self.tmp.mkdir()
            self._lock_fd = os.open(self.tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # alive: recover() in another process leaves it
        except OSError as exc:
            self._abandon()
            raise self._where(exc) from None
        except BaseException:
            self._abandon()
            raise
        return self.tmp

    def _refuse_foreign(self, names: Iterable[str]) -> None:
        written = _read_list(self.out / OUTPUTS_LIST, self.flag)
        for name in names:
            path = self.out / name
            if os.path.lexists(path) and not _is_ours(path, written):
                raise UserError(f"{self.flag} {self.out}: {name} is not what llmflow wrote there (or it "
                                f"changed since); move it away or choose another {self.flag}")

    def _abandon(self) -> None:
        """Remove the staging folder, and the folders this command created if they are empty."""
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        for folder in reversed(self._created):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: something else may have been put there meanwhile

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            self._abandon()
            return
        assert self.tmp is not None
        try:
            with interrupts.signals_held(), _flocked(self.out):
                staged = {e.name: fp for e in os.scandir(self.tmp)
                          if (fp := _entry_fingerprint(Path(e.path))) is not None}
                self._refuse_foreign(staged)
                listing: dict[str, Any] = {"format": _FORMAT, "version": 1, "files": staged}
                atomic_write_text(self.tmp / OUTPUTS_LIST, json.dumps(listing, indent=1))  # the commit point
                _finish_commit(self.out, self.tmp, self.flag)
        except BaseException:
            if not os.path.lexists(self.tmp / OUTPUTS_LIST):  # not committed: drop it whole
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
