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
import operator
import os
import re
import time
from math import isfinite
from pathlib import Path
from typing import Any

import orjson
import torch

from llmflow.errors import DumpFormatError, UserError
from llmflow.formats.base import STAT_KEYS, DumpReader, Entry

FORMAT = "llmflow-dump"
# 2: index lines hold batches of rows (version 1: one entry a line, still read);
# 3: a statistics-mode repeat of a tensor holds no statistics of its own (``_share_repeat_stats``)
VERSION = 3
META_FILE = "llmflow_dump.json"
ENV_FILE = "env.json"
TOPOLOGY_FILE = "topology.json"
_RANK_DIR = re.compile(r"^rank(\d+)$")


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
ROW_FIELDS = ("step", "name", "kind", "index", "level", "order", "dtype", "shape", "module_type",
              "stats", "has_data", "value", "pytype", "key", "extra")
_row_of = operator.attrgetter(*ROW_FIELDS)
_STATS_AT = ROW_FIELDS.index("stats")
_VALUE_AT = ROW_FIELDS.index("value")
_encode = json.JSONEncoder(allow_nan=True, check_circular=False, default=str,
                           separators=(",", ":")).encode


def index_line(entries: list[Entry | tuple], rank: int) -> bytes:
    """The index line(s) holding ``entries``, all of rank ``rank``: UTF-8 JSON, newline-ended.
    An entry is an ``Entry`` or already a row (a tuple in ``ROW_FIELDS`` order).

    Rows go through orjson: formatting the statistics' floats is most of the encoding, and the
    standard library took ~3 us an entry (a fifth of a statistics-mode dump's overhead on a small
    model) where orjson takes ~0.2 us. orjson writes NaN and Infinity as ``null``, so rows holding
    a non-finite float (a statistic of a tensor that overflowed, a ``value`` of ``inf``) go into
    a second line written by the standard library, which keeps them as ``NaN``/``Infinity``.
    """
    fast: list[tuple] = []
    slow: list[tuple] = []
    for e in entries:
        row = e if type(e) is tuple else _row_of(e)
        st = row[_STATS_AT]
        if st is not None:
            if type(st) is dict and tuple(st) == STAT_KEYS:  # (the writer thread hands lists already)
                st = list(st.values())
                row = (*row[:_STATS_AT], st, *row[_STATS_AT + 1:])
            if not _finite_stats(st):
                slow.append(row)
                continue
        value = row[_VALUE_AT]
        if type(value) is float and not isfinite(value):
            slow.append(row)
            continue
        fast.append(row)
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
    """The entries of one decoded index line, of either kind (see ``ROW_FIELDS``)."""
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    if "rows" not in obj:
        return [Entry.from_json(obj)]
    fields, rank = obj["fields"], obj["rank"]
    out = []
    for row in obj["rows"]:
        d = dict(zip(fields, row, strict=True))
        st = d.get("stats")
        if isinstance(st, list):
            d["stats"] = dict(zip(STAT_KEYS, st, strict=True))
        d["rank"] = rank
        out.append(Entry.from_json(d))
    return out


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

    def write_batch(self, tensors: dict[str, torch.Tensor], entries: list[Entry]) -> str:
        """Write tensors to the next data file, then append the entries that point at them.

        ``entry.key`` must hold the tensor's key in ``tensors`` (several entries may share one);
        it is rewritten to ``rank{R}/data/NNNNNN.safetensors:<key>``. Returns that file's
        dump-relative path.
        """
        rel = ""
        if tensors:
            name = f"{self._batch_no:06d}.safetensors"
            self._batch_no += 1
            final = self.rank_dir / "data" / name
            tmp = final.with_name(name + ".tmp")
            write_safetensors(tmp, tensors)
            os.replace(tmp, final)
            self.bytes_written += final.stat().st_size
            rel = f"rank{self.rank}/data/{name}"
            for e in entries:
                if e.has_data:
                    e.key = f"{rel}:{e.key}"
        self.append_entries(entries)
        return rel

    def append_entries(self, entries: list[Entry | tuple]) -> None:
        """Append index lines (entries without data, or whose data is already on disk; entries
        or rows, see ``index_line``)."""
        if not entries:
            return
        self._index.write(index_line(entries, self.rank))
        self._index.flush()
        self.entries_written += len(entries)

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

    def close(self, complete: bool = True, **meta: Any) -> None:
        """Close the files; mark the dump complete only when asked (a clean close)."""
        self._index.close()
        self._order.close()
        self.rank_meta.update(complete=complete, bytes=self.bytes_written,
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
    """Reads an llmflow dump with ``json`` and ``safetensors`` only (never pickle)."""

    format = "llmflow"

    def __init__(self, path: str | Path):
        p = Path(path)
        super().__init__(p.parent if p.name == META_FILE else p)
        self._entries: list[Entry] | None = None
        self._handles: dict[str, Any] = {}
        meta = self._read_json(self.path / META_FILE)  # a damaged manifest fails here, named
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise DumpFormatError(f"{self.path / META_FILE}: not an llmflow dump manifest "
                                  f"(expected a JSON object with \"format\": \"{FORMAT}\")")

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_entries": None, "_handles": {}}

    @classmethod
    def detect(cls, path: Path) -> bool:
        p = Path(path)
        meta = p if p.name == META_FILE else p / META_FILE
        if not meta.is_file():
            return False
        # the file's name claims the dump unless it names another format: a damaged manifest
        # then gets an error naming it, not "not a dump of any known format"
        try:
            data = json.loads(meta.read_text())
        except (OSError, ValueError):
            return True
        return not isinstance(data, dict) or data.get("format", FORMAT) == FORMAT

    def meta(self) -> dict[str, Any]:
        """llmflow_dump.json, with ``complete`` true only when every rank closed cleanly."""
        meta = self._read_json(self.path / META_FILE) or {}
        if meta.get("format") != FORMAT:
            raise DumpFormatError(f"{self.path / META_FILE}: not an llmflow dump")
        ranks = [self._read_json(d / "rank.json") or {} for d in self._rank_dirs()]
        meta["ranks"] = ranks
        meta["complete"] = bool(meta.get("complete")) and all(r.get("complete") for r in ranks)
        meta["truncated"] = any(r.get("truncated") for r in ranks)
        return meta

    def _rank_dirs(self) -> list[Path]:
        found = [(int(m.group(1)), d) for d in self.path.iterdir()
                 if d.is_dir() and (m := _RANK_DIR.match(d.name))]
        return [d for _, d in sorted(found)]

    def entries(self) -> list[Entry]:
        if self._entries is None:
            out: list[Entry] = []
            for rank_dir in self._rank_dirs():
                out.extend(self._read_index(rank_dir))
            out.sort(key=lambda e: (e.rank, e.step, e.order))
            self._entries = out
        return self._entries

    def _read_index(self, rank_dir: Path) -> list[Entry]:
        index = rank_dir / "index.jsonl"
        if not index.is_file():
            return []
        lines = index.read_bytes().split(b"\n")
        out: list[Entry] = []
        present: dict[str, bool] = {}
        for no, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                batch = parse_index_line(_loads(raw))
            except (ValueError, TypeError, KeyError) as exc:
                if no >= len(lines) - 1:  # the torn last line of a killed writer
                    break
                raise DumpFormatError(f"{index}:{no}: corrupt index line ({exc})") from exc
            for entry in batch:
                if entry.has_data:
                    file_rel = entry.key.rpartition(":")[0]
                    if file_rel not in present:
                        present[file_rel] = self._data_path(file_rel, index, no).is_file()
                    if not present[file_rel]:
                        continue  # its data file is gone: the entry cannot be loaded, leave it out
                out.append(entry)
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
        if not topo.get("execution"):  # a killed writer never merged order.jsonl: read it here
            execution: dict[str, dict[str, list[str]]] = {}
            for rank_dir in self._rank_dirs():
                rank = rank_dir.name[4:]
                path = rank_dir / "order.jsonl"
                for raw in path.read_text().splitlines() if path.is_file() else []:
                    try:
                        rec = json.loads(raw)
                    except ValueError:
                        break
                    execution.setdefault(rank, {})[str(rec["step"])] = rec["order"]
            topo["execution"] = execution
        return topo

    def env(self) -> dict[str, Any] | None:
        return self._read_json(self.path / ENV_FILE)

    @staticmethod
    def _read_json(path: Path) -> Any:
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise DumpFormatError(f"{path}: not valid JSON ({exc})") from exc
