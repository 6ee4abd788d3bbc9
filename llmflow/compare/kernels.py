"""The per-piece reductions behind ``compare_tensors``: eager torch, and a compiled kernel.

One pass over golden ``a`` and target ``b`` (same number of elements) returns, in this order
(``N_VALUES``)::

    sum a^2, sum b^2, sum a*b, sum d^2, max|d|, sum|d|, max rel, sum rel, #rel<1e-3, #rel<5e-3,
    lse(a), lse(b), y = sum w*d, z = sum w*phi(d), max a, min a, sum a, max b, min b, sum b

with d = b - a, rel = |d| / |a| where |a| > eps (else 0), lse the log-sum-exp,
w = softmax(a) = exp(a - max a) / sum exp(a - max a) (the piece's own weights: sum w = 1, so
no third exp(a - lse) is needed) and phi(d) = expm1(d) - d >= 0. ``metrics`` merges pieces by
rescaling their y and z by exp(lse_piece - lse) (the online-softmax identity) and gets the KL
divergence from u = sum w*expm1(d) = y + z:

    KL(softmax(a) || softmax(b)) = -y + log1p(u) = z + (log1p(u) - u)

The second form keeps tiny divergences (fp32 vs fp32 one ulp apart: KL ~1e-13) precise: z is a
sum of non-negative terms, each known to fp32 precision, and log1p(u) - u (-u^2/2 + ... for
small u) is evaluated in Python floats; no float64 exp or expm1 per element. One read of the
data gives every metric, KL included, and each side's statistics (max, min, mean, norm: the
columns msit and msprobe show beside the metrics). The exp behind the KL is most of the
arithmetic: a caller that wants no KL for a pair (``llmflow compare --kl logits``) passes
``softmax=False``, and the kernel skips it (the softmax sums are then 0, every other value the
same bits), ~1.8x less work an element. A row whose largest |d| reaches 64 still takes them, and
their overflow (NaN in their place) sends the piece to eager torch as it would with the KL, so
its other values are the same either way.

Eager torch (``pass1``: any float dtype, float64 throughout, ~30 torch ops a call) is the
reference, and serves other dtypes, pieces with NaN/Inf, and machines without a C++ compiler.
float32/bfloat16/float16 data goes through the compiled ``pass1.cpp`` (beside this file; it
reads float32 and bfloat16, either side, as they are; float16 is converted first): rows of
``FUSED_CHUNK`` elements (256 KiB of fp32 per side, so a row stays in L2) in parallel
(OpenMP, torch's thread count, or what ``threads_from`` gives the calling thread), merged inside
the kernel, one call per span of rows. Per row, a
first loop reads both sides from memory for the maxima and every sum that needs no maximum; a
second loop reads the row again from cache for the softmax sums and each side's minimum and
plain sum (there they ride on the exp's latency; in the first loop they cost ~15%); meanwhile
each thread fetches its next row into cache, so that memory and arithmetic overlap. The
element-wise work is fp32 (exact for bf16/fp16/fp32 data) with no function calls: exp(x <= 0)
is a degree-6 polynomial scaled by 2^n, phi(d) a series for |d| < 1 and exp(b - max b) * exp(max b - max a) -
exp(a - max a) * (1 + d) beyond. The first loop's max |d| picks the second loop's form per row:
where every |d| < 1 (most rows of a compare), exp(b - max b) comes from exp(a - max a) *
(1 + d + phi(d)) * exp(max a - max b) instead of a second exp, and below 1/16 the series stops at
d^4 (truncation < 4e-10); ~1.3x faster than two exps and the full series everywhere. Products for
the quadratic sums are formed in float64 (exact) and summed in float64; the other sums (|d|,
rel, the softmax weights, y and z) are summed in fp32 over 8 elements of a lane, then in float64
(each partial sum is off by at most 8 ulps of the sum of its terms' magnitudes). A piece whose
fp32 arithmetic overflows (|d| > ~88) is redone by eager torch. Throughput: ~5 GB/s per core of
fp32 data, both sides counted (~1.6x the torch.export/AOTInductor kernel it replaced, which
widened every term to float64 before summing it and took a second exp everywhere; eager torch:
0.1-0.6). Limit: each term of z is known to fp32 precision, so the KL carries an absolute error
of up to ~1e-7 times z (~d^2/2): the divergence of small differences stays precise to ~1e-6
relative, but the KL of a shift of ~0.5 nat or more is known to ~1e-8-1e-7 absolute (one
element, whose KL is 0 by definition, reads up to ~1e-7; eager torch's float64 gives 0).

The kernel is compiled (``c++ -O3 -march=<target> -fopenmp``, a second or two) once per machine
and instruction set by ``llmflow.native`` (cache, fallbacks, a failed build remembered; the best
build the CPU runs is chosen), loaded through ctypes (the GIL is released while it runs) and
checked against eager torch once per build. Its sums have 16 lanes whatever the register width
(512, 256 or 128 bits), so builds for CPUs with FMA give the same bits (x86-64-v3 and -v4 do);
a build for a CPU without FMA (x86-64-v2) rounds products separately and differs in the last
bits. Where no compiler
works compares run on eager torch; ``python -m llmflow.native`` (the install step)
builds every llmflow kernel, and tries again after a failure. ``LLMFLOW_FUSED=0`` turns the
compiled kernels off.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from llmflow import native

EPS = float(torch.finfo(torch.float32).eps)
N_VALUES = 20
FUSED_CHUNK = 1 << 16  # elements per kernel row: 256 KiB per side in fp32, read twice from L2
FUSED_SPAN = 64 * FUSED_CHUNK  # fp32 elements per kernel call (rows in parallel)
SUM_BLOCK = 4096  # elements each thread sums on its own in fixed_sum
LIBRARY = native.PASS1
# llmflow_pass1(a, a_bf16, b, b_bf16, n, row, threads, out, softmax) -> 0, or -1 when out of memory
ARGTYPES = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
SOFTMAX_VALUES = slice(10, 14)  # lse(a), lse(b), y, z: 0 where no KL is wanted (``softmax=False``)
_lock = threading.Lock()
_fused: Callable | None | bool = None  # None: not tried yet; False: unavailable
_this_thread = threading.local()  # .threads: what ``threads_from`` set in this thread, if anything


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of a 1-D tensor, added in an order that does not depend on torch's thread count.

    torch's own ``sum`` and ``dot`` split a long tensor among its threads, so their last bits
    change with the thread count, and with which thread happens to take which part: two runs of
    one compare would write rows that differ in the last digits. Here each block of
    ``SUM_BLOCK`` elements is summed by one thread (a reduction over the inner dimension of a
    2-D view runs each output on one thread), then the block sums in order (fewer than torch's
    grain size: one thread)."""
    n = x.numel()
    if n <= SUM_BLOCK:
        return x.sum()
    pad = -n % SUM_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, SUM_BLOCK).sum(1).sum()


def fixed_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum x*y of two 1-D tensors, in ``fixed_sum``'s order."""
    return fixed_sum(x * y)


def pass1(a: torch.Tensor, b: torch.Tensor, softmax: bool = True) -> torch.Tensor:
    """One chunk (any float dtype, same shape, finite); a float64 tensor of ``N_VALUES`` values,
    the same whatever torch's thread count. Without ``softmax`` the softmax sums (the KL's:
    ``SOFTMAX_VALUES``) are 0 and not computed."""
    a = a.to(torch.float64).reshape(-1)
    b = b.to(torch.float64).reshape(-1)
    d = b - a
    ad = d.abs()
    ag = a.abs()
    rel = torch.where(ag > EPS, ad / ag, 0.0)
    ma, mb = a.max(), b.max()
    if softmax:
        ea = (a - ma).exp_()
        sa = fixed_sum(ea)
        # expm1(d) - d: float64 leaves ~4e-16/|d| relative error, 4e-9 where d is one fp32 rounding
        phi = torch.expm1(d).sub_(d)
        soft = [sa.log() + ma, fixed_sum((b - mb).exp_()).log() + mb, fixed_dot(ea, d) / sa,
                fixed_dot(ea, phi) / sa]
    else:
        soft = [a.new_zeros(())] * 4
    return torch.stack([
        fixed_dot(a, a), fixed_dot(b, b), fixed_dot(a, b), fixed_dot(d, d), ad.max(), fixed_sum(ad),
        rel.max(), fixed_sum(rel), (rel < 1e-3).sum().to(torch.float64), (rel < 5e-3).sum().to(torch.float64),
        *soft, ma, a.min(), fixed_sum(a), mb, b.min(), fixed_sum(b),
    ])


def fused() -> Callable | None:
    """The compiled ``pass1`` for contiguous float32/bfloat16 tensors of any length, or None
    (eager torch).

    Loads the cached library (milliseconds); builds it first when this machine has none
    (under a second), unless an earlier build failed here.
    """
    global _fused
    if native.disabled():
        return None
    if _fused is None:
        with _lock:
            if _fused is None:
                _fused = _load_or_build() or False
    return _fused or None


@contextlib.contextmanager
def threads_from(count: Callable[[], int]) -> Iterator[None]:
    """Within (in the calling thread only): each kernel call runs its rows on ``count()`` threads
    instead of torch's thread count. For compares that run several pairs at once, each in a
    thread of its own, so that together they use the cores without oversubscribing them."""
    before = getattr(_this_thread, "threads", None)
    _this_thread.threads = count
    try:
        yield
    finally:
        _this_thread.threads = before


def _call_threads() -> int:
    count = getattr(_this_thread, "threads", None)
    return count() if count is not None else torch.get_num_threads()


def compiled(target: native.Target | None = None) -> bool:
    """True when this machine has the compiled kernel (loading it takes milliseconds)."""
    return LIBRARY.compiled(target)


def library_dir(target: native.Target | None = None) -> Path:
    """Where the kernel built from this source for ``target`` (by default the best this CPU
    runs) is cached."""
    return LIBRARY.library_dir(target)


def build(force: bool = False, target: native.Target | None = None) -> Path:
    """Compile ``pass1.cpp`` now (see ``llmflow.native.NativeLibrary.build``)."""
    return LIBRARY.build(force, target)


def for_target(target: native.Target) -> Callable | None:
    """The kernel built for one target (built on first need, checked against eager torch as
    ``fused`` is), or None: for measuring and testing each build side by side."""
    return _load_or_build(target)


def _load_or_build(target: native.Target | None = None) -> Callable | None:
    """The compiled kernel (built on first need) once it agrees with eager torch, else None."""
    fn = LIBRARY.function("llmflow_pass1", ARGTYPES, ctypes.c_int,
                          lambda f: _agrees(_wrap(f)),  # (the check: ~10 ms of float64)
                          target)
    return _wrap(fn) if fn is not None else None


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # read as they are; others are converted first


def _wrap(fn: Callable) -> Callable:
    def kernel(a: torch.Tensor, b: torch.Tensor, softmax: bool = True) -> torch.Tensor:
        """``pass1`` of two contiguous CPU tensors of one non-zero size, each float32 or bfloat16."""
        n = a.numel()
        if not (a.dtype in KERNEL_DTYPES and b.dtype in KERNEL_DTYPES and a.device.type == "cpu"
                and b.device.type == "cpu" and a.is_contiguous() and b.is_contiguous()
                and b.numel() == n > 0):
            raise ValueError(f"compare kernel: expected two contiguous float32/bfloat16 CPU tensors of one "
                             f"size, got {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
        out = torch.empty(N_VALUES, dtype=torch.float64)
        if fn(a.data_ptr(), a.dtype == torch.bfloat16, b.data_ptr(), b.dtype == torch.bfloat16, n,
              FUSED_CHUNK, _call_threads(), out.data_ptr(), softmax):
            raise MemoryError("compare kernel: out of memory")
        return out

    return kernel


def _agrees(kernel: Callable) -> bool:
    """The compiled kernel gives eager torch's results on 2 rows, on a short piece, and on
    float32 against bfloat16; without the softmax sums, the same values but those."""
    a = torch.linspace(-3, 5, 2 * FUSED_CHUNK)
    b = a * 1.001 + torch.linspace(0, 2, 2 * FUSED_CHUNK) ** 3  # |d| > 1 at the end
    for x, y in ((a, b), (a[-1001:], b[-1001:]), (a, b.bfloat16())):
        full = kernel(x, y)
        if not torch.allclose(full, pass1(x, y), rtol=1e-5, atol=1e-9):
            return False
        rest = kernel(x, y, softmax=False)
        others = torch.ones(N_VALUES, dtype=torch.bool)
        others[SOFTMAX_VALUES] = False
        if rest[SOFTMAX_VALUES].any() or not torch.equal(rest[others], full[others]):
            return False
    return True
