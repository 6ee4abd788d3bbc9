"""Reads llmflow's own dump format (see ``llmflow_dump``) with ``json`` and ``safetensors`` only.

``parse_index_line`` decodes what ``llmflow_dump.index_line`` encodes, checking every field's type;
``LlmflowDumpReader`` is the format's ``DumpReader``: entries, lazy tensor loads, topology, env,
and ``problems()`` (see ``llmflow_check``).
"""

from __future__ import annotations

import json
import logging
import mmap
import re
from operator import attrgetter
from pathlib import Path
from typing import Any

import orjson
import torch

from llmflow.collector import collections_paused
from llmflow.dtypes import DTYPE_OF_SAFETENSORS_CODE, dtype_name
from llmflow.errors import DumpFormatError
from llmflow.formats._safe import read_json, read_text
from llmflow.formats.base import ENTRY_FIELDS, STAT_KEYS, DumpReader, Entry
from llmflow.formats.llmflow_check import rank_problems
from llmflow.formats.llmflow_layout import ENV_FILE, FORMAT, META_FILE, TOPOLOGY_FILE
from llmflow.regular_files import open_regular, regular_file
from llmflow.safetensors_files import SAFETENSORS_DTYPES, Stored, read_table

log = logging.getLogger("llmflow.formats")
_RANK_DIR = re.compile(r"^rank(\d+)$")
MAX_META_BYTES = 64 << 20  # llmflow_dump.json, rank.json, env.json, topology.json: small files
MAX_JSON_DEPTH = 100  # their nesting (a module tree: two levels a module, ~25 deep): deeper is refused


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
    if not ENTRY_FIELDS.issuperset(fields) or "rank" in fields:  # a hand-made or future line
        return [_checked(Entry.from_json({**_row(fields, row), "rank": rank})) for row in rows]
    out = []
    for row in rows:  # the writer's own lines: every field an Entry field, built without from_json
        d = _row(fields, row)
        d["rank"] = rank
        shape = d.get("shape")
        if type(shape) is list:
            d["shape"] = tuple(shape)
        out.append(_checked(Entry(**d)))
    return out


def _row(fields: list[str], row: Any) -> dict[str, Any]:
    if type(row) is not list:
        raise TypeError(f"a row is a {type(row).__name__}, not a list")
    d = dict(zip(fields, row, strict=True))
    st = d.get("stats")
    if type(st) is list:
        d["stats"] = dict(zip(STAT_KEYS, st, strict=True))
    return d


_SCALARS = (type(None), bool, int, float, str)
# the same checks as sets of exact types, tested in C: what JSON decodes is never a subclass
_SCALAR_TYPES, _STR_OR_NONE, _NUMBER_TYPES = frozenset(_SCALARS), frozenset({str, type(None)}), \
    frozenset({int, float, type(None)})
_INT = frozenset({int})


def _checked(e: Entry) -> Entry:
    """``e`` when every field has its type (see ``Entry``), else a ``TypeError`` naming the field."""
    stats, shape, extra = e.stats, e.shape, e.extra
    if type(e.step) is int and type(e.order) is int and type(e.rank) is int and type(e.name) is str \
            and type(e.kind) is str and type(e.index) is str and type(e.level) is str \
            and type(e.key) is str and type(e.dtype) in _STR_OR_NONE and type(e.module_type) in _STR_OR_NONE \
            and type(e.pytype) in _STR_OR_NONE and type(e.has_data) is bool \
            and type(e.value) in _SCALAR_TYPES \
            and (shape is None or (type(shape) is tuple and _INT.issuperset(map(type, shape))
                                   and min(shape, default=0) >= 0)) \
            and (stats is None or (type(stats) is dict
                                   and _NUMBER_TYPES.issuperset(map(type, stats.values())))) \
            and type(extra) is dict and _SCALAR_TYPES.issuperset(map(type, extra.values())):
        return e
    return _refused(e)


def _refused(e: Entry) -> Entry:
    """``_checked``'s slow path: the same checks one by one, to name the field that fails them."""
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
    return e  # (subclasses of the exact types pass the one-by-one checks)


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
        self._leftovers_said = False  # (rank folders of an earlier dump: warned about once)
        meta = self._read_json(self.path / META_FILE)  # a damaged manifest fails here, named
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise DumpFormatError(f"{self.path / META_FILE}: not an llmflow dump manifest "
                                  f"(expected a JSON object with \"format\": \"{FORMAT}\")")

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_entries": None, "_index_problems": [], "_handles": {},
                "_leftovers_said": True}

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
        world = self.world_size()
        present = {int(m.group(1)) for d in rank_dirs if (m := _RANK_DIR.match(d.name))}
        for rank in sorted(set(range(world or 0)) - present):
            out.append(f"{self.path / f'rank{rank}'}: missing: the dump's ranks record a world of {world}, "
                       f"and rank {rank}'s folder is not here (its tensors are lost)")
        if not meta.get("complete") and not any("complete: false" in line for line in out):
            out.append(f"{self.path / META_FILE}: complete: false (the writer never closed this dump)")
        lost = [e for e in self.entries() if e.extra.get("lost")]
        if lost:
            e = lost[0]
            out.append(f"{self.path}: {len(lost)} tensor {'entry has' if len(lost) == 1 else 'entries have'} "
                       "no values: changed in place after "
                       f"their capture, before the dump read them (first: {e.name} {e.kind} {e.index} at "
                       f"step {e.step}); dump again with LLMFLOW_DUMP_COPIES=always to copy every tensor")
        return out + self._index_problems

    def _rank_dirs(self) -> list[Path]:
        """This dump's rank folders, in rank order, without those an earlier dump of more ranks
        left in the folder (``_leftover_ranks``)."""
        found = sorted((int(m.group(1)), d) for d in self.path.iterdir()
                       if d.is_dir() and (m := _RANK_DIR.match(d.name)))
        leftovers = self._leftover_ranks(found)
        if leftovers and not self._leftovers_said:
            self._leftovers_said = True
            log.warning("%s: left out %s: written by an earlier dump of %s ranks into the same folder "
                        "(this dump's rank 0 records a world of %d)", self.path,
                        ", ".join(f"rank{rank}" for rank in sorted(leftovers)),
                        " and ".join(map(str, sorted(set(leftovers.values())))), self._world_of_rank0(found))
        return [d for rank, d in found if rank not in leftovers]

    def world_size(self) -> int | None:
        """The number of ranks the run had, as its ranks' ``rank.json`` record it (the largest
        recorded: a world of 2 whose rank0 folder is lost still says 2 in rank1); None where no
        rank records one."""
        worlds = []
        for d in self._rank_dirs():
            try:
                meta = self._read_json(d / "rank.json")
            except DumpFormatError:
                continue
            world = meta.get("world_size") if isinstance(meta, dict) else None
            if type(world) is int and world > 0:
                worlds.append(world)
        return max(worlds, default=None)

    def _world_of_rank0(self, found: list[tuple[int, Path]]) -> int | None:
        """The world size rank 0's rank.json records (None: no rank 0, or a dump of a version
        that recorded none)."""
        if not found or found[0][0] != 0:
            return None
        try:
            meta = self._read_json(found[0][1] / "rank.json")
        except DumpFormatError:
            return None
        world = meta.get("world_size") if isinstance(meta, dict) else None
        return world if type(world) is int and world > 0 else None

    def _leftover_ranks(self, found: list[tuple[int, Path]]) -> dict[int, int]:
        """Rank -> the world size it records, for each rank folder an earlier dump left here: a new
        dump replaces only the ranks it writes (a rank's writer clears its own folder), so after a
        dump of 4 ranks, one of 1 rank into the same folder finds rank1..rank3 beside its rank0.
        Such a rank is numbered at or beyond the world rank 0 records, and was written in a world
        of its own that held it (a rank's recorded world larger than its number)."""
        world = self._world_of_rank0(found)
        if world is None:
            return {}
        out: dict[int, int] = {}
        for rank, d in found:
            if rank < world:
                continue
            try:
                meta = self._read_json(d / "rank.json")
            except DumpFormatError:
                continue
            own = meta.get("world_size") if isinstance(meta, dict) else None
            if type(own) is int and own > rank and own != world:
                out[rank] = own
        return out

    def entries(self) -> list[Entry]:
        if self._entries is None:
            out: list[Entry] = []
            problems: list[str] = []
            with collections_paused():  # (tens of thousands of entries, no cycles: see collector)
                for rank_dir in self._rank_dirs():
                    out.extend(self._read_index(rank_dir, problems))
            out.sort(key=attrgetter("rank", "step", "order"))
            problems += duplicate_rows(out)
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
        files: dict[str, tuple[dict[str, Stored], str | None]] = {}  # data file -> (table, why unusable)
        left_out: dict[str, list[Entry]] = {}
        disagree: list[str] = []  # entries whose index row and data file differ on shape or dtype
        rows = 0
        torn = False
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
                    torn = True
                    break
                raise DumpFormatError(f"{index}:{no}: corrupt index line ({exc})") from exc
            rows += len(batch)
            for entry in batch:
                if entry.has_data:
                    file_rel, _, key = entry.key.rpartition(":")
                    if file_rel not in files:
                        files[file_rel] = read_table(self._data_path(file_rel, index, no))
                    table, why = files[file_rel]
                    stored = table.get(key)
                    if why is not None or stored is None:
                        left_out.setdefault(file_rel, []).append(entry)
                        continue  # it cannot be loaded: left out, and said so in problems()
                    if not _as_stored(entry, stored):
                        disagree.append(f"{entry.name} {entry.kind} {entry.index} of step {entry.step}: "
                                        f"index {entry.dtype}{list(entry.shape or ())}, {file_rel} "
                                        f"{stored.dtype}{list(stored.shape)}")
                        continue  # its rows would describe another tensor than the one compared
                out.append(entry)
        for file_rel, lost in left_out.items():
            why = files[file_rel][1] or "does not hold the tensors the index names"
            steps = sorted({e.step for e in lost})
            problems.append(f"{self.path / file_rel}: {why}; {len(lost)} entries of step"
                            f"{'s' if len(steps) > 1 else ''} {_span(steps)} point at it (left out)")
        if disagree:
            problems.append(f"{index}: {len(disagree)} entries disagree with their data file on shape or "
                            f"dtype (left out), first {disagree[0]}")
        if not torn:
            problems += self._rows_not_written(rank_dir, rows)
        _share_repeat_stats(out)
        return out

    def _rows_not_written(self, rank_dir: Path, rows: int) -> list[str]:
        """A problem when a complete rank's index holds other than the rows its writer counted
        (``rank.json`` ``entries``): whole lines lost (a copy cut at a line's end, an edit)
        leave no torn line to tell."""
        try:
            meta = self._read_json(rank_dir / "rank.json")
        except DumpFormatError:
            return []  # (said elsewhere: the rank's folder is not read as a rank of this dump)
        written = meta.get("entries") if isinstance(meta, dict) and meta.get("complete") is True else None
        if type(written) is not int or written == rows:
            return []
        how = "lines are missing (a copy cut short, or an edit)" if rows < written else "rows were added"
        return [f"{rank_dir / 'index.jsonl'}: {rows} entries, its writer wrote {written} "
                f"({rank_dir / 'rank.json'}): {how}"]

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
        mapped = self._handles.get(file_rel)
        if mapped is None:
            mapped = self._handles[file_rel] = self._map(file_rel, entry.rank)
            if len(self._handles) > 64:  # bound the open files on huge dumps
                self._handles = {file_rel: mapped}
        data, table = mapped
        stored = table.get(key)
        if stored is None:
            raise DumpFormatError(f"{self.path / file_rel}: no tensor {key!r}")
        dtype = SAFETENSORS_DTYPES.get(stored.dtype)
        if dtype is None:
            raise DumpFormatError(f"{self.path / file_rel}: tensor {key!r} has dtype {stored.dtype}, "
                                  "which this torch cannot hold")
        if stored.end == stored.begin:
            return torch.empty(stored.shape, dtype=dtype)
        try:
            flat = torch.frombuffer(data, dtype=dtype, count=(stored.end - stored.begin) // dtype.itemsize,
                                    offset=stored.begin)
        except ValueError as exc:  # the file shrank since its header was read
            raise DumpFormatError(f"{self.path / file_rel}: tensor {key!r} is not all there ({exc})") from exc
        return flat.view(stored.shape)

    def _map(self, file_rel: str, rank: int) -> tuple[mmap.mmap, dict[str, Stored]]:
        """A data file mapped whole (copy-on-write: nothing is ever written back) with its table.

        A tensor is a view of the mapping, ~5 us where ``safetensors.safe_open``'s ``get_tensor``
        takes ~25 us (a compare of a real dump loads two tensors a pair). The table is the
        file's header, checked as the index check checks it: every range lies in the file and
        fits its dtype and shape."""
        path = self._data_path(file_rel, self.path / f"rank{rank}" / "index.jsonl")
        table, why = read_table(path)  # (read again: kept from the index, tables would grow with the dump)
        if why is not None:
            raise DumpFormatError(f"{path}: {why}")
        try:
            with open_regular(path) as f:  # (a FIFO would block a plain open)
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise DumpFormatError(f"{path}: unreadable ({exc})") from exc
        return data, table

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


def _as_stored(entry: Entry, stored: Stored) -> bool:
    """Whether an index row describes the tensor its data file holds: the same shape, and the same
    dtype where the file's dtype code is one llmflow knows."""
    if entry.shape is not None and tuple(entry.shape) != stored.shape:
        return False
    known = DTYPE_OF_SAFETENSORS_CODE.get(stored.dtype)
    return known is None or entry.dtype is None or dtype_name(entry.dtype) == known


MAX_DUPLICATES_NAMED = 5  # problem lines naming a duplicated tensor; the rest are counted


def duplicate_rows(entries: list[Entry]) -> list[str]:
    """One problem line per tensor indexed twice: two rows with the same rank, step and
    ``order`` (``entries`` sorted by those).

    ``order`` numbers a step's rows one by one, so it is what tells two captures apart: a module
    called twice in a step gives two rows of the same name, kind and index at different orders, and
    a repeat of an unchanged tensor shares the first capture's ``key`` under its own order and name;
    neither is a duplicate. Two rows at one order are two claims about one capture (an index line
    written twice, index files merged); which copy is right cannot be told, whichever comes first,
    so the dump is not whole."""
    out: list[str] = []
    count = 0
    for prev, e in zip(entries, entries[1:], strict=False):
        if (prev.rank, prev.step, prev.order) != (e.rank, e.step, e.order):
            continue
        count += 1
        if count <= MAX_DUPLICATES_NAMED:
            same = "" if (prev.name, prev.kind, prev.index) == (e.name, e.kind, e.index) else \
                f" (also claimed by {e.name} {e.kind} {e.index})"
            out.append(f"rank{e.rank}/index.jsonl: {prev.name} {prev.kind} {prev.index} of step {e.step} "
                       f"(order {e.order}) is indexed twice{same}: which row is right cannot be told")
    if count > MAX_DUPLICATES_NAMED:
        out.append(f"rank index files: {count - MAX_DUPLICATES_NAMED} more rows indexed twice")
    return out


def _span(steps: list[int]) -> str:
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
