"""Helpers of the checks tests (weight-compare, overflow-scan, env-check).

* ``FakeDump``: an in-memory ``DumpReader`` built call by call, in execution order.
* ``real_dump``: a real llmflow dump of a tiny Llama (optionally patched).
* ``overflow_up_proj`` / ``nan_o_proj``: model patches (also usable as ``file.py:callable``).
* ``quantize`` helpers and ``write_sharded``: msModelSlim-style checkpoints with known scales.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmflow.formats.base import DumpReader, Entry
from llmflow.stages.base import StageContext

TINY = "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"
OVERFLOW_MODULE = "model.layers.1.mlp.up_proj"
NAN_MODULE = "model.layers.0.self_attn.o_proj"


class FakeDump(DumpReader):
    """A dump held in memory. ``call(name, inputs, outputs)`` records one call's entries (inputs
    first); ``enter``/``exit`` record a parent's inputs and outputs around its children."""

    format = "fake"

    def __init__(self, path: str | Path = "fake"):
        super().__init__(path)
        self._entries: list[Entry] = []
        self._data: dict[str, torch.Tensor] = {}
        self._order: dict[tuple[int, int], int] = {}
        self.step, self.rank = 0, 0

    @classmethod
    def detect(cls, path: Path) -> bool:
        return False

    def at(self, step: int, rank: int = 0) -> FakeDump:
        self.step, self.rank = step, rank
        return self

    def _add(self, name: str, kind: str, values: list[Any], level: str, stats: bool) -> None:
        for i, v in enumerate(values):
            order = self._order.get((self.rank, self.step), 0)
            self._order[(self.rank, self.step)] = order + 1
            key = f"{len(self._entries)}"
            t = torch.as_tensor(v)
            st = None
            if stats:
                x = t.float()
                fin = x[torch.isfinite(x)]
                st = {"max": float(fin.max()) if fin.numel() else float("nan"),
                      "min": float(fin.min()) if fin.numel() else float("nan"),
                      "mean": float(x.mean()), "norm": float(x.norm()),
                      "nan": float(torch.isnan(x).sum()), "inf": float(torch.isinf(x).sum())}
            self._entries.append(Entry(self.step, self.rank, name, kind, str(i), level, order,
                                       dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                                       stats=st, has_data=not stats, key=key))
            if not stats:
                self._data[key] = t

    def enter(self, name: str, *inputs: Any, level: str = "module", stats: bool = False) -> FakeDump:
        self._add(name, "input", list(inputs), level, stats)
        return self

    def exit(self, name: str, *outputs: Any, level: str = "module", stats: bool = False) -> FakeDump:
        self._add(name, "output", list(outputs), level, stats)
        return self

    def call(self, name: str, inputs: list[Any], outputs: list[Any], **kw: Any) -> FakeDump:
        return self.enter(name, *inputs, **kw).exit(name, *outputs, **kw)

    def entries(self) -> list[Entry]:
        return sorted(self._entries, key=lambda e: (e.rank, e.step, e.order))

    def load(self, entry: Entry) -> torch.Tensor:
        return self._data[entry.key]


def ctx(tmp: Path, params: dict[str, Any], stage_id: str = "stage") -> StageContext:
    """A StageContext for calling a stage directly."""
    out = tmp / stage_id
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(stage_id=stage_id, params=params, out_dir=out, final_dir=out, run_dir=tmp,
                        workflow_dir=tmp, inputs={}, log=lambda _msg: None)


# -- real dumps --------------------------------------------------------------------------------
def overflow_up_proj(model: torch.nn.Module) -> None:
    """Scale one Linear so its fp16 output passes 65504 (weights stay below it)."""
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(5e5)


def nan_o_proj(model: torch.nn.Module) -> None:
    """Put a NaN into one module's output, every call."""

    def hook(_m: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[..., 3] = float("nan")
        return out

    model.model.layers[0].self_attn.o_proj.register_forward_hook(hook)


def real_dump(tmp: Path, *, dtype: str = "float32", patch: Any = None, new_tokens: int = 2,
              name: str = "dump", **config: Any) -> Path:
    """Dump a greedy run of the tiny Llama (after ``patch(model)``) into ``tmp / name``."""
    from llmflow.dump import DumpConfig, dump_run
    from llmflow.models import load_model

    loaded = load_model(TINY, dtype=dtype)
    if patch is not None:
        patch(loaded.model)
    ids = loaded.tokenizer.encode("hi there")
    config.setdefault("token_range", "all")
    dump_run(loaded, ids, new_tokens, DumpConfig(dump_path=str(tmp / name), **config))
    return tmp / name


# -- quantized checkpoints ---------------------------------------------------------------------
def quant_per_channel(w: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 per output channel: (int8 weight, scale [out, 1], offset [out, 1])."""
    scale = w.abs().amax(dim=1, keepdim=True) / (127 - abs(offset))
    q = torch.clamp(torch.round(w / scale) + offset, -128, 127).to(torch.int8)
    return q, scale, torch.full_like(scale, float(offset))


def quant_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max() / 127
    return torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8), scale.reshape(1)


def quant_int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed int4 per group along the input dim: (values in int8 [-8, 7], scale [out, n_groups])."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    scale = g.abs().amax(dim=2) / 7
    q = torch.clamp(torch.round(g / scale.unsqueeze(2)), -8, 7).to(torch.int8)
    return q.reshape(out_f, in_f), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two signed int4 per byte, low nibble first (the inverse of quantized.unpack_int4)."""
    u = (q.to(torch.int16) & 0xF).reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    return (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8).view(torch.int8)


def write_sharded(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 2,
                  stem: str = "model") -> Path:
    """Save ``tensors`` in ``shards`` safetensors files plus ``<stem>.safetensors.index.json``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(folder / fname))
        weight_map.update({k: fname for k in part})
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder
