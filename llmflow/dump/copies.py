"""Copies of a tensor as it is at capture time, for the dump's writer.

A dump must hold what a call saw, even though later in-place ops may change the tensor: the
session copies every tensor it keeps at capture, on the tensor's device for statistics
(``device_copy``) or to the host for its bytes (``host_copy``), and uses the in-place version
counter (``t._version``, which an inference tensor lacks) to tell an unchanged tensor seen again
from a changed one.

A copy on an accelerator is only queued when the forward thread moves on. On CUDA the copy comes
back with its stream (``StreamKey``) rather than an event: the writer records one event per stream
(``fence``) at each step end and reads the step's copies once it has passed, since every copy was
queued on its stream before that event. An event created and recorded per tensor cost the forward
thread ~14 us a tensor on an H100, the stream's key 0.4 us. Other accelerators keep an event per
copy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

import torch

#: a CUDA stream as torch names it, without making a stream object: (stream id, device index,
#: device type), what ``torch.cuda.current_stream`` builds its ``Stream`` from
StreamKey = tuple[int, int, int]


def _after_copy(t: torch.Tensor) -> Any:
    """What the writer waits on before reading a copy of ``t`` just queued on its device: the
    current stream's key on CUDA (see ``fence``), an event recorded now elsewhere."""
    if t.is_cuda:  # the copy ran on the current stream of the tensor's device
        return torch._C._cuda_getCurrentStream(t.get_device())
    event = getattr(torch, t.device.type).Event()
    event.record()
    return event


def fence(streams: Iterable[StreamKey]) -> list[Any]:
    """One event recorded now on each of ``streams``: once they have passed, every copy queued on
    those streams before this call has landed."""
    events = []
    for stream_id, device_index, device_type in streams:
        event = torch.cuda.Event()
        event.record(torch.cuda.Stream(stream_id=stream_id, device_index=device_index,
                                       device_type=device_type))
        events.append(event)
    return events


def device_copy(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A copy of ``t`` on its own device, plus what the writer waits on (None on the CPU, see
    ``_after_copy``).

    ``clone()`` keeps a dense tensor's strides (a transposed view stays transposed) and makes
    anything else contiguous: ~0.6 us a call less than asking for contiguous memory, on ~1000
    calls a step; the writer's consumers (``torch.stack``, ``write_safetensors``) take any strides.
    """
    copy = t.clone()
    if t.is_cpu:  # not t.device.type: that builds a device object per call (~2% of a dump)
        return copy, None
    return copy, _after_copy(t)


def host_copy(t: torch.Tensor) -> tuple[torch.Tensor | bytes, Any]:
    """The bytes of ``t`` as of now, for its data file, plus what to wait on before reading them
    (None on the CPU, see ``_after_copy``).

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
    return buf, _after_copy(t)
