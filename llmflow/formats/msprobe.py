"""msprobe dumps (``msprobe.pytorch.PrecisionDebugger``, tasks ``statistics`` and ``tensor``).

Layout (read from dumps mindstudio-probe 26.x writes)::

  {dump_path}/step{S}/rank{R}/ or proc{pid}/    (``rank`` alone on a single device)
    dump.json        {"task", "level", "framework", "dump_data_dir", "data": {record name: record}}
    construct.json   {record name: parent module record name or null}  (empty at level L1)
    stack.json       call stacks (not read)
    dump_tensor_data/{data_name}.pt or .npy         (task "tensor")

A record is ``{"input_args": [...], "input_kwargs": {...}, "output": [...], "parameters": {...}}``;
a tensor value is ``{"type": "torch.Tensor", "dtype", "shape", "Max", "Min", "Mean", "Norm",
"requires_grad", "data_name"}``, another value ``{"type": "int", "value": 0}``; lists nest, and a
``ModelOutput`` is a dict of values. Record names:

* ``Module.model.layers.0.mlp.down_proj.Linear.forward.0`` -> module ``model.layers.0.mlp.down_proj``
  (module_type ``Linear``); ``Cell.`` (MindSpore) alike;
* ``Functional.linear.20.forward``, ``Tensor.__add__.3.forward``, ``Torch.matmul.5.forward`` ->
  API ``{module}/{api}.{n}``: the module is the record's parent in construct.json (level mix),
  else ``""``; ``n`` is renumbered per (step, module, api) like llmflow's own API names, and
  operator dunders are named like the function (``__add__``/``__radd__`` -> ``add``,
  ``__iadd__`` -> ``add_``, ``__truediv__`` -> ``div``, ``__rsub__`` -> ``rsub``:
  ``llmflow.operators``).

Steps: msprobe counts calls, not tokens, and a step folder may hold many tokens (one folder for a
whole ``generate()``). Tokens follow the model's forward passes; records are in the order their
calls finished. Inside one step folder a forward pass opens at a call of the **embedding** (the
op that turns token ids into hidden states, called once per pass):

* the ``embedding`` API where the folder has API records (levels L1 and mix:
  ``Functional.embedding.k.forward``; at mix it finishes before its module's record, so the pass
  opens with it). A model may look up several tables per pass (GPT-2: tokens, then positions):
  only the calls that look up the first call's table (its weight argument's dtype, shape and
  statistics, constant for one table) open a pass;
* else (level L0) the first module record of an ``...Embedding`` class in dump.json order
  (``Module.model.embed_tokens.Embedding.forward.k``, whatever its counter starts at): every
  call of it opens a pass;
* a folder with neither (a dump filtered by ``scope``/``list``) falls back on its first record
  where that is a module's: each call of it opens a pass; where it is an API's (``"list":
  ["linear"]``: an API is called many times in one pass, so its calls cannot tell passes apart)
  the folder is read as one pass, its calls paired by their counters as msprobe pairs them.

Records before the first pass (a ``generate()`` loop's setup: ``Torch.isin``, ``cumsum``) belong
to the first token, and the loop's work between two passes (``argmax`` of the logits, stopping
criteria, the next pass's position ids) to the token before; a dump of ``generate(max_new_tokens=
N)`` therefore reads as N tokens at every level. When every step folder holds one token
(``debugger.step()`` after each token), step ``S`` is the token; otherwise the tokens of the
folders are numbered on from one folder to the next.
Backward records are left out (inference). ``parameters`` become weight entries (step -1).

Statistics (``Max``, ``Min``, ``Mean``, ``Norm``) are read as numbers where they are: msprobe
writes ``null`` for an integer tensor's mean and norm and JSON booleans for a bool tensor's max
and min (read as 1 and 0); peers write ``"nan"``/``"inf"`` strings (read as NaN/Inf: a NaN/Inf
tensor's statistics, compared as such). ``null`` or another string is "not available": the
statistic is left out of the entry, and the compare judges what both sides have. A tensor value
with no statistic and no data file cannot be compared: it is listed in ``problems()``.
``summary_mode: md5`` adds ``"md5"``: a CRC-32 of the tensor's bytes (8 hex digits, msprobe's name
for it), read into ``extra["crc32"]`` as llmflow's own ``crc32`` dumps record it; where both sides
of a statistics row have one, the compare asks for bitwise identity (``checksum_differs``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch

from llmflow.collector import collections_paused
from llmflow.dtypes import dtype_name
from llmflow.errors import DumpFormatError
from llmflow.formats._safe import (
    check_shape,
    cut_short,
    expect,
    is_dir,
    list_dir,
    numpy_load,
    read_json,
    torch_load,
)
from llmflow.formats.base import DumpReader, Entry
from llmflow.formats.head import as_logits, derived_logits
from llmflow.operators import operator_name

DUMP_FILE = "dump.json"
_STEP = re.compile(r"^step(\d+)$")
_RANK = re.compile(r"^(?:rank(\d*)|proc(\d+))$")
_MODULE = re.compile(
    r"^(?:Module|Cell)\.(?:(?P<path>.+)\.)?(?P<cls>[^.]+)\.(?P<dir>forward|backward)\.(?P<k>\d+)$"
)
_API = re.compile(r"^(?P<group>[A-Za-z_]\w*)\.(?P<api>.+)\.(?P<k>\d+)\.(?P<dir>forward|backward)$")
_CRC32 = re.compile(r"^[0-9a-fA-F]{8}$")
_STAT_KEYS = (("Max", "max"), ("Min", "min"), ("Mean", "mean"), ("Norm", "norm"))


def api_name(raw: str) -> str:
    """msprobe's API name in llmflow's spelling (operators named like their function)."""
    return operator_name(raw) or (raw[2:-2] if raw.startswith("__") and raw.endswith("__") else raw)


def parse_name(record: str) -> tuple[str, str, str, str] | None:
    """``(level, module path or api, module type or api group, direction)`` of a record name."""
    m = _MODULE.match(record)
    if m:
        return "module", m["path"] or "", m["cls"], m["dir"]
    m = _API.match(record)
    if m:
        return "api", m["api"], m["group"], m["dir"]
    return None


def statistic(value: Any) -> float | None:
    """One statistic of a tensor value as a float, or None where it is not available: numbers as
    they are, JSON booleans (a bool tensor's max and min) as 1 and 0, the strings peers write for
    non-finite statistics (``"nan"``, ``"inf"``, ``"-Infinity"``) as NaN/Inf; ``null`` and any
    other string are not available."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float, str)):
        try:
            return float(value)
        except (ValueError, OverflowError):
            return None
    return None


# keyword inputs that carry a KV cache; msprobe writes ``null`` for a cache object (any object it
# cannot record) as for a None
_CACHE_INPUTS = frozenset({"kw:past_key_value", "kw:past_key_values", "kw:layer_past"})


def _caches_given(entries: list[Entry]) -> None:
    """Type as a ``DynamicCache`` the ``null`` cache inputs of a module that was given a cache: one
    whose later step reads fewer positions than the context grew by (a decode step feeds its new
    token alone), so a replay fills a cache of its own instead of passing None. A loop that runs
    the whole sequence again each step (no cache) keeps its None."""
    nulls = [e for e in entries if e.level == "module" and e.kind == "input" and e.pytype == "NoneType"
             and e.index in _CACHE_INPUTS]
    if not nulls:
        return
    wanted = {(e.rank, e.name) for e in nulls}
    positions: dict[tuple[int, str], dict[int, tuple[int, int]]] = {}  # -> step -> (order, length)
    for e in entries:
        if (e.level == "module" and e.kind == "input" and e.is_tensor and e.shape and len(e.shape) >= 2
                and e.step >= 0 and (e.rank, e.name) in wanted):
            steps = positions.setdefault((e.rank, e.name), {})
            if e.step not in steps or e.order < steps[e.step][0]:
                steps[e.step] = (e.order, int(e.shape[-2]))  # the first tensor input: hidden states
    cached = set()
    for key, steps in positions.items():
        seen = sorted(steps)
        if any(steps[b][1] < steps[a][1] + (b - a) for a, b in zip(seen, seen[1:], strict=False)):
            cached.add(key)
    for e in nulls:
        if (e.rank, e.name) in cached:
            e.pytype = "DynamicCache"


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()  # (follows symlinks; a FIFO or a device is not a file)
    except OSError:
        return False


def _base(record: str) -> str:
    """The record name without its call counter: equal for every call of the same thing."""
    return re.sub(
        r"\.\d+(\.(forward|backward))$", r"\1", re.sub(r"\.(forward|backward)\.\d+$", r".\1", record)
    )


def _is_embedding(parsed: tuple[str, str, str, str] | None, level: str) -> bool:
    if parsed is None or parsed[0] != level:
        return False
    _, what, group, _ = parsed
    return group.endswith("Embedding") and "Rotary" not in group if level == "module" else what == "embedding"


def _table(record: Any) -> str:
    """What identifies the table an ``embedding`` API call looks up: its weight argument's dtype,
    shape and statistics (constant for one table), as text; "" where the record has no inputs."""
    if not isinstance(record, dict):
        return ""
    args = record.get("input_args")
    kwargs = record.get("input_kwargs")
    weight = args[1] if isinstance(args, list) and len(args) > 1 else (
        kwargs.get("weight") if isinstance(kwargs, dict) else None)
    if not isinstance(weight, dict):
        return ""
    return repr([weight.get(k) for k in ("dtype", "shape", *(k for k, _ in _STAT_KEYS))])


def pass_starts(records: list[tuple[str, Any]]) -> list[bool]:
    """For each forward record ``(name, record)`` of one step folder, in dump.json order: does it
    open a forward pass? The rule (the module docstring's "Steps"): each ``embedding`` API call
    that looks up the first call's table, else each call of the first embedding module, else
    each call of the folder's first record where that is a module's, else only the first record."""
    names = [k for k, _ in records]
    parsed = [parse_name(k) for k in names]
    api = next((i for i, p in enumerate(parsed) if _is_embedding(p, "api")), None)
    if api is not None:
        anchor, table = _base(names[api]), _table(records[api][1])
        return [_base(k) == anchor and _table(v) == table for k, v in records]
    module = next((k for k, p in zip(names, parsed, strict=True) if _is_embedding(p, "module")), None)
    if module is None and names and (parsed[0] is None or parsed[0][0] != "module"):
        return [i == 0 for i in range(len(names))]  # (an API's calls: one pass, see above)
    anchor = _base(module if module is not None else names[0]) if names else ""
    return [_base(k) == anchor for k in names]


class ApiCall(NamedTuple):
    """One API record of dump.json: ``Tensor.__rsub__.2.forward`` has group ``Tensor`` and api
    ``__rsub__``; ``record`` holds ``input_args``, ``input_kwargs`` and ``output`` as written."""

    record_name: str
    group: str
    api: str
    record: dict[str, Any]


class MsprobeDumpReader(DumpReader):
    """Reads an msprobe dump: dump.json (+ construct.json, dump_tensor_data/*.pt or *.npy)."""

    format = "msprobe"

    def __init__(self, path: str | Path):
        p = Path(path)
        super().__init__(p.parent if p.name == DUMP_FILE else p)
        self._entries: list[Entry] | None = None
        self._meta: dict[str, Any] | None = None
        self._problems: list[str] = []
        self._api_calls: dict[tuple[int, int, str], ApiCall] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_entries": None, "_meta": None, "_problems": [], "_api_calls": {}}

    @classmethod
    def detect(cls, path: Path) -> bool:
        p = Path(path)
        if p.name == DUMP_FILE or (p / DUMP_FILE).is_file():
            return True
        try:
            return bool(cls._rank_dirs(p)) or any(
                cls._rank_dirs(Path(d.path)) for d in list_dir(p) if _STEP.match(d.name) and is_dir(d)
            )
        except (DumpFormatError, OSError):
            return False

    @staticmethod
    def _rank_dirs(p: Path) -> list[tuple[int, Path]]:
        """``(rank, folder)``: ``rank{N}`` is rank N, ``proc{pid}`` folders are ranked by pid."""
        if not p.is_dir():
            return []
        found = []
        for d in list_dir(p):
            m = _RANK.match(d.name)
            if m and is_dir(d) and (Path(d.path) / DUMP_FILE).is_file():
                found.append((int(m[1] or 0) if m[2] is None else int(m[2]), m[2] is not None, Path(d.path)))
        procs = sorted(x for x in found if x[1])
        ranks = [(n, d) for n, is_proc, d in found if not is_proc]
        ranks += [(i, d) for i, (_, _, d) in enumerate(procs)]
        return sorted(ranks, key=lambda x: x[0])

    def _layout(self) -> list[tuple[int | None, int, Path]]:
        """``(step folder number or None, rank, rank folder)`` of every dump.json."""
        p = self.path
        if (p / DUMP_FILE).is_file():
            m = _RANK.match(p.name)
            rank = int(m[1] or 0) if m and m[2] is None else 0
            s = _STEP.match(p.parent.name)
            return [(int(s[1]) if s else None, rank, p)]
        out: list[tuple[int | None, int, Path]] = []
        s = _STEP.match(p.name)
        for rank, d in self._rank_dirs(p):
            out.append((int(s[1]) if s else None, rank, d))
        for d in list_dir(p):
            sm = _STEP.match(d.name)
            if sm and is_dir(d):
                out += [(int(sm[1]), rank, rd) for rank, rd in self._rank_dirs(Path(d.path))]
        if not out:
            raise DumpFormatError(f"{p}: no msprobe dump.json here (expected step*/rank*/dump.json)")
        return out

    def _read(self, folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        path = folder / DUMP_FILE
        dump = read_json(path, max_depth=64)
        expect(
            isinstance(dump, dict) and isinstance(dump.get("data"), dict),
            path,
            "not an msprobe dump.json (no 'data' object)",
        )
        construct: dict[str, Any] = {}
        cpath = folder / "construct.json"
        if cpath.is_file():
            c = read_json(cpath, max_depth=8)
            expect(isinstance(c, dict), cpath, "construct.json is not a JSON object")
            construct = c
        if self._meta is None:
            self._meta = {k: dump.get(k) for k in ("task", "level", "framework") if k in dump}
        return dump, construct

    def env(self) -> dict[str, Any] | None:
        if self._meta is None:
            self.entries()
        return {"format": "msprobe", **(self._meta or {})}

    def problems(self) -> list[str]:
        """Tensor files dump.json names that are missing or not regular files (those entries
        are read as statistics only), one line per folder."""
        self.entries()
        return list(self._problems)

    def entries(self) -> list[Entry]:
        if self._entries is None:
            self._problems, self._api_calls = [], {}
            by_rank: dict[int, list[tuple[int | None, Path]]] = {}
            for step, rank, folder in self._layout():
                by_rank.setdefault(rank, []).append((step, folder))
            out: list[Entry] = []
            with collections_paused():  # (a decode step of a 7B model: thousands of entries, no cycles)
                for rank, folders in sorted(by_rank.items()):
                    out.extend(self._rank_entries(rank, sorted(folders, key=lambda x: x[0] or 0)))
                out.extend(derived_logits(out))
            out.sort(key=lambda e: (e.rank, e.step, e.order))
            self._entries = out
        return self._entries

    def _rank_entries(self, rank: int, folders: list[tuple[int | None, Path]]) -> list[Entry]:
        parsed = []
        for step_no, folder in folders:
            dump, construct = self._read(folder)
            records = [
                (k, v)
                for k, v in dump["data"].items()
                if (p := parse_name(k)) is not None and p[3] == "forward"
            ]
            opens = pass_starts(records)
            tokens, assigned = -1, []
            for (k, v), opens_pass in zip(records, opens, strict=True):
                tokens += opens_pass
                assigned.append((max(tokens, 0), k, v))
            parsed.append((step_no, folder, construct, assigned, max(tokens + 1, 1)))
        one_each = all(n == 1 for *_, n in parsed) and all(s is not None for s, *_ in parsed)
        out: list[Entry] = []
        offset = 0
        seen_weights: set[str] = set()
        for step_no, folder, construct, assigned, n_tokens in parsed:
            files = self._data_files(folder)
            lost: list[str] = []  # data names dump.json gives whose file cannot be loaded
            blind: list[str] = []  # tensor values with neither a statistic nor data: not comparable
            counters: dict[tuple[int, str, str], int] = {}
            orders: dict[int, int] = {}
            for token, key, record in assigned:
                step = step_no if one_each and step_no is not None else offset + token
                level, what, group, _ = parse_name(key)  # type: ignore[misc]
                expect(isinstance(record, dict), folder / DUMP_FILE, f"record {key!r} is not an object")
                if level == "module":
                    name, mtype = what, group
                else:
                    parent = parse_name(str(construct.get(key) or ""))
                    module = parent[1] if parent and parent[0] == "module" else ""
                    api = api_name(what)
                    n = counters.get((step, module, api), 0)
                    counters[(step, module, api)] = n + 1
                    name, mtype = f"{module}/{api}.{n}", api
                    self._api_calls[(rank, step, name)] = ApiCall(key, group, what, record)
                ctx = (rank, step, name, level, mtype, files, folder, orders, lost, blind)
                self._values(ctx, "input", "", record.get("input_args") or [], out)
                kwargs = record.get("input_kwargs") or {}
                if isinstance(kwargs, dict):
                    for kw, v in kwargs.items():
                        self._values(ctx, "input", f"kw:{kw}", v, out)
                self._values(ctx, "output", "", record.get("output"), out)
                params = record.get("parameters") or {}
                if isinstance(params, dict) and level == "module":
                    for pname, v in params.items():
                        full = f"{name}.{pname}" if name else str(pname)
                        if full not in seen_weights and isinstance(v, dict):
                            seen_weights.add(full)
                            wctx = (rank, -1, full, "weight", None, files, folder, {-1: len(seen_weights)},
                                    lost, blind)
                            self._values(wctx, "weight", "0", v, out)
            if lost:
                missing = [n for n in lost if n not in files]
                odd = [n for n in lost if files.get(n) is False]
                short = [n for n in lost if isinstance(files.get(n), str)]
                for names, why in ((missing, "missing from"), (odd, "not regular files in"),
                                   (short, "that are not whole in")):
                    if names:
                        said = f": {files[names[0]]}" if names is short else ""
                        self._problems.append(
                            f"{folder / DUMP_FILE}: names {len(names)} tensor file(s) {why} "
                            f"dump_tensor_data (first: {names[0][:120]}{said}); read as statistics only")
            if blind:
                self._problems.append(
                    f"{folder / DUMP_FILE}: {len(blind)} tensor value(s) carry no statistic and no data "
                    f"(first: {blind[0][:120]}); left out of the compare")
            offset += n_tokens
        _caches_given(out)
        return out

    def native_names(self, query: str) -> set[str]:
        """msprobe's record name (``Functional.linear.13.forward``, ``Module.model.layers.0.mlp.
        LlamaMLP.forward.0``), also as its data files begin (``...forward.output.0.pt``): the entry
        names it was read as."""
        self.entries()
        record = query
        for suffix in (".pt", ".npy"):
            record = record.removesuffix(suffix)
        for part in (".input.", ".output.", ".parameters."):  # (a data file's name: record.part.index)
            record = record.split(part, 1)[0]
        named = {name for (_, _, name), call in self._api_calls.items() if call.record_name == record}
        parsed = parse_name(record)
        if not named and parsed is not None and parsed[0] == "module":
            named.add(parsed[1])
        return named

    def api_call(self, entry: Entry) -> ApiCall | None:
        """The dump.json record of an API entry's call, as msprobe names it (its group tells
        ``Tensor.__rsub__`` from ``Torch.sub``); None for module and weight entries."""
        self.entries()
        return self._api_calls.get((entry.rank, entry.step, entry.name)) if entry.level == "api" else None

    def _data_files(self, folder: Path) -> dict[str, bool | str]:
        """Name -> is it a regular file (a FIFO or a device is never opened), of dump_tensor_data;
        ``_whole`` puts why one is cut short in place of True."""
        d = folder / "dump_tensor_data"
        return {e.name: _is_file(e) for e in list_dir(d)} if d.is_dir() else {}

    @staticmethod
    def _whole(folder: Path, files: dict[str, bool | str], name: str) -> bool:
        """Whether dump_tensor_data's file ``name`` is there, a regular file and whole by its ends
        (``cut_short``: a copy stopped early leaves a file that lists fine); why not is kept in
        ``files``."""
        found = files.get(name, False)
        if found is True:
            why = cut_short(folder / "dump_tensor_data" / name)
            if why:
                files[name] = found = why
        return found is True

    def _values(
        self, ctx: tuple, kind: str, index: str, value: Any, out: list[Entry], depth: int = 0
    ) -> None:
        """Entries for one (possibly nested) value of a record."""
        rank, step, name, level, mtype, files, folder, orders, lost, blind = ctx
        if depth > 32 or (value is None and kind != "input"):
            return
        if value is None:  # an input given as None (``attention_mask=None``): a replay passes it too
            order = orders.get(step, 0)
            orders[step] = order + 1
            out.append(Entry(step=step, rank=rank, name=name, kind=kind, index=index or "0", level=level,
                             order=order, module_type=mtype, has_data=False, pytype="NoneType"))
            return
        if isinstance(value, list):
            for i, v in enumerate(value):
                self._values(ctx, kind, f"{index}.{i}" if index else str(i), v, out, depth + 1)
            return
        expect(
            isinstance(value, dict), folder / DUMP_FILE, f"{name}: value {str(value)[:60]!r} is not an object"
        )
        if "type" not in value or not isinstance(value.get("type"), str):
            for k, v in value.items():
                self._values(ctx, kind, f"{index}.{k}" if index else str(k), v, out, depth + 1)
            return
        order = orders.get(step, 0)
        orders[step] = order + 1
        e = Entry(
            step=step,
            rank=rank,
            name=name,
            kind=kind,
            index=index or "0",
            level=level,
            order=order,
            module_type=mtype,
            extra={"requires_grad": value.get("requires_grad")} if "requires_grad" in value else {},
        )
        if "dtype" in value and "shape" in value:
            e.dtype = dtype_name(value["dtype"])
            e.shape = check_shape(value["shape"], folder / DUMP_FILE)
            stats = {ours: v for k, ours in _STAT_KEYS if (v := statistic(value.get(k))) is not None}
            e.stats = stats or None
            crc = value.get("md5")  # ``summary_mode: md5``: a CRC-32 of the tensor's bytes, 8 hex digits
            if isinstance(crc, str) and _CRC32.match(crc):
                e.extra["crc32"] = int(crc, 16)  # (the int llmflow's own ``crc32`` dumps record)
            data_name = value.get("data_name")
            e.has_data = isinstance(data_name, str) and self._whole(folder, files, data_name)
            if isinstance(data_name, str) and not e.has_data:
                lost.append(data_name)
            if not stats and not e.has_data and not isinstance(data_name, str) and kind != "weight":
                blind.append(f"{name} {kind} {index or '0'}")
            e.key = (
                os.path.join(os.path.relpath(folder, self.path), "dump_tensor_data", data_name)
                if e.has_data
                else ""
            )
        else:
            e.has_data = False
            v = value.get("value")
            e.value = v if isinstance(v, (type(None), bool, int, float, str)) else str(v)[:200]
            e.pytype = value["type"]
        out.append(e)

    def load(self, entry: Entry) -> torch.Tensor:
        if not entry.has_data:
            raise DumpFormatError(
                f"{self.path}: {entry.name} {entry.kind} {entry.index} (step "
                f"{entry.step}) has no tensor data (statistics task or not a tensor)"
            )
        path = (self.path / entry.key).resolve()
        expect(self.path.resolve() in path.parents, self.path, f"entry key {entry.key!r} leaves the dump")
        if path.suffix == ".npy":
            tensor = numpy_load(path)
            return as_logits(tensor) if entry.extra.get("logits_of") else tensor
        expect(path.suffix in (".pt", ".pth"), path, "not a .pt or .npy tensor file")
        tensor = torch_load(path)
        return as_logits(tensor) if entry.extra.get("logits_of") else tensor

    def topology(self) -> dict[str, Any] | None:
        layout = self._layout()
        _, construct = self._read(layout[0][2])
        if not construct:
            return None
        nodes: dict[str, dict[str, Any]] = {"": {"name": "", "type": None, "children": [], "params": {}}}
        links = []
        for child, parent in construct.items():
            c, p = parse_name(str(child)), parse_name(str(parent or ""))
            if c and c[0] == "module" and c[1] not in nodes:
                nodes[c[1]] = {"name": c[1], "type": c[2], "children": [], "params": {}}
                links.append((c[1], p[1] if p and p[0] == "module" else ""))
        for child, parent in links:
            if child:
                nodes.get(parent, nodes[""])["children"].append(nodes[child])
        return nodes[""]
