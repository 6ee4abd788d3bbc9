"""One dump being written: step bookkeeping, what to keep, and faithful copies of tensors.

A ``DumpSession`` is one dump directory (one dialogue turn) and the recorder's disk sink
(``recorder.py``): the recorder hands it every module and op call it sees; the session decides
whether the current step is dumped, turns the leaves of the recorder's walk into index rows
(``IndexRow``: this file alone builds them), copies each
tensor *at capture time* (so later in-place ops cannot change the dump) and hands it to the
background writer. Copies to the host are non-blocking on accelerators. In statistics mode, CPU tensors
(float and integer) get their statistics at capture from a compiled kernel (no copy); other
tensors are copied on their device and reduced there by the writer (see ``stats.py``).

A dump is finished (``complete: true``) however the user's process ends normally: ``close()``
(``handle.remove()``), the model being garbage-collected, or the interpreter exiting (msit's
quick start never removes its hook): a ``weakref.finalize`` on the model does all three. A step
whose forward raised keeps what it captured before the exception, and the exception is written
to ``rank.json`` (``errors``) at once; the reader reports it among the dump's problems.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from pathlib import Path
from typing import Any

import torch

from llmflow import native
from llmflow.collector import defer_young_collections, resume_young_collections
from llmflow.dtypes import dtype_name
from llmflow.dump import copies, tensor_meta
from llmflow.dump.api import use_compiled_dispatch
from llmflow.dump.config import DumpConfig
from llmflow.dump.copies import TensorKeeper, device_copy, host_copy, local_tensor
from llmflow.dump.recorder import Sink, use_compiled_forward, walk_inputs, walk_output
from llmflow.dump.stats import KERNEL_DTYPES, CpuStats
from llmflow.dump.topology import module_tree
from llmflow.dump.writer import AsyncWriter
from llmflow.errors import UserError
from llmflow.formats.llmflow_dump import (
    ROW_FIELDS,
    SAFETENSORS_DTYPES,
    DumpDirWriter,
    IndexRow,
    finite_row,
    new_row,
)
from llmflow.formats.llmflow_layout import ENV_FILE, TOPOLOGY_FILE
from llmflow.models import logits_of

log = logging.getLogger("llmflow.dump")
_SIMPLE = (type(None), bool, int, float, str)
# the exact types of the values written as they are, and their ``pytype`` (a subclass, an IntEnum
# say, takes the general path)
_PLAIN_TYPE_NAMES = {t: t.__name__ for t in (type(None), bool, int, float)}
# torch values recorded by name ("torch.float32", "cpu"): ``dump.arguments.decode_value`` reads them back
_NAMED_VALUES = (torch.dtype, torch.device, torch.memory_format, torch.layout)
# the values whose rows only ``_other`` makes (the compiled capture writes any other value, a
# model's cache object say, as its type's name)
_OTHER_IN_PYTHON = _SIMPLE + _NAMED_VALUES + (torch.Tensor, tuple, list)
_STATS_ENTRY_BYTES = 256  # what a statistics-only entry costs on disk, roughly (index line)


def current_rank() -> int:
    """torch.distributed's rank when initialised, else $RANK / $LOCAL_RANK, else 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def world_size() -> int:
    """torch.distributed's world size when initialised, else $WORLD_SIZE, else 1."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    size = os.environ.get("WORLD_SIZE", "")
    return int(size) if size.isdigit() else 1


class _NoRepeats(dict):
    """The repeat table of a distributed run, which remembers nothing: every capture is copied.

    A repeat is recognised as the same tensor object with the same version counter, but
    collectives (``all_reduce``, ``broadcast``, ``reduce_scatter``) rewrite a tensor in place
    without bumping its version: a row-parallel linear's output, captured before its all-reduce
    and again after it, would be indexed as unchanged and keep its partial sum."""

    def __setitem__(self, key: int, value: Any) -> None:
        return None


def _holds_on(model: torch.nn.Module) -> bool:
    """Does ``model`` compute where the dump may hold tensors instead of copying them (CUDA)?"""
    p = next(model.parameters(), None)
    return p is not None and (p.is_cuda or (copies.HOLD_CPU and p.is_cpu))


def inline_writer(model: torch.nn.Module) -> bool:
    """Should the dump's writing run in the forward thread (at step ends) rather than a thread?

    A writer thread overlaps writing with the forward pass only where it has a core to itself
    and little Python to run. A model computing on the CPU with torch's threads on every core
    gives it no core: the thread then preempts one of torch's OpenMP threads (every parallel
    region waits for it) and contends for the GIL: on 2 cores SmolLM2's tensor-module dump
    measured 1.56x with the thread against 1.37x inline, the tiny model's API dumps 3.05x against
    2.53x. A model on an accelerator whose steps are launch-bound (decode steps of models the
    size measured) keeps its forward thread running Python all the time, and the thread's
    statistics and copies take the GIL from it: on an H100, SmolLM2's shapes measured 1.73x
    inline against 2.01x with the thread (statistics module), 2.02x against 2.60x (tensor
    module). Only models on fewer CPU threads than cores keep the thread.
    ``LLMFLOW_DUMP_WRITER`` (``thread`` or ``inline``) overrides the choice.
    """
    choice = os.environ.get("LLMFLOW_DUMP_WRITER", "auto").strip().lower() or "auto"
    if choice not in ("auto", "thread", "inline"):
        raise UserError(f"LLMFLOW_DUMP_WRITER: expected 'auto', 'thread' or 'inline', got {choice!r}")
    if choice != "auto":
        return choice == "inline"
    p = next(model.parameters(), None)
    on_cpu = p is None or p.device.type == "cpu"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return not on_cpu or torch.get_num_threads() >= cores


_DTYPE_NAMES = {d: dtype_name(d) for d in SAFETENSORS_DTYPES}
# Every entry is built here positionally, as a tuple display in IndexRow's field order: a row
# that is an index row and nothing more (``_add_row``: most of a statistics dump) stays a plain
# tuple, which the writer encodes as it is (``index_line``); a row the writer reads back by field
# (``writer.submit``: data to write, statistics to compute) becomes an ``IndexRow`` through
# ``new_row(IndexRow, (...))`` (see IndexRow). The field order is checked once here, so that a
# change to the row fails loudly at import instead of writing shifted columns.
_ROW_ORDER = ("step", "name", "kind", "index", "level", "order", "dtype", "shape", "module_type",
              "stats", "has_data", "value", "pytype", "key", "extra")
if ROW_FIELDS != _ROW_ORDER:
    raise ImportError(f"llmflow.dump.capture: IndexRow's fields ({ROW_FIELDS}) changed; update the "
                      "rows DumpSession builds")
_NO_EXTRA: dict[str, Any] = {}  # shared by the rows nothing writes into (only crc32 rows get their own)

# The walks and the entries of the common leaves in C (``capture.cpp``'s ``Entries``: a repeat, a
# contiguous CPU tensor's statistics or bytes, any other plain tensor's row with its copy from
# ``copies``, a plain value, a Parameter; ~1 us a row against ~3.5 us here, most of an API dump's
# overhead). It is DumpSession's base, holding the counters both
# paths share, and hands every other leaf to ``_tensor`` / ``_other`` below, which define what an
# entry is. Without a compiler or Python headers, or with LLMFLOW_FUSED=0, the methods here do all.
_NATIVE = None if native.disabled() else native.CAPTURE.extension("llmflow_capture")
_ENTRIES_BASE: type = _NATIVE.Entries if _NATIVE is not None else object


class DumpSession(Sink, _ENTRIES_BASE):
    """Writes one dump directory; the hooks drive it step by step."""

    def __init__(self, dump_dir: str | Path, config: DumpConfig, model: torch.nn.Module,
                 env: dict[str, Any] | None = None, inline: bool = False):
        self.config = config
        self.dump_dir = Path(dump_dir)
        self.rank = current_rank()
        self.statistics = config.data_mode == "statistics"
        # (CRC32 needs the bytes: those dumps copy every tensor for the writer)
        cpu_stats = CpuStats.create() if self.statistics and not config.crc32 else None
        # (the kernel, its output and that output's address, each one lookup on the hot path)
        self._stats_kernel, self._stats_out, self._stats_address = \
            (cpu_stats.kernel, cpu_stats.out, cpu_stats.address) if cpu_stats is not None else (None, None, 0)
        disk = DumpDirWriter(self.dump_dir, self.rank,
                             meta={"data_mode": config.data_mode, "config": config.to_json()})
        # (the reader tells this dump's ranks from those an earlier dump of more ranks left here)
        disk.update_rank_meta(world_size=world_size())
        # id(tensor) -> (weakref, version, dtype, shape, has_data, key) of the tensors captured
        # this step
        self._seen: dict[int, tuple[Any, int | None, str, tuple[int, ...], bool, str]] = \
            _NoRepeats() if world_size() > 1 else {}
        # the copies the writer reads, or the tensors themselves where nothing changes them
        # (``copies.TensorKeeper``: read in the forward thread, one process, no CRC32)
        self._keeper = TensorKeeper(
            device_copy if self.statistics else host_copy,
            may_hold=(inline and not config.crc32 and not isinstance(self._seen, _NoRepeats)
                      and copies.copies_setting() == "auto" and _holds_on(model)))
        self._keep = self._keeper.keep if self._keeper.may_hold else self._keeper.copy
        self.writer = AsyncWriter(disk, crc32=config.crc32, inline=inline, keeper=self._keeper)
        self._op_inputs, self._op_outputs = config.tensor_part != 1, config.tensor_part != 0
        # an index row and nothing more, a plain tuple (see above): one whose floats are all finite
        # to add_finite_row (most rows: the writer then encodes a step's rows without looking at
        # each), one that may hold an inf or a NaN to add_row (checked as its line is written)
        self._add_row, self._add_finite_row = self.writer.add_row, self.writer.add_finite_row
        if self.rank == 0 or not (self.dump_dir / TOPOLOGY_FILE).exists():
            disk.write_json(TOPOLOGY_FILE, module_tree(model))
            if env is not None:
                disk.write_json(ENV_FILE, env)
        self.step = -1
        self.active = False  # is the current step dumped?
        self.order = 0
        self.exec_order: list[str] = []
        self.bytes = 0
        self.entries = 0
        self.stopped: str | None = None  # why capture stopped early (max_bytes)
        self.closed = False
        self.in_step = False  # between begin_step and end_step
        # the garbage collector's thresholds before this step raised them (collector), or None
        self._young_threshold: tuple[int, ...] | None = None
        # finishes the dump when the model is garbage-collected or the interpreter exits (the
        # session holds no reference to the model, so this does not keep it alive)
        self._finalizer = weakref.finalize(model, _close_unattended, self)
        # id -> full name of the model's parameters: an op's Parameter argument is recorded by
        # name, so a precheck can load it from the weights a dump_weight dump writes once
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        if _NATIVE is not None:
            kernel = ctypes.cast(self._stats_kernel, ctypes.c_void_p).value if self._stats_kernel else 0
            # (the copies for the writer: a CRC32 row's ``extra`` is a dict of its own, made here)
            copy = None if config.crc32 else self._keep
            self._setup_entries(self._seen, self._add_row, self.writer.submit, _DTYPE_NAMES, KERNEL_DTYPES,
                                _NO_EXTRA, torch.Tensor, torch.nn.Parameter, torch.dtype, IndexRow,
                                torch.strided, self._param_names, torch._C.DisableTorchFunction, copy,
                                kernel or 0, -1 if config.max_bytes is None else config.max_bytes,
                                not isinstance(self._seen, _NoRepeats), self.statistics,
                                # tensor data copied in C (not where CPU tensors are held: tests)
                                not self.statistics and not config.crc32 and not copies.HOLD_CPU,
                                self._op_inputs, self._op_outputs, tensor_meta.address(), _OTHER_IN_PYTHON,
                                self.writer.add_finite_row)
        if config.dump_weight:
            self._write_weights(model)

    # -- steps --------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.in_step = True
        self.step = step
        self.order = 0
        self.exec_order = []
        self._seen.clear()
        self.active = self.stopped is None and self.config.wants_step(self.step)
        if self.active and self._young_threshold is None:  # (its entries live until its end: see collector)
            self._young_threshold = defer_young_collections()

    def end_step(self, step: int, output: Any = None, error: str | None = None,
                 raised_in: str | None = None) -> None:
        """The step's forward returned ``output`` (its logits are recorded), or raised ``error``
        (``"Type: message"``), innermost in module ``raised_in`` when known: the entries captured
        before it stay, the error goes on record."""
        self.in_step = False
        failure = None
        if error is not None:
            failure = {"step": self.step, "error": error[:500], "module": raised_in}
            log.warning("llmflow dump %s: step %d: %s%s; the dump keeps what that step captured "
                        "before it", self.dump_dir, self.step, error[:200],
                        f" (raised in {raised_in})" if raised_in else "")
        elif self.config.logits and output is not None:
            try:
                logits = logits_of(output)
            except TypeError:
                logits = None
            if logits is not None:
                self.record_logits(logits)
        try:
            self.writer.end_step(self.step, self.exec_order if self.active else None, failure)
        finally:
            self.active = False
            resume_young_collections(self._young_threshold)
            self._young_threshold = None

    def close(self, complete: bool = True) -> None:
        """Finish the dump: everything captured reaches disk, then ``complete`` is recorded."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        if self.in_step:  # closed from inside a forward (an exit from a hook, say)
            self.end_step(self.step,
                          error="the step's forward never returned (the dump was closed during it)")
        wanted = self.config.token_range
        if self.step >= 0 and wanted != "all" and not any(s <= self.step for s in wanted):  # type: ignore[union-attr]
            log.warning("llmflow dump %s: token_range %s: the run made steps 0..%d only, so no step of it "
                        "was dumped (the logits of every step are); the prefill is step 0", self.dump_dir,
                        wanted, self.step)
        stop = {"truncated": True, "stop_reason": self.stopped} if self.stopped else {}
        self.writer.close(complete=complete, rank_meta=stop, steps=self.step + 1,
                          truncated=self.stopped is not None, stop_reason=self.stopped)

    # -- the recorder's sink (see recorder.py) ------------------------------------------------
    # (module_inputs, module_output, op_inputs and op_output: in C where it is built, see below)
    def _module_inputs(self, name: str, mtype: str, module: torch.nn.Module, args: tuple,
                       kwargs: dict) -> None:
        walk_inputs(self, name, "input", args, kwargs, "module", mtype)

    def _module_output(self, name: str, mtype: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                       output: Any) -> None:
        walk_output(self, name, output, "module", mtype)

    def wants_op(self, module: str) -> bool:
        return self.config.wants_name(module)

    def _op_inputs_walk(self, name: str, api: str, func: Any, args: tuple, kwargs: dict) -> None:
        if self._op_inputs:
            # scalars too (dim=-1, an eps, a dtype): replaying the call from the dump needs them
            walk_inputs(self, name, "input", args, kwargs, "api", api)

    def _op_output_walk(self, name: str, api: str, func: Any, output: Any) -> None:
        if self._op_outputs:
            walk_output(self, name, output, "api", api, tensors_only=True)

    def record_output(self, name: str, output: Any, level: str, module_type: str | None) -> None:
        """Record ``output`` (a tensor, or nested lists/dicts of them) as ``name``'s output."""
        walk_output(self, name, output, level, module_type)

    def record_logits(self, logits: torch.Tensor) -> None:
        """The last position's logits as float32: ``name="logits"``, level logits, every step."""
        if self.stopped is not None:
            return
        with torch._C.DisableTorchFunction():
            last = logits[:, -1, :] if logits.dim() == 3 else logits
            # full data even in statistics mode: compare and bisect need every step's logits
            self._tensor("logits", "output", "0", last.to(torch.float32), "logits", None, dedup=False,
                         always_data=True)

    # -- index rows (the walk's leaves) -------------------------------------------------------
    def _other(self, name: str, kind: str, index: str, value: Any, level: str,
               module_type: str | None) -> None:
        """A parameter handed to a call (shape, dtype and name only) or a plain value (its JSON
        value; a torch dtype, device or memory format as its name, ``"torch.float32"``)."""
        if self.stopped is not None:
            return
        order = self.order
        self.order = order + 1
        self.entries += 1
        vtype = type(value)
        pytype = _PLAIN_TYPE_NAMES.get(vtype)
        if pytype is not None:  # None, a bool, int or float: most of these (use_cache, dim=-1, eps)
            self._add_index_row((self.step, name, kind, index, level, order, None, None, module_type, None,
                                 False, value, pytype, "", _NO_EXTRA))
        # (the exact type first, then the C-level Tensor check: Parameter's own isinstance is
        # Python code, ~0.3 us, and every plain value would pay it)
        elif vtype is torch.nn.Parameter or (isinstance(value, torch.Tensor)
                                             and isinstance(value, torch.nn.Parameter)):
            # the same every step, so shape and dtype only (dump_weight writes the bytes once)
            extra = {"param_dtype": dtype_name(value.dtype)}
            param = self._param_names.get(id(value))
            if param is not None:
                extra["param"] = param
            self._add_finite_row((self.step, name, kind, index, level, order, None, tuple(value.shape),
                                  module_type, None, False, None, "Parameter", "", extra))
        else:
            pytype = vtype.__name__
            if isinstance(value, _NAMED_VALUES):
                value = str(value)
            simple = isinstance(value, _SIMPLE) and (not isinstance(value, str) or len(value) < 256)
            if isinstance(value, (tuple, list)) and not value:
                # (the walk's only sequence leaves besides those nested too deep: recorded by their
                # length, 0, as an index line's value is a JSON scalar)
                value, simple = 0, True
            self._add_index_row((self.step, name, kind, index, level, order, None, None, module_type, None,
                                 False, value if simple else None, pytype, "", _NO_EXTRA))

    def _add_index_row(self, row: tuple) -> None:
        """An index row that may hold NaN or Infinity: to the writer's add_finite_row where it
        does not (``finite_row``), else to add_row."""
        (self._add_finite_row if finite_row(row) else self._add_row)(row)

    def _tensor(self, name: str, kind: str, index: str, t: torch.Tensor, level: str,
                module_type: str | None, dedup: bool = True, step: int | None = None,
                always_data: bool = False) -> None:
        # the hot path of every dump (thousands of calls per step): locals, no repeated lookups,
        # no helper call for what one line does (the version counter, CpuStats.__call__)
        if self.stopped is not None:
            return
        ttype = type(t)
        if ttype is not torch.Tensor and ttype is not torch.nn.Parameter:  # a subclass: a DTensor say
            plain = local_tensor(t)
            if plain is None:
                self._not_stored(name, kind, index, t, level, module_type, step,
                                 f"a {ttype.__name__} holds no plain tensor to copy")
                return
            t = plain
        if step is None:
            step = self.step
            order = self.order
            self.order = order + 1
        else:
            order = self.entries
        try:
            version = t._version
        except RuntimeError:  # an inference tensor has no version counter
            version = None
        if dedup:
            seen = self._seen.get(id(t))
            if seen is not None and seen[0]() is t and seen[1] == version:
                # the same tensor, unchanged (same version counter), already captured this step:
                # point at the first copy instead of copying again (layer outputs are the next
                # layer's inputs, q/k/v_proj share one input, cos/sin go to every layer)
                _, _, seen_dtype, seen_shape, seen_data, seen_key = seen
                self.entries += 1
                row = (step, name, kind, index, level, order, seen_dtype, seen_shape,
                       module_type, None, seen_data, None, None, seen_key, _NO_EXTRA)
                if seen_data:  # tensor mode: the writer resolves the key to the first copy's data file
                    self.writer.submit(new_row(IndexRow, row))
                else:  # statistics mode: the reader gives it the statistics of the entry with its key
                    self._add_finite_row(row)
                return
        stats_only = self.statistics and not always_data
        dtype = t.dtype
        data_bytes = t.nbytes
        nbytes = _STATS_ENTRY_BYTES if stats_only else data_bytes
        max_bytes = self.config.max_bytes
        if max_bytes is not None and self.bytes + nbytes > max_bytes:
            self._stop(f"max_bytes={max_bytes} reached at step {self.step} "
                       f"({self.bytes} bytes dumped); dumping stopped, the dump holds what came before")
            return
        self.bytes += nbytes
        self.entries += 1
        dtype_s = _DTYPE_NAMES.get(dtype) or dtype_name(dtype)
        shape = tuple(t.shape)
        key = str(self.entries)
        has_data = not stats_only
        if has_data and dtype not in SAFETENSORS_DTYPES:  # e.g. complex128: safetensors has no code for it
            why = {"not_stored": f"safetensors cannot store {dtype_s}"}
            self._add_finite_row((step, name, kind, index, level, order, dtype_s, shape, module_type, None,
                                  False, None, None, key, why))
            return
        if step >= 0 and version is not None and dedup:
            try:  # keyed by the caller's object: the same tensor object arrives again
                self._seen[id(t)] = (weakref.ref(t), version, dtype_s, shape, has_data, key)
            except TypeError:  # a tensor type without weak references: no de-duplication
                pass
        if stats_only and self._stats_kernel is not None and t.is_cpu and data_bytes:
            code = KERNEL_DTYPES.get(dtype)
            if code is not None and t.is_contiguous():  # statistics now: no copy, nothing left to compute
                self._stats_kernel(t.data_ptr(), code, t.numel(), self._stats_address)
                self._add_index_row((step, name, kind, index, level, order, dtype_s, shape, module_type,
                                     self._stats_out[:], False, None, None, key, _NO_EXTRA))
                return
        row = new_row(IndexRow, (step, name, kind, index, level, order, dtype_s, shape, module_type, None,
                                 has_data, None, None, key, {} if self.config.crc32 else _NO_EXTRA))
        # a copy must not join the autograd graph (generate runs without one: no detach needed)
        src = t.detach() if t.requires_grad else t
        if step >= 0 and stats_only == self.statistics:  # the dump's own kind of copy, or the tensor
            payload, event = self._keep(src)
        else:  # the weights (step -1: read once, nothing to learn from), a statistics dump's logits
            payload, event = device_copy(src) if stats_only else host_copy(src)
        self.writer.submit(row, payload, event, nbytes=data_bytes)

    def _not_stored(self, name: str, kind: str, index: str, t: torch.Tensor, level: str,
                    module_type: str | None, step: int | None, why: str) -> None:
        """An index row for a tensor the dump cannot copy: its shape and dtype, and why."""
        if step is None:
            step, order = self.step, self.order
            self.order = order + 1
        else:
            order = self.entries
        self.entries += 1
        self._add_finite_row((step, name, kind, index, level, order, dtype_name(t.dtype), tuple(t.shape),
                              module_type, None, False, None, None, str(self.entries), {"not_stored": why}))

    # The recorder's sink methods and the walk's leaves: replaced by the compiled capture's where
    # it is built (``use_compiled_capture`` below: capture.cpp walks each call's values as
    # recorder.py's walks do, and hands the leaves it does not take to ``_tensor`` and ``_other``)
    module_inputs, module_output = _module_inputs, _module_output
    op_inputs, op_output = _op_inputs_walk, _op_output_walk
    tensor, other = _tensor, _other

    def _stop(self, reason: str) -> None:
        self.stopped = reason
        self.active = False
        log.warning("llmflow dump %s: %s", self.dump_dir, reason)

    def _write_weights(self, model: torch.nn.Module) -> None:
        """Every parameter once: kind weight, step -1, name = the parameter's full name."""
        with torch._C.DisableTorchFunction():
            for name, p in model.named_parameters():
                if self.config.wants_name(name):
                    self._tensor(name, "weight", "0", p, "weight", None, step=-1)
        self.writer.end_step(-1)


# DumpSession's methods the compiled capture replaces, and the Python method each replaces
_COMPILED_METHODS = {"module_inputs": "_module_inputs", "module_output": "_module_output",
                     "op_inputs": "_op_inputs_walk", "op_output": "_op_output_walk", "tensor": "_tensor",
                     "other": "_other"}


def use_compiled_capture(on: bool = True) -> bool:
    """Make dump sessions, API mode's dispatch and the recorders made from now on use the compiled
    capture (``on``, where it is built) or the Python methods; returns whether the compiled one
    is in use now. The compiled capture is the default; the Python methods are for measuring the
    two side by side (``benchmarks/bench_dump.py --capture``) and for the tests that check both
    write the same dump. Sessions read the choice when their steps call them, recorders when they
    are made: switch between dumps."""
    compiled = on and _NATIVE is not None
    for method, python in _COMPILED_METHODS.items():
        chosen = getattr(_NATIVE.Entries, method) if compiled else getattr(DumpSession, python)
        setattr(DumpSession, method, chosen)
    use_compiled_dispatch(compiled)
    use_compiled_forward(compiled)
    return compiled


use_compiled_capture(True)


def _close_unattended(session: DumpSession) -> None:
    """Finish a dump nobody closed: its model was garbage-collected or the interpreter exits.

    Never raises: a failure is one warning line, and the user's process keeps its exit status.
    """
    try:
        session.close()
    except Exception as exc:  # (the writer's error, already a one-line message)
        log.warning("llmflow dump %s: could not be finished: %s", session.dump_dir, exc)
