"""Copies of a tensor as it is at capture time, for the dump's writer.

A dump must hold what a call saw, even though later in-place ops may change the tensor: the
session copies every tensor it keeps at capture, on the tensor's device for statistics
(``device_copy``) or to the host for its bytes (``host_copy``), and uses the in-place version
counter (``t._version``, which an inference tensor lacks) to tell an unchanged tensor seen again
from a changed one.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


def device_copy(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A copy of ``t`` on its own device, plus an event the writer waits on.

    ``clone()`` keeps a dense tensor's strides (a transposed view stays transposed) and makes
    anything else contiguous: ~0.6 us a call less than asking for contiguous memory, on ~1000
    calls a step; the writer's consumers (``torch.stack``, ``write_safetensors``) take any strides.
    """
    copy = t.clone()
    if t.is_cpu:  # not t.device.type: that builds a device object per call (~2% of a dump)
        return copy, None
    event = getattr(torch, t.device.type).Event()
    event.record()
    return copy, event


def host_copy(t: torch.Tensor) -> tuple[torch.Tensor | bytes, Any]:
    """The bytes of ``t`` as of now, for its data file, plus an event to wait on before reading.

    A plain contiguous CPU tensor comes back as ``bytes``: its memory in order, which is exactly
    what the data file stores (``write_safetensors``). That is one copy with no tensor object
    made: ~1 us a call less than ``clone``, and nothing the garbage collector tracks while the
    writer holds a second of them for its next data file (see ``llmflow.dump.writer``).
    Other CPU tensors are cloned (the writer makes them contiguous). On an accelerator the copy is
    a non-blocking one into pinned memory queued on the current stream, so the forward pass does
    not wait for it; kernels queued later (in-place ops included) run after the copy, which keeps
    the dump bit-identical.
    """
    if t.is_cpu:
        # (the memory of a lazily negated or conjugated view is not its values: those are cloned)
        if type(t) is torch.Tensor and t.layout is torch.strided and t.is_contiguous() \
                and not (t.is_neg() or t.is_conj()):
            nbytes = t.nbytes
            return (ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""), None
        return t.clone(), None
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=True)
    backend = getattr(torch, t.device.type)
    event = backend.Event()
    event.record()
    return buf, event
