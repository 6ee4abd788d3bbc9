"""A completed stage's state file, ``<run-dir>/<stage>/.llmflow-stage.json``, and what the cache
checks against it.

The file is written inside the stage's tmp dir *before* the rename (rundir.py): a stage dir with a
state file is complete. It records the fingerprint (stage type + version, resolved parameters,
the content of code files the stage names, what it read of the stages it needs), the run id, the
content key of its result (``content_key``), outputs, summary, outcome, timings, and the size and
mtime of every file the stage left in its dir.

Paths inside the run dir are stored relative to it (``paths`` lists where they are), so a copied
or moved run dir reads its own files; ``read_state`` resolves them against the dir it reads from.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from llmflow.workflow.rundir import STATE_FILE, read_json

#: keys of a state whose path strings are stored relative to the run dir
PORTABLE_KEYS = ("params", "outputs", "summary")


def fingerprint(identity: str, params: Any, upstream: dict[str, str], code: dict[str, str] | None = None,
                ) -> str:
    """sha256 of the stage type (+version), its resolved parameters (in ``portable`` form, so
    the same run dir elsewhere has the same fingerprints), the hashes of code files its
    parameters name, and its inputs' fingerprints."""
    payload = json.dumps(
        {"stage": identity, "params": params, "needs": upstream, **({"code": code} if code else {})},
        sort_keys=True,
        default=str,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()


# -- paths relative to the run dir ----------------------------------------------------------------
def portable(value: Any, run_dir: Path) -> tuple[Any, list[list[Any]]]:
    """``value`` with every string at or under ``run_dir`` made relative to it, and the JSON
    paths (lists of keys and indices) of those strings."""
    root = str(run_dir)
    pointers: list[list[Any]] = []

    def walk(v: Any, at: list[Any]) -> Any:
        if isinstance(v, Path):
            v = str(v)
        if isinstance(v, str) and (v == root or v.startswith(root + os.sep)):
            pointers.append(at)
            return os.path.relpath(v, root)
        if isinstance(v, dict):
            return {k: walk(x, [*at, k]) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, [*at, i]) for i, x in enumerate(v)]
        return v

    return walk(value, []), pointers


def resolve_portable(value: Any, pointers: list[list[Any]], run_dir: Path) -> Any:
    """Undo ``portable`` against ``run_dir`` (a copy of ``value``; bad pointers are ignored)."""
    value = json.loads(json.dumps(value))
    for at in pointers:
        if not at:
            value = os.path.normpath(os.path.join(run_dir, value)) if isinstance(value, str) else value
            continue
        parent = value
        try:
            for key in at[:-1]:
                parent = parent[key]
            if isinstance(parent[at[-1]], str):
                parent[at[-1]] = os.path.normpath(os.path.join(run_dir, parent[at[-1]]))
        except (KeyError, IndexError, TypeError):
            continue
    return value


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


# -- what the stage left on disk ------------------------------------------------------------------
def file_manifest(stage_dir: Path) -> dict[str, list[int]]:
    """Relative path -> [size, mtime_ns] of every file under ``stage_dir`` (links not followed),
    the state file aside. One ``lstat`` a file: cheap next to writing them."""
    out: dict[str, list[int]] = {}
    for top, dirs, files in os.walk(stage_dir):
        dirs.sort()
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, stage_dir)
            if rel == STATE_FILE:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            out[rel] = [st.st_size, st.st_mtime_ns]
    return out


# -- what a needed stage's result is, for the stages that read it ---------------------------------
# A stage's result is what the stages that need it read: its outputs, the files in its folder and,
# through paths its outputs pass on (align hands on the dumps' folders), what the stages it read
# made. Its content key hashes all three (the last as their content keys), computed once when the
# stage finishes: a stage that ran again and made the very same result from the same results
# (``--force``, a parameter that changes nothing it writes) leaves the key as it was, and the
# stages that read it stay cached. Every byte of every file is hashed: a sampled or size-only key
# would take a dump whose patch changed a few values in the middle of a tensor for the old one and
# keep a stale compare. Hashing is cheap next to making the files (the stage just wrote them, so
# they are mostly still in the page cache; sha256 reads at GB/s a core, files are hashed on several
# threads), and it runs in the stage's own thread, after ``run()``.
#: threads hashing a stage's files (hashlib and file reads let other threads run meanwhile)
HASH_THREADS = min(8, os.cpu_count() or 1)


def _file_digest(path: str) -> str:
    """sha256 of a file's bytes, or of where a link points (links are never followed)."""
    if os.path.islink(path):
        return "link:" + os.readlink(path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def files_digest(stage_dir: Path) -> str | None:
    """A hash over the relative path and content of every file ``file_manifest`` lists in
    ``stage_dir``; None when one cannot be read (then its readers fall back to its run id)."""
    rels = list(file_manifest(stage_dir))
    try:
        with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
            digests = list(pool.map(lambda rel: _file_digest(os.path.join(stage_dir, rel)), rels))
    except OSError:
        return None
    h = hashlib.sha256()
    for rel, digest in zip(rels, digests, strict=True):
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def content_key(outputs: dict[str, Any], files: str | None, read: dict[str, str], run_dir: Path,
                ) -> str | None:
    """The content key of a result: its outputs (paths relative to ``run_dir``, as a moved run dir
    reads them), ``files``, the ``files_digest`` of its folder, and ``read``, what it read of each
    stage it needs (content key, else run id); None without ``files``."""
    if files is None:
        return None
    payload = json.dumps({"outputs": portable(outputs, run_dir)[0], "files": files, "read": read},
                         sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def upstream_unchanged(state: StageState, runs: dict[str, str], contents: dict[str, str]) -> bool:
    """Whether the results in use of the stages ``state``'s stage needs (``runs``: stage -> run id,
    ``contents``: stage -> content key, where known) are the ones it read: the same content key
    when both it and the stage in use have one, else the same run id (a state written by an older
    llmflow records none: it is reused only with the very run it read)."""
    if set(state.upstream_runs) != set(runs):
        return False
    for dep, run_id in runs.items():
        recorded, now = state.upstream_content.get(dep), contents.get(dep)
        if not (recorded == now if recorded and now else state.upstream_runs[dep] == run_id):
            return False
    return True


def outputs_changed(stage_dir: Path, state: StageState) -> str | None:
    """Why the files a completed stage left no longer match its state (one file named), or None.
    A file added beside them is the user's (kept, and carried into a rerun's folder: rundir.py),
    not a change. A state without a manifest (written by an older llmflow) is taken as it is."""
    recorded = state.files
    if recorded is None:
        return None
    now = file_manifest(stage_dir)
    for rel, meta in recorded.items():
        if rel not in now:
            return f"{rel} is gone"
        if list(meta) != now[rel]:
            return f"{rel} was modified"
    return None


# -- the state file -------------------------------------------------------------------------------
@dataclass
class StageState:
    """What a completed stage's state file holds, in the order the file lists it.

    ``identity``/``fingerprint``/``code``/``upstream``/``upstream_runs``/``upstream_content`` are
    the cache key it was computed under (plan.py's ``StageKey``); ``run_id`` names this result and
    ``content`` is its content key (``content_key``; None from an older llmflow or when a file could
    not be read), so the stages that read it can tell when it was replaced by something else;
    ``files`` is the manifest of the stage dir as the stage left it (None: a state written by an
    older llmflow, taken as it is)."""

    stage: str
    type: str
    identity: str
    fingerprint: str
    code: dict[str, str] | None
    run_id: str | None
    params: dict[str, Any]
    upstream: dict[str, str]
    upstream_runs: dict[str, str]
    outputs: dict[str, Any]
    summary: dict[str, Any]
    outcome: dict[str, str] | None
    started: str | None
    finished: str | None
    duration_s: float | None
    files: dict[str, list[int]] | None = None
    content: str | None = None
    upstream_content: dict[str, str] = field(default_factory=dict)  # needed stage -> its content key
    # the folders it wrote outside the run dir (``Stage.writes_to``) -> their listing hash then
    written: dict[str, str] = field(default_factory=dict)

    def to_json(self, run_dir: Path, stage_dir: Path) -> dict[str, Any]:
        """The state file's content: run-dir paths made relative (``paths`` says where, see the
        module doc) and ``files``, the manifest of ``stage_dir`` (the tmp dir about to become the
        stage dir)."""
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "files"}
        paths = {}
        for key in PORTABLE_KEYS:
            record[key], paths[key] = portable(record[key], run_dir)
        record["paths"] = paths
        record["files"] = file_manifest(stage_dir)
        return record

    @classmethod
    def from_json(cls, data: Any, run_dir: Path) -> StageState | None:
        """The state a file holds, paths resolved against ``run_dir``; None when it is not a
        completed stage's state. A key an older llmflow did not write reads empty."""
        if not isinstance(data, dict) or "fingerprint" not in data:
            return None
        paths = data.get("paths") if isinstance(data.get("paths"), dict) else {}
        for key in PORTABLE_KEYS:
            if key in data and isinstance(paths.get(key), list):
                data[key] = resolve_portable(data[key], paths[key], run_dir)

        def mapping(key: str) -> dict[str, Any]:
            value = data.get(key)
            return value if isinstance(value, dict) else {}

        code, files, content = data.get("code"), data.get("files"), data.get("content")
        return cls(stage=data.get("stage", ""), type=data.get("type", ""), identity=data.get("identity", ""),
                   fingerprint=data["fingerprint"], code=code if isinstance(code, dict) else None,
                   run_id=data.get("run_id"), params=mapping("params"), upstream=mapping("upstream"),
                   upstream_runs=mapping("upstream_runs"), outputs=mapping("outputs"),
                   summary=mapping("summary"), outcome=data.get("outcome"), started=data.get("started"),
                   finished=data.get("finished"), duration_s=data.get("duration_s"),
                   files=files if isinstance(files, dict) else None,
                   content=content if isinstance(content, str) else None,
                   upstream_content=mapping("upstream_content"), written=mapping("written"))


def read_state(stage_dir: Path) -> StageState | None:
    """The state of a *completed* stage directory, paths resolved against the run dir it is in;
    None when there is none (or the stage dir is a link, which llmflow never follows)."""
    if os.path.islink(stage_dir):
        return None
    return StageState.from_json(read_json(stage_dir / STATE_FILE), stage_dir.resolve().parent)
