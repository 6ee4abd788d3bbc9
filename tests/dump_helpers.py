"""Shared helpers of the dump tests: a tiny model built once per process, and dump shortcuts."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from llmflow.dump import DumpConfig, dump_run, register_hook
from llmflow.formats.base import Entry
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.models import LoadedModel, encode_prompt, load_model

TINY = "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"


@lru_cache(maxsize=4)
def tiny(spec: str = TINY, dtype: str = "float32") -> LoadedModel:
    """A tiny seeded Llama (cached: tests must not modify it)."""
    return load_model(spec, dtype=dtype)


def prompt_ids(text: str = "hello world") -> list[int]:
    return encode_prompt(tiny().tokenizer, text)


def dump(tmp: Path, new_tokens: int = 3, ids: list[int] | None = None, loaded: LoadedModel | None = None,
         **config: Any) -> tuple[LlmflowDumpReader, list[int]]:
    """Dump a greedy run of the tiny model into ``tmp / "dump"``; returns (reader, new ids)."""
    config.setdefault("token_range", "all")
    out = dump_run(loaded or tiny(), ids or prompt_ids(), new_tokens,
                   DumpConfig(dump_path=str(tmp / "dump"), **config))
    return LlmflowDumpReader(tmp / "dump"), out


def by_name(entries: list[Entry], **match: Any) -> list[Entry]:
    """Entries whose fields equal every keyword given."""
    return [e for e in entries if all(getattr(e, k) == v for k, v in match.items())]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs included), dtype and shape too."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.is_floating_point():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.view(width), b.view(width)))
    return bool(torch.equal(a, b))


def assert_copies_taken_at_capture(dump_path: Path, x: torch.Tensor, additions: int = 1,
                                   amount: float = 1000.0) -> None:
    """Dump a model that changes values in place after a submodule saw them (``additions`` adds of
    ``amount`` to the submodule's output, then its own input zeroed): the dump must hold the bits
    as they were at capture. On an accelerator, many adds queue enough work after the capture that
    a copy not ordered before them would see it."""
    class Double(torch.nn.Module):
        def forward(self, v):
            return v * 2

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Double()
            self.after = Double()

        def forward(self, v):
            y = self.inner(v)
            for _ in range(additions):  # in place, after 'inner' returned it
                y.add_(amount)
            v.mul_(0)
            return self.after(y)

    orig = x.to("cpu", copy=True)  # (x.cpu() is x itself on the CPU)
    model = Outer()
    h = register_hook(model, DumpConfig(dump_path=str(dump_path)))
    model(x)
    h.remove()
    r = LlmflowDumpReader(h.dumps[0])
    got = {(e.name, e.kind): r.load(e) for e in r.entries() if e.has_data}
    assert bits_equal(got[("inner", "input")], orig)
    assert bits_equal(got[("inner", "output")], orig * 2)
    want = orig * 2
    for _ in range(additions):  # the same roundings as the model's: one add at a time
        want.add_(amount)
    assert bits_equal(got[("after", "input")], want)  # a new version: not a stale repeat
