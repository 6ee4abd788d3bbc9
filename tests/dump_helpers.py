"""Shared helpers of the dump tests: a tiny model built once per process, and dump shortcuts."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from llmflow.dump import DumpConfig, dump_run
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
