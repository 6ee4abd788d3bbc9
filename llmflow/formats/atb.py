"""ATB (Ascend Transformer Boost) dumps written by ``msit llm dump --type model tensor``.

Layout (as msit's compare reads it; ``.bin`` files are described in ``atb_bin``)::

  msit_dump_{YYYYmmdd_HHMMSS}/
    tensors/{device}_{pid}/{round}/{order}_{OpType}/[{order}_{OpType}/...]/before/intensorN.bin
                                                                       .../after/outtensorN.bin
    model/{pid}/{ModelName}.json   {"modelName", "nodes": [{"opName", "opType", "param",
                                                            "inTensors", "outTensors", "nodes"}]}

Operation numbering: ATB numbers the operations of a process globally, so with two models (MindIE
builds a prefill and a decode model) the decode model's top-level operations continue after the
prefill model's: ``0_WordEmbedding`` .. ``N-1_LmHead`` then ``N_WordEmbedding`` .. The start of each
model is the number suffix of its first node's ``opName`` (``WordEmbedding_N``), as msit reads it.
Nested operations are numbered from 0 inside their parent.

Names (what compare and the ``atb-llama`` mapping see): the operation path relative to its own
model, joined with ``.``: ``0_WordEmbedding``, ``1_DecoderLayer``, ``1_DecoderLayer.0_RmsNorm``;
the top-level number is renumbered from 0 within each model, so the prefill and decode models
name the same layer alike. ``module_type`` is the OpType; level ``module``; ``intensorN`` is
kind ``input`` index ``N``, ``outtensorN`` kind ``output`` index ``N``. Inputs are read from
``before/`` (``after/`` if that is all there is), outputs from ``after/`` (else ``before/``).

Steps (msit's "文件夹比对关系"): with two models, round 0 is the engine's warm-up (left out),
round 1 holds token 0 (the prefill model's operations) and token 1 (the decode model's), and
round r >= 2 holds token r. With one model (or no model files) round r is token r. So the steps
of an ATB dump line up with a PyTorch dump's token folders with no offset.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from llmflow.errors import DumpFormatError
from llmflow.formats._safe import (
    Walker,
    device_dirs,
    device_pid,
    expect,
    is_dir,
    list_dir,
    locate_msit,
    read_json,
)
from llmflow.formats.atb_bin import load_bin, read_header
from llmflow.formats.base import DumpReader, Entry
from llmflow.formats.head import as_logits, derived_logits

SUB = "tensors"
_OP = re.compile(r"^(\d+)_(.+)$")
_TENSOR = re.compile(r"^(intensor|outtensor)(\d+)\.bin$")


def _op_start(model: dict[str, Any]) -> int:
    nodes = model.get("nodes") or []
    name = str(nodes[0].get("opName", "")) if nodes and isinstance(nodes[0], dict) else ""
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() and len(tail) < 10 else 0


def _tree(nodes: Any, path: Path, depth: int = 0) -> list[dict[str, Any]]:
    """A model json's nodes as llmflow topology children (``name`` = dotted ATB name)."""
    expect(isinstance(nodes, list), path, "'nodes' is not a list")
    expect(depth < 64, path, "nodes nested deeper than 64 levels")
    out = []
    for i, node in enumerate(nodes):
        expect(isinstance(node, dict) and isinstance(node.get("opType"), str), path,
               f"node {i} at depth {depth} has no string 'opType'")
        out.append({"name": f"{i}_{node['opType']}", "type": node["opType"],
                    "op_name": node.get("opName"), "param": node.get("param"),
                    "children": _tree(node.get("nodes") or [], path, depth + 1), "params": {}})
    return out


class AtbDumpReader(DumpReader):
    """Reads an ATB ``.bin`` dump; tensors load lazily from the ``.bin`` files."""

    format = "atb"

    def __init__(self, path: str | Path):
        super().__init__(path)
        found = locate_msit(self.path, SUB)
        if found is None:
            raise DumpFormatError(f"{self.path}: no ATB '{SUB}' folder here (expected msit_dump_*/{SUB})")
        self.tensors_dir, self._only = found
        self._entries: list[Entry] | None = None
        self._models: dict[str, list[tuple[int, int, str, dict]]] = {}
        self._problems: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_entries": None, "_problems": []}

    def problems(self) -> list[str]:
        """``.bin`` files whose header cannot be read (truncated, not a regular file, lying about
        its size): each is found while listing, and its entry is left out."""
        self.entries()
        return list(self._problems)

    @classmethod
    def detect(cls, path: Path) -> bool:
        return locate_msit(Path(path), SUB) is not None

    @classmethod
    def dump_folder(cls, path: Path) -> Path:
        found = locate_msit(Path(path), SUB)  # (the msit_dump_* folder above its tensors folder)
        return found[0].parent if found is not None else Path(path)

    # -- topology ---------------------------------------------------------------------------
    def models(self, pid: str) -> list[tuple[int, int, str, dict]]:
        """``(start, count, model name, json)`` of the model files of one process, by start."""
        if pid not in self._models:
            model_dir = self.tensors_dir.parent / "model"
            pid_dir = model_dir / pid
            if not pid_dir.is_dir() and model_dir.is_dir():  # msit falls back to the first pid
                dirs = [Path(d.path) for d in list_dir(model_dir) if is_dir(d)]
                pid_dir = dirs[0] if dirs else pid_dir
            found = []
            if pid_dir.is_dir():
                for d in list_dir(pid_dir):
                    if d.name.endswith(".json"):
                        p = Path(d.path)
                        js = read_json(p)
                        expect(isinstance(js, dict), p, "ATB model file is not a JSON object")
                        nodes = js.get("nodes") or []
                        expect(isinstance(nodes, list), p, "'nodes' is not a list")
                        name = str(js.get("modelName") or p.stem)
                        found.append((_op_start(js), len(nodes), name, js))
            found.sort(key=lambda m: m[0])
            self._models[pid] = found
        return self._models[pid]

    def topology(self) -> dict[str, Any] | None:
        ranks = device_dirs(self.tensors_dir, self._only)
        models = self.models(device_pid(ranks[0][1])) if ranks else []
        if not models:
            return None
        trees = []
        for _, _, name, js in models:
            p = self.tensors_dir.parent / "model"
            trees.append({"name": "", "type": name, "children": _tree(js.get("nodes") or [], p),
                          "params": {}})
        return {**trees[0], "models": trees}

    # -- entries ----------------------------------------------------------------------------
    def _place(self, round_no: int, order: int, models: list[tuple[int, int, str, dict]]
               ) -> tuple[int, int, str] | None:
        """``(step, local order, model name)`` of a top-level operation, None for warm-up."""
        if len(models) < 2:
            start = models[0][0] if models else 0
            return round_no, order - start if order >= start else order, models[0][2] if models else ""
        if round_no == 0:
            return None
        idx = max((i for i, m in enumerate(models) if m[0] <= order), default=0)
        start, _, name, _ = models[idx]
        local = order - start
        if round_no == 1:
            return min(idx, 1), local, name
        return round_no, local, name

    def entries(self) -> list[Entry]:
        if self._entries is None:
            self._problems = []
            out: list[Entry] = []
            walker = Walker()
            for rank, dev_name, dev_dir in device_dirs(self.tensors_dir, self._only):
                models = self.models(device_pid(dev_name))
                orders: dict[int, int] = {}
                for rd in list_dir(dev_dir):
                    if not (rd.name.isdigit() and is_dir(rd)):
                        continue
                    round_no = int(rd.name)
                    chain = walker.root(Path(rd.path))
                    for op, op_chain in walker.children(Path(rd.path), chain):
                        m = _OP.match(op.name)
                        if not m or op_chain is None:
                            continue
                        placed = self._place(round_no, int(m[1]), models)
                        if placed is None:
                            continue
                        step, local, model = placed
                        name = f"{local}_{m[2]}"
                        self._walk_op(Path(op.path), op_chain, name, m[2], rank, step, orders, out,
                                      walker, {"round": round_no, "model": model})
            out.extend(derived_logits(out))
            out.sort(key=lambda e: (e.rank, e.step, e.order))
            self._entries = out
        return self._entries

    def _walk_op(self, op_dir: Path, chain: tuple, name: str, op_type: str, rank: int, step: int,
                 orders: dict[int, int], out: list[Entry], walker: Walker, extra: dict[str, Any]) -> None:
        """Entries of one operation: its inputs, then its children, then its outputs."""
        files: dict[str, dict[str, dict[int, Path]]] = {"before": {}, "after": {}}
        children = []
        for child, child_chain in walker.children(op_dir, chain):
            if child_chain is None:
                continue
            if child.name in files:
                for f, _ in walker.children(Path(child.path), child_chain):
                    tm = _TENSOR.match(f.name)
                    if tm:
                        files[child.name].setdefault(tm[1], {})[int(tm[2])] = Path(f.path)
            elif m := _OP.match(child.name):
                children.append((child, child_chain, m[2]))
        rel = os.path.relpath(op_dir, self.tensors_dir)

        def emit(kind: str, prefix: str, prefer: str, other: str) -> None:
            chosen = files[prefer].get(prefix) or files[other].get(prefix) or {}
            for idx in sorted(chosen):
                path = chosen[idx]
                try:
                    h = read_header(path)
                except DumpFormatError as exc:
                    self._problems.append(f"{exc}; left out")
                    continue
                order = orders.get(step, 0)
                orders[step] = order + 1
                out.append(Entry(step=step, rank=rank, name=name, kind=kind, index=str(idx),
                                 level="module", order=order, dtype=h.dtype_name, shape=h.dims,
                                 module_type=op_type, stats=h.stats, has_data=h.data is not None,
                                 key=os.path.relpath(path, self.tensors_dir),
                                 extra={**extra, "atb_path": rel, "format": h.format}))

        emit("input", "intensor", "before", "after")
        for child, child_chain, child_type in children:
            self._walk_op(Path(child.path), child_chain, f"{name}.{child.name}", child_type, rank,
                          step, orders, out, walker, extra)
        emit("output", "outtensor", "after", "before")

    def load(self, entry: Entry) -> torch.Tensor:
        path = (self.tensors_dir / entry.key).resolve()
        expect(self.tensors_dir.resolve() in path.parents and path.suffix == ".bin", self.tensors_dir,
               f"entry key {entry.key!r} is not a .bin file inside the dump")
        tensor = load_bin(path)
        return as_logits(tensor) if entry.extra.get("logits_of") else tensor


