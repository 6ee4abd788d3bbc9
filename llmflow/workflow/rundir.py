"""The run directory on disk: created, locked, cleaned and filled without following a symlink.

<run-dir>/
  .llmflow-run-dir            the mark of a folder llmflow made (or was told to use) a run dir
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

llmflow never takes over a folder that holds someone else's files: an existing folder without the
mark is refused unless it is empty, was a run dir of an earlier llmflow (``_made_by_llmflow``:
llmflow's summary.json, a stage folder whose state file names that folder, and nothing but
llmflow's own in ``.tmp`` and ``.failed``) or the user says so (``--adopt-run-dir``: llmflow's
entries then go beside the user's, and none of its names may be taken). Inside a marked run dir
llmflow touches only its own entries: a folder at a stage's name without the stage's state file is
refused, not replaced, the files a user adds to a completed stage's folder (those its state file
does not list) stay there, carried into the new folder when the stage reruns, and ``.tmp`` is
emptied of llmflow's tmp dirs only.

Files llmflow writes get the permissions the user's umask allows, like any file the user creates.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmflow.atomic import atomic_write_json, install_staged
from llmflow.errors import UserError

LOCK_FILE = ".lock"
TMP_DIR = ".tmp"
FAILED_DIR = ".failed"
SUMMARY_FILE = "summary.json"
STATE_FILE = ".llmflow-stage.json"  # in each completed stage's folder (state.py)
RUN_DIR_MARK = ".llmflow-run-dir"
_MARK = {"format": "llmflow-run-dir", "version": 1}
#: the names llmflow gives what it puts in ``.tmp``: ``<stage>-<random>`` (``new_tmp_dir``) and
#: ``<stage>-old-<random>`` (an older stage folder on its way out, ``install_staged``)
_TMP_NAME = re.compile(r".+-[0-9a-f]{8}")


def refuse_link(path: Path) -> None:
    """A ``UserError`` naming ``path`` when it is a symbolic link."""
    if os.path.islink(path):
        raise UserError(
            f"{path}: is a symbolic link; llmflow never follows links inside a run dir (remove it)"
        )


def open_run_dir(run_dir: Path, stage_ids: Iterable[str], adopt: bool = False) -> None:
    """Create ``run_dir`` if needed and mark it; refuse one that cannot be a run dir, is someone
    else's folder (unless ``adopt``), or holds links or foreign entries where llmflow writes.
    Every problem is a one-line ``UserError`` naming the path."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run dir {run_dir}: not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"run dir {run_dir}: cannot create it ({exc.strerror or exc})") from None
    stage_ids = list(stage_ids)
    check_run_dir(run_dir, stage_ids)
    _claim(run_dir, stage_ids, adopt)
    for sid in stage_ids:
        stage_dir = run_dir / sid
        if os.path.lexists(stage_dir) and not os.path.isfile(stage_dir / STATE_FILE):
            raise UserError(f"run dir {run_dir}: {sid} is not a stage folder llmflow wrote (no {STATE_FILE} "
                            f"in it); move it away, llmflow keeps stage {sid}'s output there")


def _made_by_llmflow(run_dir: Path) -> bool:
    """A run dir of an llmflow from before the mark: llmflow's summary.json and a stage folder whose
    state file names that very folder (a copied stage folder keeps the name of the stage it came
    from), with nothing that says otherwise: every folder holding a state file is named for its
    stage, ``.tmp`` holds only llmflow's tmp dirs and ``.failed`` only folders. A folder llmflow
    would empty or overwrite is taken only when all of it looks like llmflow wrote it."""
    summary = read_json(run_dir / SUMMARY_FILE) if os.path.isfile(run_dir / SUMMARY_FILE) else None
    if not (isinstance(summary, dict) and {"workflow", "status", "stages"} <= set(summary)):
        return False
    stages = 0
    with os.scandir(run_dir) as entries:
        for entry in entries:
            state = Path(entry.path) / STATE_FILE
            if not entry.is_dir(follow_symlinks=False) or not os.path.isfile(state):
                continue
            record = read_json(state)
            if not isinstance(record, dict) or record.get("stage") != entry.name:
                return False
            stages += 1
    return stages > 0 and _only(run_dir / TMP_DIR, _TMP_NAME) and _only(run_dir / FAILED_DIR, None)


def _only(folder: Path, names: re.Pattern[str] | None) -> bool:
    """Whether ``folder`` is missing or holds only folders (not links), named to match ``names``."""
    if not os.path.isdir(folder):
        return True
    with os.scandir(folder) as entries:
        return all(e.is_dir(follow_symlinks=False) and (names is None or names.fullmatch(e.name))
                   for e in entries)


def _claim(run_dir: Path, stage_ids: list[str], adopt: bool) -> None:
    """Mark ``run_dir`` as llmflow's (see the module docstring for which folders it may take)."""
    mark = run_dir / RUN_DIR_MARK
    refuse_link(mark)
    if os.path.isfile(mark):
        return
    if os.listdir(run_dir) and not _made_by_llmflow(run_dir):
        if not adopt:
            raise UserError(f"run dir {run_dir}: exists, holds files and is not an llmflow run dir (no "
                            f"{RUN_DIR_MARK}); give a new or empty folder, or --adopt-run-dir to add "
                            "llmflow's files beside the ones there")
        for name in (LOCK_FILE, TMP_DIR, FAILED_DIR, SUMMARY_FILE, *stage_ids):
            if os.path.lexists(run_dir / name):
                raise UserError(f"run dir {run_dir}: {name} is in the way (llmflow keeps its own {name} "
                                "there); move it away")
    try:
        atomic_write_json(mark, _MARK, indent=2, durable=True)
    except OSError as exc:
        raise UserError(f"run dir {run_dir}: cannot write {RUN_DIR_MARK} ({exc.strerror or exc})") from None


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
    Only llmflow's tmp dirs (``_TMP_NAME``) are removed with what they hold; a link in there is
    removed itself, never what it points at; any other file or folder is not llmflow's and stays."""
    tmp = run_dir / TMP_DIR
    refuse_link(tmp)
    if not tmp.is_dir():
        return []
    removed = []
    with os.scandir(tmp) as entries:
        for child in list(entries):
            if child.is_symlink():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child.path)
            elif child.is_dir(follow_symlinks=False) and _TMP_NAME.fullmatch(child.name):
                shutil.rmtree(child.path, ignore_errors=True)  # rmtree does not follow links inside
            else:
                continue
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
    """Move a finished stage's tmp dir to its final place, replacing an older result (a folder
    ``open_run_dir`` found to be a stage folder llmflow wrote; a link there is refused). What the
    user put in the older folder goes along into the new one (``foreign_entries``)."""
    refuse_link(final)
    moves: list[str] = []
    if os.path.isdir(final):
        # (an empty folder is one the new output may well have made again: nothing to carry)
        moves = [rel for rel in foreign_entries(final)
                 if not (_empty_dir(final / rel) and os.path.lexists(tmp / rel))]
        taken = [rel for rel in moves if os.path.lexists(tmp / rel)]
        if taken:
            raise UserError(f"{final / taken[0]}: not written by llmflow, and the stage's new output "
                            "has a file of that name; move it away and run again")
    moved: list[str] = []
    try:
        for rel in moves:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(final / rel, tmp / rel)
            moved.append(rel)
        install_staged(tmp, final)
    except BaseException:
        # the old folder is still at ``final`` (install_staged puts it back): the user's entries go
        # back into it, never left in the tmp dir a failed stage's cleanup removes
        for rel in reversed(moved):
            with contextlib.suppress(OSError):
                os.replace(tmp / rel, final / rel)
        raise


def foreign_entries(stage_dir: Path) -> list[str]:
    """Entries of a completed stage's folder that its state file does not list as the stage's
    files: the user's own (notes, a plot), by relative path, a folder of them as one entry. A
    state file without a list of files (an older llmflow's) claims the whole folder."""
    record = read_json(stage_dir / STATE_FILE)
    listed = record.get("files") if isinstance(record, dict) else None
    if not isinstance(listed, dict):
        return []
    holding = {folder for rel in listed for folder in _parents(os.path.dirname(rel))}  # (and above)
    found = []
    for top, dirs, files in os.walk(stage_dir):
        at = os.path.relpath(top, stage_dir)
        for name in sorted(dirs):
            rel = os.path.normpath(os.path.join(at, name))
            if rel not in holding and not os.path.islink(os.path.join(top, name)):
                found.append(rel)
                dirs.remove(name)  # moved as a whole
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            rel = os.path.normpath(os.path.join(at, name))
            if rel not in listed and rel != STATE_FILE:
                found.append(rel)
    return found


def _empty_dir(path: Path) -> bool:
    """A folder (not a link) with no file anywhere below it."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    return not any(files or any(os.path.islink(os.path.join(top, d)) for d in dirs)
                   for top, dirs, files in os.walk(path))


def _parents(rel: str) -> list[str]:
    """``a/b/c`` -> ``[a/b/c, a/b, a]``: a relative folder and the folders above it."""
    out = []
    while rel:
        out.append(rel)
        rel = os.path.dirname(rel)
    return out


def remove_failed(run_dir: Path, stage_id: str) -> None:
    """Forget an older failure's leftovers of a stage that has now completed."""
    failed = run_dir / FAILED_DIR / stage_id
    if not os.path.islink(run_dir / FAILED_DIR) and not os.path.islink(failed):
        shutil.rmtree(failed, ignore_errors=True)


def remove_tmp(tmp: Path) -> None:
    """Remove a stage's tmp dir (one of llmflow's own, under ``.tmp``)."""
    shutil.rmtree(tmp, ignore_errors=True)


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
