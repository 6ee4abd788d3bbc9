"""Writers of foreign dump formats, for tests: an msit torch dump, an ATB dump and its ``.bin``
files, laid out and encoded as msit and ATB write them, so that the readers in
``llmflow.formats`` can be tested on known contents without an NPU. llmflow itself only reads
these formats."""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from llmflow.errors import DumpFormatError
from llmflow.formats.atb import SUB as ATB_SUB
from llmflow.formats.atb_bin import CODES, FORMAT_ND
from llmflow.formats.msit import STATS_FILE
from llmflow.formats.msit import SUB as MSIT_SUB


# -- msit torch dumps ------------------------------------------------------------------------------
def _save_value(folder: Path, stem: str, value: Any, stats: list[list[Any]] | None, node: tuple[str, str],
                depth: int = 0) -> None:
    """msit's ``dump_tensor``: tuples/lists recurse as ``{stem}_{i}``, tensors go to ``{stem}.pth``."""
    if isinstance(value, (tuple, list)) and depth < 16:
        for i, v in enumerate(value):
            _save_value(folder, f"{stem}_{i}", v, stats, node, depth + 1)
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if stats is not None:
            f = t.float()
            index = int(stem.split("_")[-1]) if "_" in stem else 0
            stats.append([node[0], node[1], "Input" if stem.startswith("input") else "Output", index,
                          str(t.dtype), tuple(t.shape), f.max().item(), f.min().item(), f.mean().item(),
                          f.norm().item()])
        torch.save(t.clone(), folder / f"{stem}.pth")


def write_msit_dump(path: str | Path, tokens: Mapping[int, Mapping[str, Mapping[str, Any]]], *,
                    tree: Mapping[str, Any] | None = None, weights: Mapping[str, torch.Tensor] | None = None,
                    device: str = "cpu", pid: int = 4242, timestamp: str | None = None,
                    statistics: bool = False, types: Mapping[str, str] | None = None) -> Path:
    """Write an msit torch dump; returns the ``msit_dump_*`` folder.

    tokens: ``{token: {module name (with or without "root."): {"inputs": tuple, "output": value}}}``
      in call order; ``inputs`` are saved ``input_{i}``, a tensor output as ``output``, a tuple
      output as ``output_{i}`` (nested ``output_{i}_{j}``), like msit's forward hooks.
    tree: model_tree.json content (``{"name": "root", "type", "children"}``).
    weights: parameter name -> tensor, saved as ``weights/root.{name}.pth``.
    statistics: also write each folder's statistics.csv (msit's ``dump_statistics_mode=2``).
    """
    ts = timestamp or time.strftime("%Y%m%d_%H%M%S")
    root = Path(path) / f"msit_dump_{ts}"
    dev = root / MSIT_SUB / f"{device}_{pid}"
    dev.mkdir(parents=True, exist_ok=True)
    if tree is not None:
        (dev / "model_tree.json").write_text(json.dumps(tree))
    for token, modules in tokens.items():
        for name, call in modules.items():
            folder_name = name if name == "root" or name.startswith("root.") else (
                f"root.{name}" if name else "root")
            folder = dev / str(token) / folder_name
            folder.mkdir(parents=True, exist_ok=True)
            stats: list[list[Any]] | None = [] if statistics else None
            node = (folder_name, (types or {}).get(name, ""))
            if "inputs" in call:
                _save_value(folder, "input", tuple(call["inputs"]), stats, node)
            if "output" in call:
                _save_value(folder, "output", call["output"], stats, node)
            if stats:
                _write_stats(folder / STATS_FILE, stats)
    for name, w in (weights or {}).items():
        (dev / "weights").mkdir(exist_ok=True)
        torch.save(w.detach().cpu().clone(), dev / "weights" / f"root.{name}.pth")
    return root


def _write_stats(path: Path, rows: Iterable[list[Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["NodeName", "NodeType", "InputOutput", "Index", "DataType", "Shape", "Max", "Min",
                    "Mean", "L2Norm"])
        w.writerows(rows)


# -- ATB dumps ------------------------------------------------------------------------------------
def header_bytes(attrs: list[tuple[str, str]], objects: list[tuple[str, int]]) -> bytes:
    """The header ``Mki::BinFile`` writes for these user attributes and objects (name, length)."""
    lines = ["$Version=1.0", f"$Object.Count={len(objects)}",
             f"$Object.Length={sum(n for _, n in objects)}"]
    lines += [f"{k}={v}" for k, v in attrs]
    offset = 0
    for name, n in objects:
        lines.append(f"$Object.{name}={offset},{n}")
        offset += n
    lines.append("$End=1")
    return ("\n".join(lines) + "\n").encode()


def _meta(t: torch.Tensor, fmt: int) -> list[tuple[str, str]]:
    if t.dtype not in CODES:
        raise DumpFormatError(f"ATB .bin cannot hold dtype {t.dtype} (codes exist for "
                              f"{', '.join(str(d)[6:] for d in CODES)})")
    return [("format", str(fmt)), ("dtype", str(CODES[t.dtype])), ("dims", ",".join(map(str, t.shape)))]


def write_bin(path: Path, tensor: torch.Tensor, fmt: int = FORMAT_ND) -> None:
    """Write ``tensor`` as an ATB ``.bin`` file (same bytes ATB's dump writes)."""
    t = tensor.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header_bytes(_meta(t, fmt), [("data", len(raw))]) + raw)


def write_bin_stats(path: Path, tensor: torch.Tensor, fmt: int = FORMAT_ND) -> None:
    """Write the statistics-only variant: format, dtype, dims, max, min, mean, l2norm."""
    t = tensor.detach().cpu()
    f = t.double()
    stats = [("max", f.max().item()), ("min", f.min().item()), ("mean", f.mean().item()),
             ("l2norm", f.norm().item())] if t.numel() else []
    attrs = _meta(t, fmt) + [(k, repr(float(v))) for k, v in stats]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header_bytes(attrs, []))


def write_atb_dump(path: str | Path, rounds: Mapping[int, Mapping[str, Mapping[str, Sequence[torch.Tensor]]]],
                   models: Sequence[Mapping[str, Any]] = (), *, device_id: int = 0, pid: int = 4242,
                   timestamp: str | None = None, statistics: bool = False) -> Path:
    """Write an ATB dump in msit's layout; returns the ``msit_dump_*`` folder.

    rounds: ``{round: {op folder path: {"in": [tensors], "out": [tensors]}}}`` where the op folder
      path uses ATB's global numbering and ``/`` between levels (``"1_DecoderLayer/0_RmsNorm"``).
    models: model files ``{"modelName": ..., "nodes": [...]}`` written to ``model/{pid}/``; give
      each top-level node an ``opName`` ending in its global number (``"WordEmbedding_0"``).
    statistics: write the statistics-only ``.bin`` variant instead of tensor data.
    """
    ts = timestamp or time.strftime("%Y%m%d_%H%M%S")
    root = Path(path) / f"msit_dump_{ts}"
    dev = root / ATB_SUB / f"{device_id}_{pid}"
    writer = write_bin_stats if statistics else write_bin
    for round_no, ops in rounds.items():
        for op_path, tensors in ops.items():
            op_dir = dev / str(round_no) / op_path
            for i, t in enumerate(tensors.get("in", ())):
                writer(op_dir / "before" / f"intensor{i}.bin", t)
            for i, t in enumerate(tensors.get("out", ())):
                writer(op_dir / "after" / f"outtensor{i}.bin", t)
    if models:
        mdir = root / "model" / str(pid)
        mdir.mkdir(parents=True, exist_ok=True)
        for m in models:
            (mdir / f"{m['modelName']}.json").write_text(json.dumps(m, indent=1))
    dev.mkdir(parents=True, exist_ok=True)
    return root
