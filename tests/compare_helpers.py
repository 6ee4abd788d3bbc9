"""Helpers of the compare tests: synthetic dumps written with llmflow's own writer, and an
in-memory reader for the pure matching/metrics tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from llmflow.formats.base import DumpReader, Entry
from llmflow.formats.llmflow_dump import DumpDirWriter, LlmflowDumpReader

# (name, kind, index, level, module_type, tensor)
Item = tuple[str, str, str, str, str | None, torch.Tensor]


def entry(
    name: str,
    kind: str = "output",
    index: str = "0",
    level: str = "module",
    *,
    step: int = 0,
    order: int = 0,
    shape: tuple[int, ...] = (2, 3),
    dtype: str = "float32",
    module_type: str | None = None,
    rank: int = 0,
    has_data: bool = True,
    stats: dict | None = None,
) -> Entry:
    return Entry(
        step=step,
        rank=rank,
        name=name,
        kind=kind,
        index=index,
        level=level,
        order=order,
        dtype=dtype,
        shape=shape,
        module_type=module_type,
        has_data=has_data,
        stats=stats,
        key=f"{step}:{name}:{kind}:{index}",
    )


class MemoryDump(DumpReader):
    """A dump held in memory: ``tensors[key]`` for each entry's key (picklable)."""

    format = "memory"

    def __init__(self, entries: list[Entry], tensors: dict[str, torch.Tensor], path: str = "memory"):
        super().__init__(path)
        self._entries = sorted(entries, key=lambda e: (e.rank, e.step, e.order))
        self.tensors = tensors

    @classmethod
    def detect(cls, path: Path) -> bool:
        return False

    def entries(self) -> list[Entry]:
        return self._entries

    def load(self, entry: Entry) -> torch.Tensor:
        return self.tensors[entry.key]


def write_dump(path: Path, steps: dict[int, list[Item]], *, rank: int = 0, data_mode: str = "tensor") -> Path:
    """A real llmflow dump: one data file per step, entries in the given (execution) order."""
    w = DumpDirWriter(path, rank=rank, meta={"data_mode": data_mode})
    for step, items in steps.items():
        tensors: dict[str, torch.Tensor] = {}
        entries: list[Entry] = []
        for order, (name, kind, index, level, mtype, t) in enumerate(items):
            key = str(order)
            e = Entry(
                step=step,
                rank=rank,
                name=name,
                kind=kind,
                index=index,
                level=level,
                order=order,
                dtype=str(t.dtype).removeprefix("torch."),
                shape=tuple(t.shape),
                module_type=mtype,
                key=key,
            )
            if data_mode == "statistics":
                x = t.double()
                e.has_data = False
                e.key = ""
                e.stats = {
                    "max": float(x.max()),
                    "min": float(x.min()),
                    "mean": float(x.mean()),
                    "norm": float(x.norm()),
                    "nan": int(x.isnan().sum()),
                    "inf": int(x.isinf().sum()),
                }
            else:
                tensors[key] = t.contiguous()
            entries.append(e)
        w.write_batch(tensors, entries)
    w.close()
    return path


def model_items(
    n_layers: int = 4,
    hidden: int = 16,
    tokens: int = 5,
    *,
    seed: int = 0,
    dtype=torch.float32,
    fault: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    noise: float = 0.0,
    logits: bool = True,
) -> list[Item]:
    """A fake decoder's module outputs (Hugging Face names), deterministic per seed.

    ``noise`` adds relative noise everywhere (a lower-precision target), ``fault(layer, x)`` may
    change one layer's output (and, through the residual, every later one).
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, hidden, generator=gen)
    items: list[Item] = [("model.embed_tokens", "output", "0", "module", "Embedding", x)]
    noise_gen = torch.Generator().manual_seed(seed + 1000)
    for i in range(n_layers):
        w = torch.randn(hidden, hidden, generator=gen) / hidden**0.5
        attn = torch.tanh(x @ w)
        mlp = torch.relu(attn @ w.T)
        out = x + attn + mlp
        if fault is not None:
            out = fault(i, out)
        if noise:
            out = out * (1 + noise * torch.randn(out.shape, generator=noise_gen))
        items += [
            (f"model.layers.{i}.self_attn", "output", "0", "module", "LlamaAttention", attn),
            (f"model.layers.{i}.mlp", "output", "0", "module", "LlamaMLP", mlp),
            (f"model.layers.{i}", "output", "0", "module", "LlamaDecoderLayer", out),
        ]
        x = out
    if logits:
        head = torch.randn(hidden, 50, generator=gen)
        items.append(("logits", "output", "0", "logits", None, (x[:, -1] @ head)))
    return [(n, k, i, lv, mt, t.to(dtype)) for n, k, i, lv, mt, t in items]


def as_dump(tmp: Path, name: str, steps: Iterable[int] = (0, 1), **kwargs: Any) -> Path:
    """A synthetic model dump with the same items at each step (seeded by step)."""
    return write_dump(tmp / name, {s: model_items(seed=s, **kwargs) for s in steps})


def reader(path: Path) -> LlmflowDumpReader:
    return LlmflowDumpReader(path)
