"""What a localisation costs, against what the brute-force way would have cost.

The brute-force way is msit's: an API-level dump of every op's inputs and outputs on both sides,
for every generated token, then compare everything. ``estimate_api_dump_bytes`` measures what
that would write for one model without writing it: it runs the prefill and one decode step with
the dump's recorder sending its op calls to a byte counter (the dump's own API naming and walk
decide what counts) and extrapolates
the decode step over the remaining tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmflow.dump.recorder import Recorder, Sink, walk_inputs, walk_output


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


class _ByteCounter(Sink):
    """A recorder sink counting what the dump's API mode writes: tensor inputs and outputs of every
    recorded op, each tensor once per step (the dump stores a tensor handed to several ops once),
    weights (``nn.Parameter``) not at all (the dump records their shape only)."""

    def __init__(self) -> None:
        self.active = False  # inside the model's forward (the dump records nothing between steps)
        self.per_step: list[int] = []
        self.seen: list[torch.Tensor] = []  # kept alive so ids stay unique within a step
        self.ids: set[int] = set()

    def begin_step(self, step: int) -> None:
        self.per_step.append(0)
        self.seen.clear()
        self.ids.clear()
        self.active = True

    def end_step(self, step: int, output: Any, error: str | None, raised_in: str | None) -> None:
        self.active = False

    def op_inputs(self, name: str, api: str, func: Any, args: tuple, kwargs: dict) -> None:
        walk_inputs(self, name, "input", args, kwargs, "api", api, tensors_only=True)

    def op_output(self, name: str, api: str, func: Any, output: Any) -> None:
        walk_output(self, name, output, "api", api, tensors_only=True)

    def tensor(self, name: str, kind: str, index: str, t: torch.Tensor, level: str,
               mtype: str | None) -> None:
        if id(t) not in self.ids:
            self.ids.add(id(t))
            self.seen.append(t)
            self.per_step[-1] += t.numel() * t.element_size()

    def other(self, *_a: Any) -> None: ...  # parameters and plain values: no tensor bytes


@torch.no_grad()
def estimate_api_dump_bytes(model: nn.Module, input_ids: list[int], new_tokens: int) -> dict[str, Any]:
    """Bytes an API-level dump (inputs + outputs of every op) of ``new_tokens`` greedy steps would
    write: prefill measured, one decode step measured, the rest extrapolated from it."""
    from llmflow.models import greedy_generate

    counter = _ByteCounter()
    recorder = Recorder(model, lambda _n, _m: False, ops=True, sink=counter, steps=True)
    try:
        greedy_generate(model, input_ids, min(2, max(1, new_tokens)))
    finally:
        recorder.remove()
    steps = counter.per_step[:2] or [0]
    decode = steps[1] if len(steps) > 1 else steps[0] / max(len(input_ids), 1)
    total = int(steps[0] + decode * max(new_tokens - 1, 0))
    return {"prefill_bytes": int(steps[0]), "decode_step_bytes": int(decode), "total_bytes": total}
