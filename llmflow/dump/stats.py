"""Per-tensor statistics: max, min, mean, L2 norm, NaN count, Inf count (``STAT_KEYS`` order).

Statistics mode is dominated by per-call overhead, not arithmetic: a decode step of a 30-layer
model captures ~1000 small tensors. Two ways keep it cheap:

* CPU tensors of float32, bfloat16, float16, int64 and int32 (nearly everything a CPU model
  computes, token ids and positions included): one call of a compiled kernel (``stats.cpp``,
  ~1 us through ctypes) at capture time, ``CpuStats``: no copy of the tensor, nothing left for
  the writer but the index row. Interleaved A/B runs on the tiny 8x512 Llama: 1.35x of plain
  generation against 1.44x with copies and batched statistics.
* Everything else (accelerators, other dtypes, machines without a compiler, dumps with CRC32):
  the forward pass takes a copy of each tensor and the writer computes the statistics of many
  tensors at once (``batched_stats``): tensors of one (device, dtype, shape) are stacked and
  reduced along one axis, a handful of ops per group instead of five per tensor, all on the
  tensors' own device, read back once per device (no synchronisation per tensor or per group).
  NaN/Inf are counted only for tensors whose sum is not finite: a finite sum proves there is no
  NaN and no Inf.

Reductions accumulate in float32 at least (a bf16 sum of 10^5 values would round badly), float64
for float64 and integer tensors. An empty tensor gets NaN statistics and zero counts.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections import defaultdict

import torch

from llmflow import native
from llmflow.formats.base import STAT_KEYS

_lock = threading.Lock()
_kernel: ctypes._CFuncPtr | None | bool = None  # None: not tried yet; False: unavailable
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int64: 3,  # stats.cpp's codes
                 torch.int32: 4}

EMPTY = (math.nan, math.nan, math.nan, math.nan, 0, 0)  # STAT_KEYS order


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point and dtype != torch.float64 else torch.float64


def batched_stats(tensors: list[torch.Tensor]) -> list[list[float]]:
    """The statistics of every tensor, in order, each a list in ``STAT_KEYS`` order (the index
    row's own form: no dict per tensor), with a few ops per (device, dtype, shape)."""
    out: list[list[float] | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            out[i] = list(EMPTY)
        else:
            # get_device() (-1 on the CPU) and the Size itself: no device object or tuple per tensor
            groups[(t.get_device(), t.dtype, t.shape)].append(i)
    # each group's (max, min, sum, norm) rows, kept on the device; read back at the end, once per
    # device (every read-back waits for the device: one per group was one wait per shape)
    reduced: dict[int, list[tuple[list[int], torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for (device, dtype, _), idx in groups.items():
        wide = _wide(dtype)
        x = torch.stack([tensors[i] for i in idx]).reshape(len(idx), -1)
        if x.is_complex():
            x = x.abs()
        if x.dtype != wide:
            x = x.to(wide)
        mn, mx = x.amin(dim=1), x.amax(dim=1)  # aminmax(dim=1) measured 6x slower on CPU
        total = x.sum(dim=1)
        norm = torch.linalg.vector_norm(x, dim=1)
        reduced[device].append((idx, x, torch.stack([mx, mn, total, norm], dim=1)))
    for parts in reduced.values():
        # float64 holds every float32 exactly: the values read back are those of each group's own
        both = [r if r.dtype == torch.float64 else r.to(torch.float64) for _, _, r in parts]
        rows = (torch.cat(both) if len(both) > 1 else both[0]).tolist()
        at = 0
        for idx, x, _ in parts:
            n = x.shape[1]
            for j, i in enumerate(idx):
                vmax, vmin, vsum, vnorm = rows[at + j]
                nan = inf = 0
                if not math.isfinite(vsum):
                    nan, inf = int(torch.isnan(x[j]).sum()), int(torch.isinf(x[j]).sum())
                out[i] = [vmax, vmin, vsum / n, vnorm, nan, inf]
            at += len(idx)
    return out  # type: ignore[return-value]


def tensor_stats(t: torch.Tensor) -> dict[str, float]:
    """The statistics of one tensor (same definitions as ``batched_stats``), by name."""
    return dict(zip(STAT_KEYS, batched_stats([t.detach()])[0], strict=True))


class CpuStats:
    """The compiled statistics of contiguous CPU float32/bfloat16/float16 tensors, at capture.

    ``CpuStats.create()`` is None where the kernel cannot be had (then the capture copies the
    tensor and the writer uses ``batched_stats``). One instance per dump session: it owns the
    six doubles the kernel writes into, so it is used from one thread.

    The capture's hot path calls the kernel itself, ``kernel(t.data_ptr(), code, t.numel(),
    address)`` and then ``out[:]`` (what ``__call__`` does, without its Python frame).
    """

    def __init__(self, fn: ctypes._CFuncPtr):
        self.kernel = fn
        self.out = (ctypes.c_double * len(STAT_KEYS))()
        self.address = ctypes.addressof(self.out)

    @classmethod
    def create(cls) -> CpuStats | None:
        fn = _load()
        return cls(fn) if fn is not None else None

    def __call__(self, t: torch.Tensor, code: int) -> list[float]:
        """The statistics of ``t``: contiguous, on the CPU, non-empty, of ``KERNEL_DTYPES[code]``
        (the caller has checked: a wrong pointer or size would read past the tensor)."""
        self.kernel(t.data_ptr(), code, t.numel(), self.address)
        return self.out[:]


def _load() -> ctypes._CFuncPtr | None:
    """The kernel's function, built on first need and checked against ``batched_stats`` once per
    build; None (with one warning) where that fails or ``LLMFLOW_FUSED=0``."""
    global _kernel
    if native.disabled():
        return None
    if _kernel is None:
        with _lock:
            if _kernel is None:
                fn = for_target(None)
                _kernel = fn if fn is not None else False
    return _kernel or None


def for_target(target: native.Target | None) -> ctypes._CFuncPtr | None:
    """The kernel built for ``target`` (None: the best this CPU runs), checked as ``_load``'s is,
    or None: for measuring the builds side by side (``benchmarks/bench_dump.py --targets``)."""
    # pointers as int64: converting a Python int takes ~0.2 us less than c_void_p
    argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return native.STATS.function("llmflow_stats", argtypes, None, lambda f: _agrees(CpuStats(f)), target)


def use_kernel(fn: ctypes._CFuncPtr | None) -> None:
    """Make ``fn`` the kernel later dump sessions call (None: none, the copy-and-batch path)."""
    global _kernel
    _kernel = fn if fn is not None else False


def _agrees(stats: CpuStats) -> bool:
    """The kernel gives ``batched_stats``'s results: every dtype, odd lengths, NaN and Inf."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=gen) * 3 for n in (1, 7, 64, 1000, 70_001)]
    special = torch.tensor([1.0, float("inf"), -2.0, float("-inf"), 0.5] * 20)
    cases = [*base, special, torch.cat([special, torch.tensor([float("nan")])])]
    integers = [torch.tensor([3, -7, 2**40, 0]), torch.arange(1000) - 300]
    for dtype, code in KERNEL_DTYPES.items():
        for t in (cases if dtype.is_floating_point else integers):
            t = t.to(dtype) if dtype != torch.int32 else (t % 2**31).to(dtype)
            got, want = stats(t, code), batched_stats([t])[0]
            if not all(math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-6) or (math.isnan(g) and math.isnan(w))
                       for g, w in zip(got, want, strict=True)):
                return False
    return True
