"""The run directory on disk: created, locked, cleaned and filled without following a symlink.

<run-dir>/
  .lock                       flock'ed for the whole run; holds the owner's pid
  .tmp/<stage>-<random>/      a running stage's output; renamed into place when run() returns
  .failed/<stage>/            a failed stage's partial output, kept for inspection
  <stage>/                    a completed stage (its state file: state.py)
  summary.json                rewritten atomically as stages finish

A symlink at one of these places would aim llmflow's deletes and writes at someone else's files
(a ``.tmp`` linked to a home directory would be emptied, a ``.lock`` linked to a file truncated),
so each place is checked with ``lstat`` and the lock is opened with ``O_NOFOLLOW``: a link is
refused with a ``UserError`` naming it, never followed. The run directory itself may be a link
(``runs -> /scratch/runs``): where it lives is the user's choice.

Files llmflow writes get the permissions the user's umask allows, like any file the user creates.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmflow.errors import UserError

LOCK_FILE = ".lock"
TMP_DIR = ".tmp"
FAILED_DIR = ".failed"
SUMMARY_FILE = "summary.json"


def refuse_link(path: Path) -> None:
    """A ``UserError`` naming ``path`` when it is a symbolic link."""
    if os.path.islink(path):
        raise UserError(
            f"{path}: is a symbolic link; llmflow never follows links inside a run dir (remove it)"
        )


def open_run_dir(run_dir: Path, stage_ids: Iterable[str]) -> None:
    """Create ``run_dir`` if needed; refuse one that cannot be a run dir or holds links where
    llmflow writes. Every problem is a one-line ``UserError`` naming the path."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run dir {run_dir}: not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"run dir {run_dir}: cannot create it ({exc.strerror or exc})") from None
    check_run_dir(run_dir, stage_ids)


def check_run_dir(run_dir: Path, stage_ids: Iterable[str]) -> None:
    """Refuse an existing ``run_dir`` that is not a directory or holds a link where llmflow
    writes (see the module docstring)."""
    if not run_dir.is_dir():
        raise UserError(f"run dir {run_dir}: not a directory")
    for name in (LOCK_FILE, TMP_DIR, FAILED_DIR, SUMMARY_FILE):
        refuse_link(run_dir / name)
    for name, is_dir in ((TMP_DIR, True), (FAILED_DIR, True), (SUMMARY_FILE, False)):
        path = run_dir / name
        if os.path.lexists(path) and (path.is_dir() if is_dir else path.is_file()) is False:
            kind = "a directory" if is_dir else "a file"
            raise UserError(f"{path}: not {kind}; llmflow keeps its own {name} there (remove it)")
    for sid in stage_ids:
        refuse_link(run_dir / sid)
        refuse_link(run_dir / FAILED_DIR / sid)


def read_json(path: Path) -> Any | None:
    """A JSON file's content, or None when missing or unreadable (a torn write counts as missing)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class RunDirLock:
    """An exclusive ``fcntl.flock`` on ``<run-dir>/.lock`` held for a whole run."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        open_run_dir(self.path.parent, ())
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            refuse_link(self.path)  # O_NOFOLLOW's ELOOP: say what it means
            raise UserError(f"run dir {self.path.parent}: cannot create {LOCK_FILE} "
                            f"({exc.strerror or exc})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UserError(f"{self.path}: not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(
                f"run dir {self.path.parent} is in use by another llmflow run (pid {pid})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def clean_tmp(run_dir: Path) -> list[str]:
    """Remove what interrupted runs left in ``<run-dir>/.tmp``; returns the removed names.
    A link in there is removed itself, never what it points at."""
    tmp = run_dir / TMP_DIR
    refuse_link(tmp)
    if not tmp.is_dir():
        return []
    removed = []
    with os.scandir(tmp) as entries:
        for child in list(entries):
            if child.is_dir(follow_symlinks=False):
                shutil.rmtree(child.path, ignore_errors=True)  # rmtree does not follow links inside
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child.path)
            removed.append(child.name)
    return removed


def new_tmp_dir(run_dir: Path, stage_id: str) -> Path:
    """A fresh ``<run-dir>/.tmp/<stage>-<random>`` directory."""
    root = run_dir / TMP_DIR
    refuse_link(root)
    root.mkdir(exist_ok=True)
    path = root / f"{stage_id}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def install(tmp: Path, final: Path) -> None:
    """Move a finished stage's tmp dir to its final place, replacing an older result."""
    refuse_link(final)
    if final.exists():
        old = tmp.parent / f"{final.name}-old-{secrets.token_hex(4)}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def remove_failed(run_dir: Path, stage_id: str) -> None:
    """Forget an older failure's leftovers of a stage that has now completed."""
    failed = run_dir / FAILED_DIR / stage_id
    if not os.path.islink(run_dir / FAILED_DIR) and not os.path.islink(failed):
        shutil.rmtree(failed, ignore_errors=True)


def discard(tmp: Path, run_dir: Path, stage_id: str) -> None:
    """Keep a failed stage's partial output at ``.failed/<stage>`` (for inspection), replacing an
    older one; dropped instead when a link sits where it would go."""
    parent = run_dir / FAILED_DIR
    failed = parent / stage_id
    if os.path.islink(parent) or os.path.islink(failed):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    shutil.rmtree(failed, ignore_errors=True)
    try:
        parent.mkdir(exist_ok=True)
        os.replace(tmp, failed)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
