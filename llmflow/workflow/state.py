"""What a run leaves on disk, written so that a killed run never lies.

<run-dir>/
  .lock                       flock'ed for the whole run; holds the owner's pid
  .tmp/<stage>-<random>/      a running stage's output; renamed into place when run() returns
  <stage>/.llmflow-stage.json written inside the tmp dir *before* the rename: a stage dir with a
                              state file is complete; the file records fingerprint, outputs, timings
  summary.json                rewritten atomically as stages finish
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

from llmflow.errors import UserError

STATE_FILE = ".llmflow-stage.json"
TMP_DIR = ".tmp"


def fingerprint(identity: str, params: dict[str, Any], upstream: dict[str, str]) -> str:
    """sha256 of the stage type (+version), its resolved parameters and its inputs' fingerprints."""
    payload = json.dumps(
        {"stage": identity, "params": params, "needs": upstream},
        sort_keys=True,
        default=str,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON via a temp file + rename, so readers see the old or the new file, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, default=str)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; summary.json is for everyone to read
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> Any | None:
    """A JSON file's content, or None when missing or unreadable (a torn write counts as missing)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_state(stage_dir: Path) -> dict[str, Any] | None:
    """The state of a *completed* stage directory, or None."""
    state = read_json(stage_dir / STATE_FILE)
    return state if isinstance(state, dict) and "fingerprint" in state else None


class RunDirLock:
    """An exclusive ``fcntl.flock`` on ``<run-dir>/.lock`` held for a whole run."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self._fh: Any = None

    def __enter__(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held until __exit__
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            pid = fh.read().strip() or "unknown"
            fh.close()
            raise UserError(
                f"run dir {self.path.parent} is in use by another llmflow run (pid {pid})"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def clean_tmp(run_dir: Path) -> list[str]:
    """Remove what interrupted runs left in ``<run-dir>/.tmp``; returns the removed names."""
    tmp = run_dir / TMP_DIR
    if not tmp.is_dir():
        return []
    removed = []
    for child in tmp.iterdir():
        shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        removed.append(child.name)
    return removed


def new_tmp_dir(run_dir: Path, stage_id: str) -> Path:
    """A fresh ``<run-dir>/.tmp/<stage>-<random>`` directory."""
    path = run_dir / TMP_DIR / f"{stage_id}-{secrets.token_hex(4)}"
    path.mkdir(parents=True)
    return path


def install(tmp: Path, final: Path) -> None:
    """Move a finished stage's tmp dir to its final place, replacing an older result."""
    if final.exists():
        old = tmp.parent / f"{final.name}-old-{secrets.token_hex(4)}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def rewrite_paths(value: Any, old: str, new: str) -> Any:
    """Strings at or under directory ``old`` rewritten to be under ``new``, recursively.
    ``Path`` values become strings (outputs are JSON)."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        if value == old or value.startswith(old + os.sep):
            return new + value[len(old) :]
        return value
    if isinstance(value, dict):
        return {k: rewrite_paths(v, old, new) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rewrite_paths(v, old, new) for v in value]
    return value


def discard(tmp: Path, failed_dir: Path) -> None:
    """Keep a failed stage's partial output at ``failed_dir`` (for inspection), replacing older."""
    shutil.rmtree(failed_dir, ignore_errors=True)
    failed_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, failed_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
