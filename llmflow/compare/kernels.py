"""The per-piece reductions behind ``compare_tensors``: eager torch, and a fused compiled kernel.

One pass over golden ``a`` and target ``b`` (same number of elements) returns, in this order
(``N_VALUES``)::

    sum a^2, sum b^2, sum a*b, sum d^2, max|d|, sum|d|, max rel, sum rel, #rel<1e-3, #rel<5e-3,
    lse(a), lse(b), y = sum w*d, z = sum w*phi(d)

with d = b - a, rel = |d| / |a| where |a| > eps (else 0), lse the log-sum-exp,
w = softmax(a) = exp(a - max a) / sum exp(a - max a) (the piece's own weights: sum w = 1, so
no third exp(a - lse) is needed) and phi(d) = expm1(d) - d >= 0. ``metrics`` merges pieces by
rescaling their y and z by exp(lse_piece - lse) (the online-softmax identity) and gets the KL
divergence from u = sum w*expm1(d) = y + z:

    KL(softmax(a) || softmax(b)) = -y + log1p(u) = z + (log1p(u) - u)

The second form keeps tiny divergences (fp32 vs fp32 one ulp apart: KL ~1e-13) precise: z is a
sum of non-negative terms, each known to fp32 precision, and log1p(u) - u (-u^2/2 + ... for
small u) is evaluated in Python floats; no float64 exp or expm1 per element. One read of the
data gives every metric, KL included.

Eager torch (``pass1``: any float dtype, float64 throughout, ~30 torch ops per chunk, 0.05-0.6
GB/s by size) serves tensors smaller than ``FUSED_CHUNK``, other dtypes, pieces with NaN/Inf.
Bigger float32/bfloat16/float16 tensors go through the compiled ``_pass1_fused``: spans of
``FUSED_SPAN`` elements viewed as rows of ``FUSED_CHUNK`` (256 KiB of fp32 per side, so a row
stays in L2), plus the last, partial row. Per row, a first loop reads both sides from memory
for the maxima and every sum that needs no maximum; a second loop reads the row again from
cache for the softmax sums. Rows run in parallel (OpenMP) and are merged inside the kernel:
one call and one ``.tolist()`` per span. The element-wise work is fp32 (exact for
bf16/fp16/fp32 data) with no function calls, which would make the compiler spill every
accumulator: exp(x <= 0) is an inlined degree-6 polynomial scaled by 2^n, phi(d) a series for
|d| < 1 and exp(b - max b) * exp(max b - max a) - exp(a - max a) * (1 + d) beyond, using the
two exps every element needs anyway. Products for the quadratic sums are formed in float64
(exact) and every sum is accumulated in float64 (fused multiply-add allowed). A row whose fp32
arithmetic overflows (|d| > ~88) is redone by eager torch. Throughput: ~4.5 GB/s per core of
fp32 data, both sides counted (the previous compiled kernel: 1.4). Limit: the KL of a
near-constant shift by more than ~1 nat is known to ~1e-8 absolute, not relative (fp32 exps).

The kernel is compiled ahead of time (torch.export + AOTInductor) once per machine, torch
version and kernel source into the llmflow cache: ``pass1.pt2`` with a fixed row length (the
faster code) and a dynamic number of rows, ``pass1_tail.pt2`` with a dynamic row length for the
partial row. Both load through torch's C++ package loader, which takes milliseconds per process
where ``torch.compile`` takes seconds (so worker processes start fast). Where that fails,
``torch.compile`` is tried, then eager torch. ``LLMFLOW_FUSED=0`` turns the compiled kernels
off; they are checked against eager torch before they are used.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

EPS = float(torch.finfo(torch.float32).eps)
N_VALUES = 14
FUSED_CHUNK = 1 << 16  # elements per kernel row: 256 KiB per side in fp32, read twice from L2
FUSED_SPAN = 64 * FUSED_CHUNK  # fp32 elements per kernel call (rows in parallel)
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_fused: Callable | None | bool = None  # None: not tried yet; False: unavailable
# The kernels are compiled ahead of time once per machine (~40 s; `make install` does it) and
# then load in milliseconds. Without that cache a compare builds them only when it has this much
# to read per process, where the build pays for itself (eager torch: ~0.3 GB/s on 2 cores,
# fused: ~8 GB/s).
FUSE_MIN_BYTES = 8 << 30
# the compiled kernel's fp32 code: exp(x) for x <= 0 as 2^n * p(r), r = x - n ln2 in
# [-ln2/2, ln2/2], p a degree-6 minimax polynomial (1.9e-9 relative, under fp32's rounding)
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # 15 significant bits: n * _LN2_HI is exact for |n| < 2^9
_LN2_LO = 1.428606765330187e-06
_EXP_P = (1.0, 1.0, 0.49999991059303284, 0.16666419804096222, 0.04166822507977486,
          0.00837481115013361, 0.0013836828293278813)
# phi(d) = d^2 * sum_k d^k / (k + 2)! for |d| < 1: terms to d^10, truncation < 3e-8 relative
_PHI_SERIES = tuple(1.0 / math.factorial(k) for k in range(2, 11))
# fused multiply-add: the polynomials and the float64 sums of products round once, not twice
_INDUCTOR_CONFIGS = (("cpp.enable_floating_point_contract_flag", "fast"),)
_PACKAGES = ("pass1.pt2", "pass1_tail.pt2")


def pass1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One chunk (any float dtype, same shape, finite); a float64 tensor of ``N_VALUES`` values."""
    a = a.to(torch.float64).reshape(-1)
    b = b.to(torch.float64).reshape(-1)
    d = b - a
    ad = d.abs()
    ag = a.abs()
    rel = torch.where(ag > EPS, ad / ag, 0.0)
    ma, mb = a.max(), b.max()
    ea = (a - ma).exp_()
    sa = ea.sum()
    # expm1(d) - d: float64 leaves ~4e-16/|d| relative error, 4e-9 where d is one fp32 rounding
    phi = torch.expm1(d).sub_(d)
    return torch.stack([
        torch.dot(a, a), torch.dot(b, b), torch.dot(a, b), torch.dot(d, d), ad.max(), ad.sum(),
        rel.max(), rel.sum(), (rel < 1e-3).sum().to(torch.float64), (rel < 5e-3).sum().to(torch.float64),
        sa.log() + ma, (b - mb).exp_().sum().log() + mb, torch.dot(ea, d) / sa, torch.dot(ea, phi) / sa,
    ])


def _exp_neg(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for fp32 x <= 0 (0 below -87), inlined: Sleef's exp is a call, which makes the
    compiler spill every accumulator around it."""
    n = torch.round(x * _LOG2E)
    r = x - n * _LN2_HI - n * _LN2_LO
    p = r * _EXP_P[6] + _EXP_P[5]
    for c in reversed(_EXP_P[:5]):
        p = p * r + c
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^n
    return torch.where(x < -87.0, 0.0, p * scale)


def _pass1_fused(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a, b: [rows, FUSED_CHUNK] fp32; per-row sums (fp32 element-wise, float64 accumulation),
    # then the rows merged: the same N_VALUES as pass1 of the flattened tensors
    d = b - a
    ad = d.abs()
    ag = a.abs()
    rel = torch.where(ag > EPS, ad / ag, 0.0)
    a64, b64 = a.double(), b.double()
    d64 = b64 - a64
    aa, bb, ab, dd = (a64 * a64).sum(1), (b64 * b64).sum(1), (a64 * b64).sum(1), (d64 * d64).sum(1)
    sad, srel = ad.double().sum(1), rel.double().sum(1)
    max_ad, max_rel = ad.amax(1).double(), rel.amax(1).double()
    c1 = (rel < 1e-3).sum(1, dtype=torch.int32).double()
    c5 = (rel < 5e-3).sum(1, dtype=torch.int32).double()
    # 0 (a sum of terms >= 0 or +inf: aa + bb + ab >= 0), or NaN with NaN data, which the caller
    # redoes eagerly: a dependency that makes inductor compute all of the above in the maxima's
    # loop, leaving the softmax loop fewer live registers and no second division
    dep = torch.clamp(aa + bb + ab + dd + sad + srel + max_ad + max_rel + c1 + c5, max=0.0).float()
    ma = a.amax(1) + dep
    mb = b.amax(1) + dep
    ea = _exp_neg(a - ma[:, None])
    eb = _exp_neg(b - mb[:, None])
    # ea * phi(d); beyond |d| = 1 through eb: ea * exp(d) = exp(b - ma) = eb * exp(mb - ma)
    scale_b = torch.exp(mb - ma)[:, None]
    series = _PHI_SERIES[-1] * d + _PHI_SERIES[-2]
    for c in reversed(_PHI_SERIES[:-2]):
        series = series * d + c
    z = torch.where(ad < 1.0, ea * (series * (d * d)), eb * scale_b - ea * (1.0 + d))
    sa, sb = ea.double().sum(1), eb.double().sum(1)
    y, z = (ea * d).double().sum(1), z.double().sum(1)
    # merge the rows, weights relative to the largest row maximum (online softmax); from one
    # [rows, 16] tensor, so that inductor keeps both loops of a row in one parallel loop
    r = torch.stack([aa, bb, ab, dd, max_ad, sad, max_rel, srel, c1, c5, ma.double(), sa, mb.double(), sb,
                     y, z], 1)
    top_a, top_b = r[:, 10].amax(), r[:, 12].amax()
    wa, wb = torch.exp(r[:, 10] - top_a), torch.exp(r[:, 12] - top_b)
    sa_all = (wa * r[:, 11]).sum()
    return torch.stack([
        r[:, 0].sum(), r[:, 1].sum(), r[:, 2].sum(), r[:, 3].sum(), r[:, 4].amax(), r[:, 5].sum(),
        r[:, 6].amax(), r[:, 7].sum(), r[:, 8].sum(), r[:, 9].sum(), sa_all.log() + top_a,
        (wb * r[:, 13]).sum().log() + top_b, (wa * r[:, 14]).sum() / sa_all, (wa * r[:, 15]).sum() / sa_all,
    ])


def fused(build: bool = False) -> Callable | None:
    """The compiled ``pass1`` for flat fp32 pieces of a multiple of ``FUSED_CHUNK`` elements or
    fewer than ``FUSED_CHUNK`` (a tail), or None.

    Loads the cached packages (milliseconds); compiles them only with ``build`` (a minute), which
    the compare asks for when it has enough data to repay the build.
    """
    global _fused
    if _disabled():
        return None
    if _fused is None:
        if not (build or packaged()):
            return None
        with _lock:
            if _fused is None:
                _fused = _load_or_build() or False
    return _fused or None


def packaged() -> bool:
    """True when this machine has the ahead-of-time compiled kernels (loading them takes ms)."""
    return not _disabled() and all((package_dir() / f).is_file() for f in _PACKAGES)


def package_dir() -> Path:
    """Where the kernels compiled for this torch and this kernel source are cached."""
    from llmflow.models import cache_dir

    return cache_dir() / "kernels" / f"torch-{torch.__version__}-{platform.machine()}-{_source_key()}"


@functools.cache
def _source_key() -> str:
    """A hash of this file, which holds everything the compiled kernels are made of. (Hashing
    ``inspect.getsource`` of the kernel functions alone cost ~10 ms of tokenizing per process,
    5% of a 1 GB compare; an edit elsewhere in the file now rebuilds them, once.)"""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def build_packages() -> Path:
    """Compile the kernels ahead of time (torch.export + AOTInductor, ~45 s once per machine):
    ``pass1.pt2`` for rows of ``FUSED_CHUNK`` elements (the row length fixed: ~12% faster code),
    ``pass1_tail.pt2`` for one row of any length (a tensor's last, partial row)."""
    final = package_dir()
    if packaged():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        # distinct inputs (no aliasing); the number of rows is dynamic, the tail's length too
        a = torch.linspace(-1, 1, 4 * FUSED_CHUNK).view(4, FUSED_CHUNK)
        b = torch.linspace(-2, 2, 4 * FUSED_CHUNK).view(4, FUSED_CHUNK)
        rows = torch.export.Dim("rows", min=1, max=1 << 40)
        cols = torch.export.Dim("cols", min=1, max=FUSED_CHUNK)
        for name, dims in (("pass1.pt2", {0: rows}), ("pass1_tail.pt2", {0: rows, 1: cols})):
            with warnings.catch_warnings():  # torch's own deprecation chatter from export
                warnings.simplefilter("ignore", FutureWarning)
                program = torch.export.export(_AsModule(_pass1_fused), (a, b), strict=False,
                                              dynamic_shapes=(dims, dims))
                torch._inductor.aoti_compile_and_package(program, package_path=str(tmp / name),
                                                         inductor_configs=dict(_INDUCTOR_CONFIGS))
        if not final.exists():
            os.replace(tmp, final)  # atomic: a concurrent builder's result is as good as ours
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


class _AsModule(torch.nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fn(a, b)


def _disabled() -> bool:
    return os.environ.get("LLMFLOW_FUSED", "1").lower() in ("0", "false", "no", "off")


def _load_or_build() -> Callable | None:
    """The AOT packages (built on first need), else torch.compile, else None (eager torch)."""
    try:
        d = build_packages()
        # the C++ loader: no import of torch._inductor (~1 s), so every worker starts in ms
        rows, tail = (torch._C._aoti.AOTIModelPackageLoader(str(d / f), "model", False, 1, -1)
                      for f in _PACKAGES)
        kernel = _dispatch(lambda a, b: rows.run([a, b])[0], lambda a, b: tail.run([a, b])[0])
        # the check costs ~12 ms (eager float64), a tenth of a 1 GB compare: once per package,
        # since the same package file computes the same thing in every process
        verified = d / "verified"
        if verified.is_file() or _agrees(kernel):
            verified.touch()
            return kernel
    except Exception as exc:  # no compiler, a private API that moved ...: try the JIT
        _log.info("compare: ahead-of-time kernels unavailable (%s: %s)", type(exc).__name__, exc)
    try:
        compiled = torch.compile(_pass1_fused, dynamic=True, fullgraph=True,
                                 options=dict(_INDUCTOR_CONFIGS))
        kernel = _dispatch(compiled, compiled)
        if _agrees(kernel):
            return kernel
    except Exception as exc:  # no compiler, unsupported platform ...: eager works everywhere
        _log.info("compare: fused kernels unavailable (%s: %s); using eager torch", type(exc).__name__, exc)
    return None


def _dispatch(rows: Callable, tail: Callable) -> Callable:
    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Flat fp32 ``a`` and ``b``: whole rows of ``FUSED_CHUNK``, or one shorter row."""
        n = a.numel()
        if n % FUSED_CHUNK == 0:
            return rows(a.view(-1, FUSED_CHUNK), b.view(-1, FUSED_CHUNK))
        if n > FUSED_CHUNK:
            raise ValueError(f"compare kernel: {n} elements are neither whole rows nor one row")
        return tail(a.view(1, n), b.view(1, n))

    return kernel


def _agrees(kernel: Callable) -> bool:
    """The compiled kernels give eager torch's results on 2 rows and on a tail."""
    a = torch.linspace(-3, 5, 2 * FUSED_CHUNK)
    b = a * 1.001 + torch.linspace(0, 2, 2 * FUSED_CHUNK) ** 3  # |d| > 1 at the end
    for n in (2 * FUSED_CHUNK, 1001):
        if not torch.allclose(kernel(a[-n:], b[-n:]), pass1(a[-n:], b[-n:]), rtol=1e-5, atol=1e-9):
            _log.warning("compare: the compiled kernel disagrees with eager torch; using eager")
            return False
    return True


if __name__ == "__main__":  # python -m llmflow.compare.kernels: build the kernels now (install time)
    # build=True: on a fresh machine nothing is cached yet, and building it is this command's job
    print(f"llmflow: fused compare kernels in {package_dir()}" if fused(build=True) and packaged()
          else "llmflow: fused compare kernels unavailable here; compare uses eager torch")
