"""msit torch dumps (``msit_llm.DumpConfig`` + ``register_hook``): the reader.

Layout (msit_llm/dump/torch_dump, read from its source)::

  {dump_path}/msit_dump_{YYYYmmdd_HHMMSS}/torch_tensors/{device}_{pid}/
    model_tree.json                     {"name": "root", "type": ..., "children": [...]} (call order)
    weights/root.model.embed_tokens.weight.pth          (dump_weight=True)
    {token}/root.model.layers.0.mlp/input_0.pth, input_1.pth ...   positional inputs
    {token}/root.model.layers.0.mlp/output.pth                     a single-tensor output
    {token}/root.model.layers.0.self_attn/output_0.pth, output_1_0.pth   tuple (nested) outputs
    {token}/root.model.layers.0.mlp.linear/...          API mode: ``{calling module}.{api}[.{n}]``
    {token}/{module}/statistics.csv     NodeName,NodeType,InputOutput,Index,DataType,Shape,Max,Min,Mean,L2Norm

``{device}`` is ``cpu``, ``npu0``, ``cuda1``...; folders are ranks in device-id order. A token
folder is one forward call of the root module (token 0 is the prefill). Every ``.pth`` holds one
tensor saved with ``torch.save`` and is read with ``torch.load(weights_only=True)``.

Names: the ``root.`` prefix is dropped (``root`` itself is the empty name); a folder that is not a
module of ``model_tree.json`` but extends one with ``.{api}`` or ``.{api}.{n}`` is an API call,
named ``{module}/{api}.{n}``. ``input_1`` is index ``"1"``, ``output`` index ``"0"``,
``output_1_0`` index ``"1.0"``. Statistics rows without a tensor file become statistics-only
entries; rows of a tensor that was also saved fill that entry's ``stats``.
"""

from __future__ import annotations

import ast
import csv
import io
import os
import re
from pathlib import Path
from typing import Any

import torch

from llmflow.dtypes import dtype_name
from llmflow.errors import DumpFormatError
from llmflow.formats._safe import (
    device_dirs,
    expect,
    is_dir,
    list_dir,
    locate_msit,
    read_json,
    read_text,
    torch_load,
)
from llmflow.formats.base import DumpReader, Entry
from llmflow.formats.head import as_logits, derived_logits

SUB = "torch_tensors"
STATS_FILE = "statistics.csv"
_FILE = re.compile(r"^(input|output)((?:_\d+)*)\.pth$")
_API = re.compile(r"^(?P<module>.*)\.(?P<api>[A-Za-z_][\w]*?)(?:\.(?P<n>\d+))?$")


def strip_root(name: str) -> str:
    return "" if name == "root" else name.removeprefix("root.")


def _tree_modules(node: Any, path: Path, out: dict[str, str], depth: int = 0) -> None:
    expect(isinstance(node, dict) and isinstance(node.get("name"), str), path,
           "model_tree.json node without a string 'name'")
    expect(depth < 256, path, "model_tree.json nested deeper than 256 levels")
    children = node.get("children") or []
    expect(isinstance(children, list), path, "model_tree.json 'children' is not a list")
    for c in children:
        _tree_modules(c, path, out, depth + 1)
    # after its children: the order module outputs are made in (a module's ends after its children's)
    out[strip_root(node["name"])] = str(node.get("type") or "")


def _float(v: str) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class MsitDumpReader(DumpReader):
    """Reads an msit torch dump (``.pth`` per tensor, ``statistics.csv``, ``model_tree.json``)."""

    format = "msit"

    def __init__(self, path: str | Path):
        super().__init__(path)
        found = locate_msit(self.path, SUB)
        if found is None:
            p = self.path
            if p.is_dir() and (p / "model_tree.json").is_file() and p.parent.name != SUB:
                found = (p.parent, p.name)  # a bare {device}_{pid} folder moved out of its dump
            else:
                raise DumpFormatError(f"{p}: no msit '{SUB}' folder here (expected msit_dump_*/{SUB})")
        self.tensors_dir, self._only = found
        self._entries: list[Entry] | None = None
        self._problems: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_entries": None, "_problems": []}

    def problems(self) -> list[str]:
        """Tensor files that cannot be read (truncated, refused, not a regular file): msit writes
        no index, so each is found while listing and its entry is left out."""
        self.entries()
        return list(self._problems)

    @classmethod
    def detect(cls, path: Path) -> bool:
        p = Path(path)
        return locate_msit(p, SUB) is not None or (p.is_dir() and (p / "model_tree.json").is_file())

    @classmethod
    def dump_folder(cls, path: Path) -> Path:
        found = locate_msit(Path(path), SUB)  # (the msit_dump_* folder above its tensors folder)
        return found[0].parent if found is not None else Path(path)

    def _ranks(self) -> list[tuple[int, str, Path]]:
        if self._only is not None:  # the user pointed at one {device}_{pid} folder
            return [(0, self._only, self.tensors_dir / self._only)]
        return device_dirs(self.tensors_dir)

    def topology(self) -> dict[str, Any] | None:
        ranks = self._ranks()
        path = ranks[0][2] / "model_tree.json" if ranks else None
        if path is None or not path.is_file():
            return None
        tree = read_json(path)

        def conv(node: dict[str, Any], depth: int = 0) -> dict[str, Any]:
            expect(isinstance(node, dict) and depth < 256, path, "malformed model_tree.json node")
            kids = node.get("children") or []
            expect(isinstance(kids, list), path, "model_tree.json 'children' is not a list")
            return {"name": strip_root(str(node.get("name", ""))), "type": node.get("type"),
                    "children": [conv(c, depth + 1) for c in kids], "params": {}}

        return conv(tree)

    def _module_types(self, rank_dir: Path) -> dict[str, str]:
        path = rank_dir / "model_tree.json"
        types: dict[str, str] = {}
        if path.is_file():
            _tree_modules(read_json(path), path, types)
        return types

    def entries(self) -> list[Entry]:
        if self._entries is None:
            self._problems = []
            out: list[Entry] = []
            for rank, _, rank_dir in self._ranks():
                types = self._module_types(rank_dir)
                for d in list_dir(rank_dir):
                    if d.name.isdigit() and is_dir(d):
                        out.extend(self._token(rank, int(d.name), Path(d.path), types))
                    elif d.name == "weights" and is_dir(d):
                        out.extend(self._weights(rank, Path(d.path)))
            out.extend(derived_logits(out))
            out.sort(key=lambda e: (e.rank, e.step, e.order))
            self._entries = out
        return self._entries

    def _name(self, folder: str, types: dict[str, str]) -> tuple[str, str, str | None]:
        """``(llmflow name, level, module type)`` of a module or API folder."""
        name = strip_root(folder)
        if not types or name in types:
            return name, "module", types.get(name)
        m = _API.match(folder)
        if m and strip_root(m["module"]) in types:
            return f"{strip_root(m['module'])}/{m['api']}.{m['n'] or 0}", "api", m["api"]
        return name, "module", None

    @staticmethod
    def _run_order(named: tuple[str, str, str | None], positions: dict[str, int]) -> tuple[int, int, int]:
        """Where a module or API folder's tensors come in the run: modules as their outputs are made
        (``positions``: each module's place in model_tree.json listed after its children, a module's
        output ending after theirs, so the first failing row is the innermost module, not the
        model), an API call inside its module before the module's output, by its count; folders
        the tree does not name last."""
        name, level, _ = named
        if level == "api":
            module, _, call = name.rpartition("/")
            count = call.rpartition(".")[2]
            return positions.get(module, len(positions)), 0, int(count) if count.isdigit() else 0
        return positions.get(name, len(positions)), 1, 0

    def _token(self, rank: int, step: int, token_dir: Path, types: dict[str, str]) -> list[Entry]:
        out: list[Entry] = []
        folders = [(d, self._name(d.name, types)) for d in list_dir(token_dir) if is_dir(d)]
        positions = {module: i for i, module in enumerate(types)}
        folders.sort(key=lambda found: self._run_order(found[1], positions))
        for d, (name, level, mtype) in folders:
            found: dict[tuple[str, str], Entry] = {}
            for f in list_dir(Path(d.path)):
                m = _FILE.match(f.name)
                if not m:
                    continue
                kind = m[1]
                index = ".".join(m[2].split("_")[1:]) or "0"
                e = Entry(step=step, rank=rank, name=name, kind=kind, index=index, level=level,
                          order=0, module_type=mtype, key=os.path.relpath(f.path, self.tensors_dir))
                found[(kind, index)] = e
            has_files = bool(found)
            for row in self._stats(Path(d.path) / STATS_FILE):
                kind = "input" if row.get("InputOutput", "").lower().startswith("in") else "output"
                index = str(row.get("Index") or "0").strip() or "0"
                stats = {k: v for k, v in (("max", _float(row.get("Max"))), ("min", _float(row.get("Min"))),
                                           ("mean", _float(row.get("Mean"))),
                                           ("norm", _float(row.get("L2Norm")))) if v is not None}
                e = found.get((kind, index))
                if e is None and has_files:
                    continue  # msit's Index keeps only the last number of nested outputs: no match
                if e is not None and "." in e.index:
                    continue
                dtype = dtype_name(row.get("DataType") or "") or None
                shape = self._shape(row.get("Shape"))
                if e is None:
                    e = Entry(step=step, rank=rank, name=name, kind=kind, index=index, level=level,
                              order=0, module_type=mtype or row.get("NodeType") or None, dtype=dtype,
                              shape=shape, has_data=False, key="")
                    found[(kind, index)] = e
                e.stats = stats
                e.dtype, e.shape = e.dtype or dtype, e.shape or shape
            for e in sorted(found.values(), key=lambda e: (e.kind != "input", e.index)):
                if e.has_data and e.dtype is None and not self._probe(e):
                    continue  # msit writes no index: dtype and shape come from the file
                e.order = len(out)
                out.append(e)
        return out

    @staticmethod
    def _shape(text: str | None) -> tuple[int, ...] | None:
        if not text:
            return None
        try:
            v = ast.literal_eval(text.strip()) if len(text) < 200 else None
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
        if isinstance(v, int):
            v = (v,)
        if isinstance(v, (tuple, list)) and all(isinstance(x, int) and x >= 0 for x in v):
            return tuple(v)
        return None

    @staticmethod
    def _stats(path: Path) -> list[dict[str, str]]:
        if not path.is_file():
            return []
        text = read_text(path)
        try:
            rows = list(csv.DictReader(io.StringIO(text)))
        except csv.Error as exc:
            raise DumpFormatError(f"{path}: malformed CSV ({exc})") from exc
        if rows and "InputOutput" not in rows[0]:
            raise DumpFormatError(f"{path}: not an msit statistics.csv (no InputOutput column)")
        return [{k: v for k, v in r.items() if isinstance(k, str) and isinstance(v, str)} for r in rows]

    def _weights(self, rank: int, wdir: Path) -> list[Entry]:
        out = []
        for f in list_dir(wdir):
            if f.name.endswith(".pth") and not is_dir(f):
                e = Entry(step=-1, rank=rank, name=strip_root(f.name[:-4]), kind="weight", index="0",
                          level="weight", order=len(out), key=os.path.relpath(f.path, self.tensors_dir))
                if self._probe(e):
                    out.append(e)
        return out

    def _probe(self, entry: Entry) -> bool:
        """Fill ``entry``'s dtype and shape from its file (memory-mapped, never unpickled); False,
        with the reason among ``problems()``, when the file cannot be read."""
        try:
            t = torch_load(self._file(entry), mmap=True)
        except DumpFormatError as exc:
            self._problems.append(f"{exc}; left out")
            return False
        entry.dtype, entry.shape = dtype_name(t.dtype), tuple(t.shape)
        return True

    def _file(self, entry: Entry) -> Path:
        path = (self.tensors_dir / entry.key).resolve()
        expect(self.tensors_dir.resolve() in path.parents and path.suffix == ".pth", self.tensors_dir,
               f"entry key {entry.key!r} is not a .pth file inside the dump")
        return path

    def load(self, entry: Entry) -> torch.Tensor:
        if not entry.has_data:
            raise DumpFormatError(f"{self.tensors_dir}: {entry.name} {entry.kind} {entry.index} "
                                  f"(step {entry.step}) is statistics only")
        tensor = torch_load(self._file(entry))
        return as_logits(tensor) if entry.extra.get("logits_of") else tensor


