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

This module is the format and its writing side: ``IndexRow`` and ``index_line`` (how an entry is
encoded), ``DumpDirWriter`` (the synchronous on-disk writer; ``llmflow.dump.writer`` drives it
from a background thread). ``llmflow_reader.LlmflowDumpReader`` reads it with nothing but
``json`` and ``safetensors``; it is importable from here too (``llmflow_dump.LlmflowDumpReader``,
the ``llmflow`` format's registered reader). The names both sides use (the format's tag, version
and top-level files) are in ``llmflow_layout``.
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

from llmflow.atomic import atomic_write_json
from llmflow.dtypes import SAFETENSORS_CODES, torch_dtype
from llmflow.errors import DumpFormatError, UserError
from llmflow.formats.base import STAT_KEYS, Entry
from llmflow.formats.llmflow_layout import ENV_FILE, FORMAT, META_FILE, TOPOLOGY_FILE, VERSION

# the format's reader, importable from here (``llmflow_dump.LlmflowDumpReader``: the ``llmflow``
# format's registered reader, pyproject.toml); the reader imports nothing from this module
from llmflow.formats.llmflow_reader import LlmflowDumpReader  # noqa: F401


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
    A row nothing reads back by field (an index row and nothing more) it leaves a plain tuple
    in this field order, which ``index_line`` encodes as it is.
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
    # STAT_KEYS order: a list (a tuple from dump/capture.cpp; a dict: a partial set)
    stats: list[float] | dict[str, float] | None
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
_DTYPE_AT, _SHAPE_AT, _HAS_DATA_AT = (ROW_FIELDS.index(f) for f in ("dtype", "shape", "has_data"))
_json_string = json.encoder.encode_basestring_ascii  # a str as JSON text, as json.dumps writes keys
_encode = json.JSONEncoder(allow_nan=True, check_circular=False, default=str,
                           separators=(",", ":")).encode


def index_line(rows: list[IndexRow] | list[tuple], rank: int, finite_rows: list[tuple] | tuple = ()) -> bytes:
    """The index line(s) holding ``rows`` and ``finite_rows`` (IndexRows, or plain tuples in its
    field order), all of rank ``rank``: UTF-8 JSON, newline-ended.

    Rows go through orjson: formatting the statistics' floats is most of the encoding, and the
    standard library took ~3 us an entry (a fifth of a statistics-mode dump's overhead on a small
    model) where orjson takes ~0.2 us. orjson writes NaN and Infinity as ``null``, so rows holding
    a non-finite float (a statistic of a tensor that overflowed, a ``value`` of ``inf``) go into
    a second line written by the standard library, which keeps them as ``NaN``/``Infinity``.
    ``finite_rows``: rows the caller knows to be plain tuples whose floats are all finite (the
    capture checks each row it makes), which go to orjson as they are, first, without the look at
    each row that finds the others (~0.4 us a row, ~2 ms of an API dump's decode step).
    """
    fast, slow = _finite_apart(rows)
    if finite_rows:
        try:  # (no ``default``: anything orjson does not write itself, an IndexRow included, raises)
            out = orjson.dumps({"rank": rank, "fields": ROW_FIELDS,
                                "rows": [*finite_rows, *fast] if fast else finite_rows},
                               option=orjson.OPT_APPEND_NEWLINE)
        except TypeError:  # the look at each row sorts it out
            return index_line([*finite_rows, *rows], rank)
    else:
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


def _finite_apart(rows: list[IndexRow] | list[tuple]) -> tuple[list[tuple], list[IndexRow | tuple]]:
    """``rows`` split into those orjson writes as they are (plain tuples whose statistics and value
    are finite) and those holding NaN or Infinity."""
    fast: list[tuple] = []
    slow: list[IndexRow | tuple] = []
    for row in rows:
        if finite_row(row):
            # orjson writes plain tuples only (an IndexRow would go to ``default``); a slice of a
            # tuple subclass is a plain tuple, made in C (~55 ns, tuple(row) ~105 ns)
            fast.append(row if type(row) is tuple else row[:])
        else:
            slow.append(row)
    return fast, slow


def finite_row(row: IndexRow | tuple) -> bool:
    """Are ``row``'s statistics (where it has them) and its value (where a float) finite? The
    test the capture applies to each row it makes (capture.cpp's callers of ``emit`` too)."""
    st, value = row[_STATS_AT], row[_VALUE_AT]
    return (st is None or _finite_stats(st)) and (type(value) is not float or isfinite(value))


def _finite_stats(st: Any) -> bool:
    """Is ``st`` a STAT_KEYS list (or tuple: the compiled capture's) whose floats are all finite?
    (A sum is finite only if every term is; a sum that overflows on finite terms is a false
    alarm, which only costs the slow path.)"""
    try:
        return ((type(st) is list or type(st) is tuple) and len(st) == len(STAT_KEYS)
                and isfinite(st[0] + st[1] + st[2] + st[3]))
    except TypeError:  # a None or a string among them
        return False


#: the safetensors code of every dtype this torch has (the newer ones are missing from older torch)
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    dtype: code for name, code in SAFETENSORS_CODES.items() if (dtype := torch_dtype(name)) is not None}


# the data files' write buffer: a decode step's tensors are mostly a few KiB each, and the
# default 8 KiB buffer makes a system call of every second or third of them (20,000 writes of 2.3
# KiB: 57 ms against 20 ms on a 2-vCPU VM; a SmolLM2 tensor dump, 30 interleaved turns: ~1%,
# within the turns' spread)
_WRITE_BUFFER = 1 << 20


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor | bytes | memoryview],
                      layouts: dict[str, tuple[str, tuple[int, ...]]] | None = None) -> None:
    """Write CPU tensors as one safetensors file, streaming each tensor's memory (no extra copy).

    The same bytes ``safetensors.torch.save_file`` writes, minus its per-tensor ``tobytes`` copy
    and shared-storage checks (our tensors are private copies). A value may also be ``bytes``: a
    contiguous tensor's memory as the capture copied it (``dump.copies.host_copy``), or a 1-D
    byte ``memoryview`` of it (``dump.copies.to_host``), whose dtype name and shape
    ``layouts[key]`` gives.
    """
    # The header is the text ``json.dumps(header, separators=(",", ":"))`` gives, put together
    # from strings: a dict and two lists per tensor would be tens of thousands of objects for the
    # garbage collector at once, enough to set off a full collection of the process's objects
    entries = ['"__metadata__":{"format":"pt"}']
    offset = 0
    for key, t in tensors.items():
        if type(t) is bytes or type(t) is memoryview:
            dtype, shape = layouts[key]  # type: ignore[index]
            code, n = SAFETENSORS_CODES[dtype], len(t)
        else:
            code, shape, n = SAFETENSORS_DTYPES[t.dtype], t.shape, t.numel() * t.element_size()
        entries.append(f'{_json_string(key)}:{{"dtype":"{code}","shape":[{",".join(map(str, shape))}],'
                       f'"data_offsets":[{offset},{offset + n}]}}')
        offset += n
    head = ("{" + ",".join(entries) + "}").encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb", buffering=_WRITE_BUFFER) as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t in tensors.values():
            if type(t) is bytes or type(t) is memoryview:
                f.write(t)
            elif t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


# The files a dump writes into its rank{R} folder (the temporaries of its renames included). A
# new dump of the same rank into the same folder replaces a previous llmflow dump, as msit does, by
# removing exactly these; anything else found there is someone else's and stays, and these names
# in a folder no llmflow dump wrote are refused rather than removed or overwritten.
RANK_FILES = ("index.jsonl", "order.jsonl", "rank.json")
_OWN_TEMPORARY = re.compile(r"\.rank\.json\..+\.tmp")  # atomic_write_json's, left by a kill
_DATA_FILE = re.compile(r"\d{6}\.safetensors(\.tmp)?")
TOP_FILES = (META_FILE, ENV_FILE, TOPOLOGY_FILE)  # a dump's files beside its rank folders


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None (missing, unreadable, not an object)."""
    try:  # the reader's bounded, FIFO-safe read
        value = LlmflowDumpReader._read_json(path)
    except DumpFormatError:
        return None
    return value if isinstance(value, dict) else None


def is_llmflow_dump(dump_dir: Path) -> bool:
    """Does ``dump_dir`` hold an llmflow dump's manifest (a file, not a link to one)?"""
    manifest = dump_dir / META_FILE
    if manifest.is_symlink():
        return False
    meta = _json_object(manifest)
    return meta is not None and meta.get("format") == FORMAT


def _written_by_llmflow(dump_dir: Path, rank_dir: Path, rank: int) -> bool:
    """Is ``rank_dir`` rank ``rank`` of an llmflow dump (its manifest and its rank.json say so)?"""
    rank_meta = _json_object(rank_dir / "rank.json")
    return is_llmflow_dump(dump_dir) and rank_meta is not None and rank_meta.get("rank") == rank


def _refuse_foreign_top_files(dump_dir: Path) -> None:
    """A dump replaces the top-level files (manifest, env.json, topology.json) of an earlier
    llmflow dump in ``dump_dir`` only: where no llmflow manifest is, files at those names are
    someone else's (a user's env.json, another tool's llmflow_dump.json) and are refused. Beside
    an llmflow manifest they are that dump's, replaced with it as msit replaces its dump."""
    present = [dump_dir / name for name in TOP_FILES if os.path.lexists(dump_dir / name)]
    if present and not is_llmflow_dump(dump_dir):
        raise UserError(f"{present[0]}: not written by an llmflow dump ({dump_dir / META_FILE} does not "
                        "say so); a dump there would replace it: dump elsewhere or move it away")


def _clear_previous_rank(dump_dir: Path, rank_dir: Path, rank: int) -> None:
    """Remove what a previous llmflow dump wrote into ``rank_dir`` and nothing else. A link in
    place of the folder or its ``data`` folder is refused (the dump would write, and clear, its
    target), and so is a folder holding a dump's file names that no llmflow dump wrote."""
    for folder in (rank_dir, rank_dir / "data"):
        if folder.is_symlink():
            raise UserError(f"{folder}: is a symbolic link; a dump writes only into a folder of its own "
                            f"(move the link away or dump elsewhere)")
    if not rank_dir.is_dir():
        return
    data = rank_dir / "data"
    ours = [path for path in rank_dir.iterdir()
            if (path.name in RANK_FILES or _OWN_TEMPORARY.fullmatch(path.name)) and not path.is_dir()]
    if data.is_dir():
        ours += [path for path in data.iterdir() if _DATA_FILE.fullmatch(path.name) and not path.is_dir()]
    if not ours:
        return
    if not _written_by_llmflow(dump_dir, rank_dir, rank):
        raise UserError(f"{ours[0]}: not written by an llmflow dump ({dump_dir / META_FILE} and "
                        f"{rank_dir / 'rank.json'} do not say so); a dump there would replace it: "
                        "dump elsewhere or move it away")
    for path in ours:
        path.unlink()


class DumpDirWriter:
    """Writes one rank of one dump directory. Not thread-safe: one writer thread owns it."""

    def __init__(self, dump_dir: str | Path, rank: int = 0, meta: dict[str, Any] | None = None):
        self.dump_dir = Path(dump_dir)
        self.rank = rank
        self.rank_dir = self.dump_dir / f"rank{rank}"
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            _refuse_foreign_top_files(self.dump_dir)
            _clear_previous_rank(self.dump_dir, self.rank_dir, rank)
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
        atomic_write_json(self.rank_dir / "rank.json", self.rank_meta)
        # rank 0 owns the top-level file; another rank writes it only when rank 0 has not (yet)
        if rank == 0 or not (self.dump_dir / META_FILE).exists():
            atomic_write_json(self.dump_dir / META_FILE, self.meta)

    def write_rows(self, tensors: dict[str, torch.Tensor | bytes | memoryview],
                   rows: list[IndexRow] | list[tuple], finite: bool = False) -> str:
        """Write tensors to the next data file, then append the rows that point at them.

        ``rows``: IndexRows, or plain tuples in IndexRow's field order (what the dump's writer
        holds while a data file fills, see ``llmflow.dump.writer``); ``finite``: see
        ``index_line``.

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
            # (the dtype and shape of a tensor the capture copied as bytes: its rows have them)
            layouts = {r[_KEY_AT]: (r[_DTYPE_AT], r[_SHAPE_AT]) for r in rows if r[_HAS_DATA_AT]}
            write_safetensors(tmp, tensors, layouts)
            os.replace(tmp, final)  # complete on disk before any index line names it
            self.bytes_written += final.stat().st_size
            rel = f"rank{self.rank}/data/{name}"
            # plain tuples, not IndexRows: a second of a tensor dump is tens of thousands of rows,
            # and the garbage collector untracks plain tuples of plain values (a tuple subclass
            # would stay tracked, outlive the young collections this list sets off and count
            # towards a full collection of every object in the process)
            rows = [(*r[:_KEY_AT], f"{rel}:{r[_KEY_AT]}", *r[_KEY_AT + 1:]) if r[_HAS_DATA_AT] else r
                    for r in rows]
        if finite:
            self.append_rows([], finite_rows=rows)
        else:
            self.append_rows(rows)
        return rel

    def write_batch(self, tensors: dict[str, torch.Tensor], entries: list[Entry]) -> str:
        """``write_rows`` for ``Entry`` objects (their ``key``: the tensor's key in ``tensors``)."""
        return self.write_rows(tensors, [IndexRow.of(e) for e in entries])

    def append_rows(self, rows: list[IndexRow] | list[tuple], finite_rows: list[tuple] | tuple = ()) -> None:
        """Append index lines: rows without data, or whose data is already on disk
        (``finite_rows``: see ``index_line``)."""
        if not rows and not finite_rows:
            return
        self._index.write(index_line(rows, self.rank, finite_rows))
        self._index.flush()
        self.entries_written += len(rows) + len(finite_rows)

    def append_order(self, step: int, order: list[str]) -> None:
        """Record the execution order of modules and APIs of one step (orjson: an API dump's
        step names ~2,400 calls, which the standard library took ~0.5 ms to encode)."""
        line = orjson.dumps({"step": step, "order": order}, option=orjson.OPT_APPEND_NEWLINE)
        self._order.write(line.decode())
        self._order.flush()

    def write_json(self, name: str, obj: Any) -> None:
        """A top-level JSON file (env.json, topology.json), atomically."""
        atomic_write_json(self.dump_dir / name, obj)

    def update_rank_meta(self, **fields: Any) -> None:
        self.rank_meta.update(fields)
        atomic_write_json(self.rank_dir / "rank.json", self.rank_meta)

    def close(self, complete: bool = True, rank_meta: dict[str, Any] | None = None, **meta: Any) -> None:
        """Close the files; mark the dump complete only when asked (a clean close). ``rank_meta``
        goes into rank.json, ``meta`` into llmflow_dump.json."""
        self._index.close()
        self._order.close()
        self.rank_meta.update(rank_meta or {}, complete=complete, bytes=self.bytes_written,
                              entries=self.entries_written)
        atomic_write_json(self.rank_dir / "rank.json", self.rank_meta)
        if self.rank == 0 or not (self.dump_dir / META_FILE).exists():
            self.meta.update(meta, complete=complete)
            atomic_write_json(self.dump_dir / META_FILE, self.meta)
