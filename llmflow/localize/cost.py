"""What a localisation costs, against what the brute-force way would have cost.

The brute-force way is msit's: an API-level dump of every op's inputs and outputs on both sides,
for every generated token, then compare everything. ``estimate_api_dump_bytes`` measures what
that would write for one model without writing it: it runs the prefill and one decode step under
a counting ``TorchFunctionMode`` (the dump's own API naming decides what counts) and extrapolates
the decode step over the remaining tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from llmflow.dump.api import api_name


def dir_bytes(path: str | Path | None) -> int:
    """Total size of the files under ``path`` (0 when it does not exist)."""
    if not path or not Path(path).exists():
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


class _ByteCounter(TorchFunctionMode):
    """Counts what the dump's API mode writes: tensor inputs and outputs of every recorded op,
    each tensor once per step (the dump stores a tensor handed to several ops once), weights
    (``nn.Parameter``) not at all (the dump records their shape only)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_step: list[int] = []
        self.seen: list[torch.Tensor] = []  # kept alive so ids stay unique within a step
        self.ids: set[int] = set()

    def new_step(self) -> None:
        self.per_step.append(0)
        self.seen.clear()
        self.ids.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if api_name(func) is not None and self.per_step:
            for x in tree_flatten((args, kwargs, out))[0]:
                if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter) and id(x) not in self.ids:
                    self.ids.add(id(x))
                    self.seen.append(x)
                    self.per_step[-1] += x.numel() * x.element_size()
        return out


@torch.no_grad()
def estimate_api_dump_bytes(model: nn.Module, input_ids: list[int], new_tokens: int) -> dict[str, Any]:
    """Bytes an API-level dump (inputs + outputs of every op) of ``new_tokens`` greedy steps would
    write: prefill measured, one decode step measured, the rest extrapolated from it."""
    from llmflow.models import greedy_generate

    counter = _ByteCounter()
    handle = model.register_forward_pre_hook(lambda *_a: counter.new_step())
    try:
        with counter:
            greedy_generate(model, input_ids, min(2, max(1, new_tokens)))
    finally:
        handle.remove()
    steps = counter.per_step[:2] or [0]
    decode = steps[1] if len(steps) > 1 else steps[0] / max(len(input_ids), 1)
    total = int(steps[0] + decode * max(new_tokens - 1, 0))
    return {"prefill_bytes": int(steps[0]), "decode_step_bytes": int(decode), "total_bytes": total}
