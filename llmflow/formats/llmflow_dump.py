"""llmflow's own dump format: JSON + safetensors, no pickle, readable after a crash.

Layout (see docs/ARCHITECTURE.md)::

  <dump_dir>/llmflow_dump.json        {"format": "llmflow-dump", "version": 3, "complete": bool, ...}
  <dump_dir>/env.json, topology.json
  <dump_dir>/rank{R}/rank.json        {"rank": R, "complete": bool, "truncated": bool, ...}
  <dump_dir>/rank{R}/index.jsonl      entries, a batch of rows per line (``index_line``)
  <dump_dir>/rank{R}/order.jsonl      {"step": s, "order": [...]} execution order, one line per step
  <dump_dir>/rank{R}/data/NNNNNN.safetensors

Crash tolerance comes from the write order: a batch's safetensors file is written under a
temporary name and renamed into place *before* the index lines pointing at it are appended, and
each index line goes out in one write. A killed writer therefore leaves at worst a torn last index
line (ignored here) and an orphan temporary file (never referenced). ``complete`` turns true only
when the writer closes cleanly.

``DumpDirWriter`` is the synchronous on-disk writer; ``llmflow.dump.writer`` drives it from a
background thread. ``LlmflowDumpReader`` reads it with nothing but ``json`` and ``safetensors``.
"""

from __future__ import annotations

import json
import os
import re
import time
from math import isfinite
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import torch

from llmflow.errors import DumpFormatError, UserError
from llmflow.formats._safe import open_regular, read_json, read_text, regular_file
from llmflow.formats.base import STAT_KEYS, DumpReader, Entry
from llmflow.formats.llmflow_check import rank_problems, safetensors_keys

FORMAT = "llmflow-dump"
# 2: index lines hold batches of rows (version 1: one entry a line, still read);
# 3: a statistics-mode repeat of a tensor holds no statistics of its own (``_share_repeat_stats``)
VERSION = 3
META_FILE = "llmflow_dump.json"
ENV_FILE = "env.json"
TOPOLOGY_FILE = "topology.json"
_RANK_DIR = re.compile(r"^rank(\d+)$")
MAX_META_BYTES = 64 << 20  # llmflow_dump.json, rank.json, env.json, topology.json: small files
MAX_JSON_DEPTH = 100  # their nesting (a module tree: two levels a module, ~25 deep): deeper is refused


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` via a temporary file + rename: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, default=str, allow_nan=True))
    os.replace(tmp, path)


# An index line is either one entry, ``Entry.to_json()`` (what version 1 wrote), or a batch of
# entries of one rank, ``{"rank": R, "fields": ROW_FIELDS, "rows": [[...], ...]}`` with one
# positional row per entry and statistics as a list in STAT_KEYS order. The writer writes batches:
# a decode step of a 30-layer model indexes ~1000 entries, and one line per batch costs far less
# than a formatted object per entry (and 40% fewer bytes, most of a small-tensor dump's size).
class IndexRow(NamedTuple):
    """One entry as an index line stores it: a positional row of ``ROW_FIELDS`` (the ``Entry``
    fields without ``rank``, which the line holds once). The capture builds these, the background
    writer passes them on (filling in ``key`` and ``stats``), and ``index_line`` encodes them.

    The capture builds them on its hot path as ``new_row(IndexRow, (step, name, ...))``: a tuple
    display turned into a row by ``tuple.__new__`` in C. ``IndexRow(...)`` gives the same row
    through the generated Python ``__new__``, twice the cost (~160 against ~340 ns measured);
    with a thousand rows a decode step that difference is a visible share of a dump's overhead.
    """

    step: int
    name: str
    kind: str
    index: str
    level: str
    order: int
    dtype: str | None
    shape: tuple[int, ...] | None
    module_type: str | None
    stats: list[float] | dict[str, float] | None  # a list in STAT_KEYS order (a dict: a partial set)
    has_data: bool
    value: Any  # a non-tensor input's JSON value (None, bool, int, float, short str)
    pytype: str | None
    key: str  # "<data file>:<tensor key>" once written; the tensor key before (see the writer)
    extra: dict[str, Any]

    @classmethod
    def of(cls, e: Entry) -> IndexRow:
        """The row of an ``Entry`` (statistics with every STAT_KEYS key become a list)."""
        st = e.stats
        if type(st) is dict and tuple(st) == STAT_KEYS:
            st = list(st.values())
        return new_row(cls, (e.step, e.name, e.kind, e.index, e.level, e.order, e.dtype, e.shape,
                             e.module_type, st, e.has_data, e.value, e.pytype, e.key, e.extra))

    def with_key(self, key: str) -> IndexRow:
        return new_row(IndexRow, (*self[:_KEY_AT], key, *self[_KEY_AT + 1:]))

    def with_stats(self, stats: list[float]) -> IndexRow:
        return new_row(IndexRow, (*self[:_STATS_AT], stats, *self[_STATS_AT + 1:]))


new_row = tuple.__new__  # new_row(IndexRow, (...)): see IndexRow's docstring
ROW_FIELDS: tuple[str, ...] = IndexRow._fields
_STATS_AT = ROW_FIELDS.index("stats")
_VALUE_AT = ROW_FIELDS.index("value")
_KEY_AT = ROW_FIELDS.index("key")
_encode = json.JSONEncoder(allow_nan=True, check_circular=False, default=str,
                           separators=(",", ":")).encode


def index_line(rows: list[IndexRow], rank: int) -> bytes:
    """The index line(s) holding ``rows``, all of rank ``rank``: UTF-8 JSON, newline-ended.

    Rows go through orjson: formatting the statistics' floats is most of the encoding, and the
    standard library took ~3 us an entry (a fifth of a statistics-mode dump's overhead on a small
    model) where orjson takes ~0.2 us. orjson writes NaN and Infinity as ``null``, so rows holding
    a non-finite float (a statistic of a tensor that overflowed, a ``value`` of ``inf``) go into
    a second line written by the standard library, which keeps them as ``NaN``/``Infinity``.
    """
    fast: list[tuple] = []
    slow: list[IndexRow] = []
    for row in rows:
        st = row[_STATS_AT]
        if st is not None and not _finite_stats(st):
            slow.append(row)
            continue
        value = row[_VALUE_AT]
        if type(value) is float and not isfinite(value):
            slow.append(row)
            continue
        fast.append(tuple(row))  # (orjson writes plain tuples only; a subclass would go to ``default``)
    out = b""
    if fast:
        try:
            out = orjson.dumps({"rank": rank, "fields": ROW_FIELDS, "rows": fast}, default=str,
                               option=orjson.OPT_APPEND_NEWLINE)
        except TypeError:  # what orjson refuses (a non-str key in ``extra``): the standard library
            slow = fast + slow
    if slow:
        out += _encode({"rank": rank, "fields": ROW_FIELDS, "rows": slow}).encode() + b"\n"
    return out


def _finite_stats(st: Any) -> bool:
    """Is ``st`` a STAT_KEYS list whose floats are all finite? (A sum is finite only if every term
    is; a sum that overflows on finite terms is a false alarm, which only costs the slow path.)"""
    try:
        return type(st) is list and len(st) == len(STAT_KEYS) and isfinite(st[0] + st[1] + st[2] + st[3])
    except TypeError:  # a None or a string among them
        return False


def _loads(raw: bytes) -> Any:
    """One index line: orjson, or the standard library for lines holding NaN or Infinity."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def parse_index_line(obj: Any) -> list[Entry]:
    """The entries of one decoded index line, of either kind (see ``ROW_FIELDS``).

    Every field's type is checked (``TypeError``/``ValueError`` naming it), so a hand-edited or
    foreign line fails here, where the reader names its file and line, not in the code using it.
    """
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    if "rows" not in obj:
        return [_checked(Entry.from_json(obj))]
    fields, rank, rows = obj["fields"], obj["rank"], obj["rows"]
    if type(rank) is not int or not isinstance(rows, list) or not isinstance(fields, list) or \
            not all(type(f) is str for f in fields):
        raise TypeError("expected 'rank' an integer, 'fields' a list of names and 'rows' a list")
    out = []
    for row in rows:
        if type(row) is not list:
            raise TypeError(f"a row is a {type(row).__name__}, not a list")
        d = dict(zip(fields, row, strict=True))
        st = d.get("stats")
        if type(st) is list:
            d["stats"] = dict(zip(STAT_KEYS, st, strict=True))
        d["rank"] = rank
        out.append(_checked(Entry.from_json(d)))
    return out


_SCALARS = (type(None), bool, int, float, str)


def _checked(e: Entry) -> Entry:
    """``e`` when every field has its type (see ``Entry``), else a ``TypeError`` naming the field."""
    if type(e.step) is not int or type(e.order) is not int or type(e.rank) is not int:
        raise TypeError("step, rank and order must be integers")
    for name in ("name", "kind", "index", "level", "key"):
        if type(getattr(e, name)) is not str:
            raise TypeError(f"{name} must be a string")
    for name in ("dtype", "module_type", "pytype"):
        if not isinstance(getattr(e, name), (str, type(None))):
            raise TypeError(f"{name} must be a string or null")
    if type(e.has_data) is not bool or not isinstance(e.value, _SCALARS):
        raise TypeError("has_data must be true or false, value a JSON scalar")
    if e.shape is not None and not all(type(d) is int and d >= 0 for d in e.shape):
        raise TypeError("shape must be a list of sizes")
    if e.stats is not None and not (isinstance(e.stats, dict) and all(
            isinstance(v, (int, float, type(None))) for v in e.stats.values())):
        raise TypeError("stats must be numbers")
    if not isinstance(e.extra, dict) or not all(isinstance(v, _SCALARS) for v in e.extra.values()):
        raise TypeError("extra must be an object of JSON scalars")
    return e


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
    **{getattr(torch, n): code for n, code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                                               ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"))
       if hasattr(torch, n)},
}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write CPU tensors as one safetensors file, streaming each tensor's memory (no extra copy).

    The same bytes ``safetensors.torch.save_file`` writes, minus its per-tensor ``tobytes`` copy
    and shared-storage checks (our tensors are private copies).
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t in tensors.values():
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


class DumpDirWriter:
    """Writes one rank of one dump directory. Not thread-safe: one writer thread owns it."""

    def __init__(self, dump_dir: str | Path, rank: int = 0, meta: dict[str, Any] | None = None):
        self.dump_dir = Path(dump_dir)
        self.rank = rank
        self.rank_dir = self.dump_dir / f"rank{rank}"
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            if self.rank_dir.exists():  # a previous dump of this rank here: replace it, like msit
                for old in sorted(self.rank_dir.rglob("*"), reverse=True):
                    old.rmdir() if old.is_dir() else old.unlink()
            (self.rank_dir / "data").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"dump_path {str(self.dump_dir)!r}: cannot write a dump there: "
                            f"{exc.strerror or exc}") from exc
        self.meta = {"format": FORMAT, "version": VERSION, "complete": False,
                     "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **(meta or {})}
        self.rank_meta: dict[str, Any] = {"rank": rank, "complete": False, "truncated": False}
        self._index = open(self.rank_dir / "index.jsonl", "ab")  # noqa: SIM115
        self._order = open(self.rank_dir / "order.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._batch_no = 0
        self.bytes_written = 0
        self.entries_written = 0
        write_json_atomic(self.rank_dir / "rank.json", self.rank_meta)
        # rank 0 owns the top-level file; another rank writes it only when rank 0 has not (yet)
        if rank == 0 or not (self.dump_dir / META_FILE).exists():
            write_json_atomic(self.dump_dir / META_FILE, self.meta)

    def write_rows(self, tensors: dict[str, torch.Tensor], rows: list[IndexRow]) -> str:
        """Write tensors to the next data file, then append the rows that point at them.

        A row with data holds its tensor's key in ``tensors`` (several rows may share one); its
        index line holds ``rank{R}/data/NNNNNN.safetensors:<key>``. Returns that file's
        dump-relative path ("" when ``tensors`` is empty).
        """
        rel = ""
        if tensors:
            name = f"{self._batch_no:06d}.safetensors"
            self._batch_no += 1
            final = self.rank_dir / "data" / name
            tmp = final.with_name(name + ".tmp")
            write_safetensors(tmp, tensors)
            os.replace(tmp, final)  # complete on disk before any index line names it
            self.bytes_written += final.stat().st_size
            rel = f"rank{self.rank}/data/{name}"
            rows = [r.with_key(f"{rel}:{r.key}") if r.has_data else r for r in rows]
        self.append_rows(rows)
        return rel

    def write_batch(self, tensors: dict[str, torch.Tensor], entries: list[Entry]) -> str:
        """``write_rows`` for ``Entry`` objects (their ``key``: the tensor's key in ``tensors``)."""
        return self.write_rows(tensors, [IndexRow.of(e) for e in entries])

    def append_rows(self, rows: list[IndexRow]) -> None:
        """Append index lines: rows without data, or whose data is already on disk."""
        if not rows:
            return
        self._index.write(index_line(rows, self.rank))
        self._index.flush()
        self.entries_written += len(rows)

    def append_entries(self, entries: list[Entry]) -> None:
        """``append_rows`` for ``Entry`` objects."""
        self.append_rows([IndexRow.of(e) for e in entries])

    def append_order(self, step: int, order: list[str]) -> None:
        """Record the execution order of modules and APIs of one step."""
        self._order.write(json.dumps({"step": step, "order": order}) + "\n")
        self._order.flush()

    def write_json(self, name: str, obj: Any) -> None:
        """A top-level JSON file (env.json, topology.json), atomically."""
        write_json_atomic(self.dump_dir / name, obj)

    def update_rank_meta(self, **fields: Any) -> None:
        self.rank_meta.update(fields)
        write_json_atomic(self.rank_dir / "rank.json", self.rank_meta)

    def close(self, complete: bool = True, rank_meta: dict[str, Any] | None = None, **meta: Any) -> None:
        """Close the files; mark the dump complete only when asked (a clean close). ``rank_meta``
        goes into rank.json, ``meta`` into llmflow_dump.json."""
        self._index.close()
        self._order.close()
        self.rank_meta.update(rank_meta or {}, complete=complete, bytes=self.bytes_written,
                              entries=self.entries_written)
        write_json_atomic(self.rank_dir / "rank.json", self.rank_meta)
        if self.rank == 0 or not (self.dump_dir / META_FILE).exists():
            self.meta.update(meta, complete=complete)
            write_json_atomic(self.dump_dir / META_FILE, self.meta)


def _share_repeat_stats(entries: list[Entry]) -> None:
    """Give each statistics-mode repeat the statistics (and CRC) of the entry it repeats.

    A tensor passed on unchanged (a layer's output is the next layer's input; q/k/v_proj share
    one input) is captured once per step; its later appearances are rows with the first
    capture's ``key`` and no statistics of their own, which halves the floats the writer formats
    on a decoder model. Entries with data share the first capture's bytes the same way.
    """
    first: dict[str, Entry] = {}
    repeats: list[Entry] = []
    for e in entries:
        if e.dtype is None or e.has_data or not e.key:
            continue
        if e.stats is not None:
            first[e.key] = e
        else:
            repeats.append(e)
    for e in repeats:
        src = first.get(e.key)
        if src is not None:  # (None: its first capture was on a torn last line)
            e.stats = dict(src.stats)  # type: ignore[arg-type]
            if "crc32" in src.extra:
                e.extra["crc32"] = src.extra["crc32"]


class LlmflowDumpReader(DumpReader):
    """Reads an llmflow dump with ``json`` and ``safetensors`` only (never pickle).

    Entries whose data file is missing or unusable (truncated, not a regular file, without the
    entry's tensor) are left out of ``entries()``; ``problems()`` names each such file, with the
    rest of what makes the dump less than whole (see ``llmflow_check``).
    """

    format = "llmflow"

    def __init__(self, path: str | Path):
        p = Path(path)
        super().__init__(p.parent if p.name == META_FILE else p)
        self._entries: list[Entry] | None = None
        self._index_problems: list[str] = []
        self._handles: dict[str, Any] = {}
        meta = self._read_json(self.path / META_FILE)  # a damaged manifest fails here, named
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise DumpFormatError(f"{self.path / META_FILE}: not an llmflow dump manifest "
                                  f"(expected a JSON object with \"format\": \"{FORMAT}\")")

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_entries": None, "_index_problems": [], "_handles": {}}

    @classmethod
    def detect(cls, path: Path) -> bool:
        p = Path(path)
        meta = p if p.name == META_FILE else p / META_FILE
        if not meta.exists():
            return False
        # the file's name claims the dump unless it names another format: a damaged manifest
        # (or one that is not a regular file) then gets an error naming it, not "not a dump of
        # any known format"
        try:
            data = read_json(meta, limit=MAX_META_BYTES)
        except DumpFormatError:
            return True
        return not isinstance(data, dict) or data.get("format", FORMAT) == FORMAT

    def meta(self) -> dict[str, Any]:
        """llmflow_dump.json, with ``complete`` true only when every rank closed cleanly."""
        meta = self._read_json(self.path / META_FILE) or {}
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise DumpFormatError(f"{self.path / META_FILE}: not an llmflow dump")
        ranks = [r if isinstance(r := self._read_json(d / "rank.json"), dict) else {}
                 for d in self._rank_dirs()]
        meta["ranks"] = ranks
        meta["complete"] = bool(meta.get("complete")) and all(r.get("complete") for r in ranks)
        meta["truncated"] = any(r.get("truncated") for r in ranks)
        return meta

    def problems(self) -> list[str]:
        """Why this dump is not whole, one line each (empty when it is): see ``llmflow_check``."""
        self.entries()  # reading the index checks the data files it names
        out: list[str] = []
        meta = self._read_json(self.path / META_FILE) or {}
        rank_dirs = self._rank_dirs()
        if not rank_dirs:
            out.append(f"{self.path}: no rank folders: nothing was written")
        for rank_dir in rank_dirs:
            try:
                rank_meta = self._read_json(rank_dir / "rank.json")
            except DumpFormatError as exc:
                out.append(str(exc))
                rank_meta = {"complete": True}  # (reported just now, not twice)
            out += rank_problems(rank_dir, rank_meta)
        if not meta.get("complete") and not any("complete: false" in line for line in out):
            out.append(f"{self.path / META_FILE}: complete: false (the writer never closed this dump)")
        return out + self._index_problems

    def _rank_dirs(self) -> list[Path]:
        found = [(int(m.group(1)), d) for d in self.path.iterdir()
                 if d.is_dir() and (m := _RANK_DIR.match(d.name))]
        return [d for _, d in sorted(found)]

    def entries(self) -> list[Entry]:
        if self._entries is None:
            out: list[Entry] = []
            problems: list[str] = []
            for rank_dir in self._rank_dirs():
                out.extend(self._read_index(rank_dir, problems))
            out.sort(key=lambda e: (e.rank, e.step, e.order))
            self._entries, self._index_problems = out, problems
        return self._entries

    def _read_index(self, rank_dir: Path, problems: list[str]) -> list[Entry]:
        index = rank_dir / "index.jsonl"
        if not index.exists():
            problems.append(f"{index}: missing: this rank indexed nothing")
            return []
        if regular_file(index) is None:
            problems.append(f"{index}: not a regular file: left unread")
            return []
        with open_regular(index) as f:
            lines = f.read().split(b"\n")
        out: list[Entry] = []
        files: dict[str, tuple[frozenset[str], str | None]] = {}  # data file -> (keys, why unusable)
        left_out: dict[str, list[Entry]] = {}
        for no, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                batch = parse_index_line(_loads(raw))
            except RecursionError:
                raise DumpFormatError(f"{index}:{no}: index line nested too deeply to read") from None
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                if no >= len(lines) - 1 and not raw.endswith(b"}"):  # the torn last line of a killed writer
                    problems.append(f"{index}:{no}: a torn last line (the writer was killed while "
                                    "writing it): its entries are lost")
                    break
                raise DumpFormatError(f"{index}:{no}: corrupt index line ({exc})") from exc
            for entry in batch:
                if entry.has_data:
                    file_rel, _, key = entry.key.rpartition(":")
                    if file_rel not in files:
                        files[file_rel] = safetensors_keys(self._data_path(file_rel, index, no))
                    keys, why = files[file_rel]
                    if why is not None or key not in keys:
                        left_out.setdefault(file_rel, []).append(entry)
                        continue  # it cannot be loaded: left out, and said so in problems()
                out.append(entry)
        for file_rel, lost in left_out.items():
            why = files[file_rel][1] or "does not hold the tensors the index names"
            steps = sorted({e.step for e in lost})
            problems.append(f"{self.path / file_rel}: {why}; {len(lost)} entries of step"
                            f"{'s' if len(steps) > 1 else ''} {_span(steps)} point at it (left out)")
        _share_repeat_stats(out)
        return out

    def _data_path(self, file_rel: str, where: Path | str = "", line: int = 0) -> Path:
        """The data file of a key, refusing anything that is not a safetensors file in the dump."""
        path = (self.path / file_rel).resolve()
        root = self.path.resolve()
        if not file_rel.endswith(".safetensors") or root not in path.parents:
            raise DumpFormatError(f"{where}:{line}: data file {file_rel!r} is not a safetensors "
                                  "file inside the dump")
        return path

    def load(self, entry: Entry) -> torch.Tensor:
        if not entry.has_data:
            raise DumpFormatError(f"{self.path}: entry {entry.name} {entry.kind} {entry.index} "
                                  f"(step {entry.step}) has no tensor data ({self._why(entry)})")
        file_rel, _, key = entry.key.rpartition(":")
        handle = self._handles.get(file_rel)
        if handle is None:
            from safetensors import SafetensorError, safe_open

            path = self._data_path(file_rel, self.path / f"rank{entry.rank}" / "index.jsonl")
            if regular_file(path) is None:  # (safe_open would block on a FIFO)
                raise DumpFormatError(f"{path}: missing or not a regular file")
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise DumpFormatError(f"{path}: unreadable safetensors file ({exc})") from exc
            if len(self._handles) > 64:  # bound the open files on huge dumps
                self._handles.clear()
            self._handles[file_rel] = handle
        try:
            return handle.get_tensor(key)
        except Exception as exc:  # safetensors raises its own error types for bad keys
            raise DumpFormatError(f"{self.path / file_rel}: no tensor {key!r} ({exc})") from exc

    @staticmethod
    def _why(entry: Entry) -> str:
        return "statistics-only dump" if entry.dtype is not None else f"a {entry.pytype} value"

    def topology(self) -> dict[str, Any] | None:
        topo = self._read_json(self.path / TOPOLOGY_FILE)
        if topo is None:
            return None
        if not isinstance(topo, dict):
            raise DumpFormatError(f"{self.path / TOPOLOGY_FILE}: not a JSON object")
        if not topo.get("execution"):  # a killed writer never merged order.jsonl: read it here
            execution: dict[str, dict[str, list[str]]] = {}
            for rank_dir in self._rank_dirs():
                rank = rank_dir.name[4:]
                path = rank_dir / "order.jsonl"
                text = read_text(path) if regular_file(path) is not None else ""
                for raw in text.splitlines():
                    try:
                        rec = json.loads(raw)
                        step, order = rec["step"], rec["order"]
                    except (ValueError, TypeError, KeyError, RecursionError):
                        break  # (a torn last line)
                    if isinstance(order, list) and all(type(n) is str for n in order):
                        execution.setdefault(rank, {})[str(step)] = order
            topo["execution"] = execution
        return topo

    def env(self) -> dict[str, Any] | None:
        return self._read_json(self.path / ENV_FILE)

    @staticmethod
    def _read_json(path: Path) -> Any:
        """A JSON file of the dump (None when absent): bounded in size and nesting, never opened
        when it is not a regular file, every failure a one-line ``DumpFormatError`` naming it."""
        if not path.exists():
            return None
        return read_json(path, limit=MAX_META_BYTES, max_depth=MAX_JSON_DEPTH)


def _span(steps: list[int]) -> str:
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
