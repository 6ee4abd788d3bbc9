"""One API call read back from a dump, as every precheck reader builds it (``precheck`` for
llmflow's API dumps, ``precheck_msprobe`` for msprobe's): the record, its API's name, its outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from llmflow.formats.base import DumpReader, Entry


@dataclass
class OpCall:
    """One API call read back from a dump: its arguments rebuilt, its recorded outputs."""

    name: str
    api: str
    rank: int
    step: int
    order: int
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    reason: str | None = None  # why it cannot be checked
    function: str | None = None  # the torch callable the dump names ("Tensor.__rsub__"), if it does
    record: str | None = None  # the call's name in the dump's own files (msprobe's dump.json key)
    parent: str | None = None  # the module or graph operation that ran it, where ``name`` has no "/"

    @property
    def module(self) -> str:
        return self.parent if self.parent is not None else self.name.rsplit("/", 1)[0]


def load_outputs(call: OpCall, outputs: list[Entry], reader: DumpReader, missing: str) -> None:
    """The call's recorded output tensors; ``missing`` is its reason when there are none."""
    for e in outputs:
        if e.is_tensor and e.has_data:
            call.outputs[e.index] = reader.load(e)
    if not call.outputs:
        call.reason = missing
