"""Copies of a tensor as it is at capture time, for the dump's writer, or the tensor itself.

A dump must hold what a call saw, even though later in-place ops may change the tensor: the
session copies every tensor it keeps at capture, on the tensor's device for statistics
(``device_copy``) or to the host for its bytes (``host_copy``), and uses the in-place version
counter (``t._version``, which an inference tensor lacks) to tell an unchanged tensor seen again
from a changed one. On CUDA, where nothing changes the model's tensors after their capture, the
writer reads the tensors themselves instead (``TensorKeeper``, below).

A copy on an accelerator is only queued when the forward thread moves on. On CUDA the copy comes
back with its stream (``StreamKey``) rather than an event: the writer records one event per stream
(``fence``) at each step end and reads the step's copies once it has passed, since every copy was
queued on its stream before that event. An event created and recorded per tensor cost the forward
thread ~14 us a tensor on an H100, the stream's key 0.4 us. Other accelerators keep an event per
copy.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from llmflow.errors import UserError

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


def local_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor subclass as the plain tensor this process holds of it: a ``DTensor`` (transformers'
    tensor and expert parallelism, FSDP) as its local shard, the rank's own, as a Megatron-style
    port's ranks hold theirs (the compare and the bisect join the ranks' shards by their shapes;
    gathering the whole would be a collective inside a hook); another subclass that has plain
    storage under it as that. None where nothing plain can be had (a wrapper subclass without
    storage of its own: a quantized tensor type, say)."""
    for _ in range(4):  # (a DTensor's local tensor may itself be a wrapper: unwrap a few levels)
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            return t
        to_local = getattr(t, "to_local", None)
        if callable(to_local):
            t = to_local()
            continue
        wait = getattr(t, "trigger_wait", None)  # an async collective's result: wait for it
        if callable(wait):
            t = wait()
            continue
        break
    try:
        plain = t.as_subclass(torch.Tensor)
        # a wrapper subclass has no storage of its own (this raises), or dispatches the alias back
        # to itself (a plain tensor is not what comes back)
        if type(plain) is not torch.Tensor:
            return None
        plain.untyped_storage().data_ptr()
    except Exception:  # (whatever a subclass's own dispatch raises: the dump must not fail the forward)
        return None
    return plain


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


# -- holding a tensor instead of copying it ----------------------------------------------------
#
# The copy at capture is most of what a module dump costs a model on a GPU (~11 us a clone, ~16
# us a pinned buffer and its copy, against ~0.3 us to hold a reference and its version counter,
# on an H100; ~430 tensors a decode step of SmolLM2's shapes). A tensor that nothing changes
# before the writer reads it needs no copy: the writer can read the tensor itself. Whether
# anything does is the model's business, so ``TensorKeeper`` finds out before it holds anything:
#
# * learning: the first ``LEARNING_STEPS`` steps that capture a CUDA tensor copy every tensor as
#   before and also hand the writer the tensor itself with its version (``Checked``); when the
#   writer reads the copies it checks that each tensor still has its version counter and the
#   copy's values. A tensor changed in place after its capture (a ``+=`` on a layer's output, an
#   in-place activation, an op's input in an API dump) or written behind torch's back (a
#   collective, a kernel writing through a raw pointer: the values differ, the version not) sends
#   the keeper to copying for the rest of the dump;
# * holding: the tensor itself, read by the writer at its next flush, in the forward thread
#   (``inline``: with a writer thread, an in-place op could be queued between the writer's
#   version check and its read), after checking its version counter. A tensor found changed is
#   recorded as not stored (never a value it did not have at capture), and the keeper copies from
#   then on.
#
# Held tensors stay alive until the writer's next flush, as their copies would have: the writer's
# byte limits bound both. Holding is for CUDA tensors on the default stream (a copy on a side
# stream keeps its copy and fence), with one process per dump (collectives write in place without
# the version counter), and ``LLMFLOW_DUMP_COPIES=always`` turns it off.

LEARNING_STEPS = 2  # a prefill step and a decode step: the two code paths of generation
HOLD_CPU = False  # CUDA tensors are held; tests hold CPU tensors too, to run the writer's side


class Checked:
    """A learning step's copy's marker for the writer: what to wait on (``after``) and the
    tensor itself with its version at capture, to check the copy against when it is read."""

    __slots__ = ("after", "original", "version")

    def __init__(self, after: Any, original: torch.Tensor, version: int):
        self.after, self.original, self.version = after, original, version


def copies_setting() -> str:
    """``LLMFLOW_DUMP_COPIES``: ``auto`` (hold tensors where the learning steps allow) or
    ``always`` (copy every tensor at capture)."""
    choice = os.environ.get("LLMFLOW_DUMP_COPIES", "auto").strip().lower() or "auto"
    if choice not in ("auto", "always"):
        raise UserError(f"LLMFLOW_DUMP_COPIES: expected 'auto' or 'always', got {choice!r}")
    return choice


class TensorKeeper:
    """What the capture hands the writer for a tensor it does not reduce itself: a copy (``copy``,
    ``device_copy`` or ``host_copy``), or the tensor itself (see above). ``keep`` is the capture's
    ``copy``; the writer reports what it found with ``found_changed`` and ``step_checked``."""

    def __init__(self, copy: Callable[[torch.Tensor], tuple[Any, Any]], may_hold: bool):
        self.copy = copy
        self.may_hold = may_hold
        self.learning = may_hold  # copying, and checking what holding would have read
        self.holding = False
        self.learned_steps = 0
        self.why_copying: str | None = None if may_hold else "holding is off for this dump"

    def keep(self, t: torch.Tensor) -> tuple[Any, Any]:
        """(payload, event) for the writer: a copy and what to wait on (``copies``), a copy and a
        ``Checked`` while learning, or the tensor itself and its version counter (an int)."""
        if (self.holding or self.learning) and (t.is_cuda or (HOLD_CPU and t.is_cpu)):
            try:
                version = t._version
            except RuntimeError:  # an inference tensor has no version counter: copied
                return self.copy(t)
            if not t.is_cuda or torch._C._cuda_getCurrentStream(t.get_device())[0] == 0:
                if self.holding:
                    return t, version
                payload, after = self.copy(t)
                return payload, Checked(after, t, version)
        return self.copy(t)

    def step_checked(self) -> None:
        """A step's copies were all checked and held nothing back from holding."""
        if self.learning:
            self.learned_steps += 1
            if self.learned_steps >= LEARNING_STEPS:
                self.learning, self.holding = False, True

    def found_changed(self, why: str) -> None:
        """A tensor changed after its capture: copy every tensor from now on."""
        if self.why_copying is None:
            self.why_copying = why
        self.learning = self.holding = False


def to_host(tensors: list[torch.Tensor]) -> list[memoryview]:
    """The bytes of held ``tensors`` as the data file stores them (each tensor's values in order),
    in order: the tensors of one device and dtype flattened into one tensor there by one call
    (torch's ``flatten_dense_tensors``, in C++: no Python step per tensor) and brought over in one
    transfer (one wait for the device, not one per tensor), read after every kernel queued so far
    on their device's default stream, where holding takes them (``TensorKeeper.keep``)."""
    out: list[memoryview | None] = [None] * len(tensors)
    groups: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.get_device(), t.dtype), []).append(i)
    after_default_streams(tensors)
    for idx in groups.values():
        flat = torch._utils._flatten_dense_tensors([tensors[i] for i in idx]).cpu()
        raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        at = 0
        for i in idx:
            n = tensors[i].nbytes
            out[i] = raw[at:at + n]
            at += n
    return out  # type: ignore[return-value]


def after_default_streams(tensors: Iterable[torch.Tensor]) -> None:
    """Make each CUDA device's current stream wait for its default stream, where they differ and
    ``tensors`` (held ones) live: the writer reads held tensors on the current stream, and
    holding takes only tensors made on the default one. A read that ends in a transfer to the
    host (``tolist``, ``cpu``) then has nothing left to race with."""
    for device in {t.get_device() for t in tensors if t.is_cuda}:
        if torch._C._cuda_getCurrentStream(device)[0] != 0:
            torch.cuda.current_stream(device).wait_stream(torch.cuda.default_stream(device))

