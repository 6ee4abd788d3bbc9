"""The per-chunk reductions behind ``compare_tensors``: eager torch, and a fused compiled version.

Pass 1 over a chunk of golden ``a`` and target ``b`` returns, in this order::

    sum a^2, sum b^2, sum a*b, sum d^2, max|d|, sum|d|, max rel, sum rel, #rel<1e-3, #rel<5e-3,
    logsumexp(a), logsumexp(b)

with d = b - a and rel = |d| / |a| where |a| > eps (else 0). Pass 2 returns, with
p = exp(a - lse_a): ``sum p, sum p*d, sum p*expm1(d)``, from which ``metrics`` gets
KL(softmax(a) || softmax(b)) = -sum(p d)/P + log1p(sum(p expm1 d)/P), a form that needs no
precise log-sum-exp and keeps tiny divergences (fp32 vs fp32: 1e-12) exact.
All sums are accumulated in float64.

Eager torch needs ~20 separate element-wise passes per chunk; on big tensors that, not the disk,
is the bottleneck (~0.7 GB/s per core). ``torch.compile`` fuses each pass into a loop or two over
the data (~4 GB/s per core on fp32, both passes), so chunks of exactly ``FUSED_CHUNK`` elements of a tensor at
least that large go through the compiled kernels when a C++ compiler is available; compiling costs
a few seconds once per process (cached on disk by inductor). ``LLMFLOW_FUSED=0`` turns it off; any
failure to compile turns it off for the process and the eager path is used.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

EPS = float(torch.finfo(torch.float32).eps)
FUSED_CHUNK = 1 << 18  # 1 MiB per side in fp32: both passes of the kernel stay in cache
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_fused: tuple[Callable, Callable] | None | bool = None  # None: not tried yet; False: unavailable
# Compiling costs ~5 s per process (less with inductor's disk cache) and saves ~1.2 s per GB
# against eager torch, so a compare only asks for it when each worker has this much to read.
FUSE_MIN_BYTES = 2 << 30  # per process
_wanted = True


def want_fused(flag: bool) -> None:
    """Allow (the default) or skip the compiled kernels in this process, e.g. for a small compare."""
    global _wanted
    _wanted = flag


def pass1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pass 1 on one chunk (any float dtype, same shape, finite); a float64 tensor of 12 values."""
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    d = b - a
    ad = d.abs()
    ag = a.abs()
    rel = torch.where(ag > EPS, ad / ag, torch.zeros_like(ad))
    return torch.stack([
        (a * a).sum(), (b * b).sum(), (a * b).sum(), (d * d).sum(), ad.max(), ad.sum(), rel.max(),
        rel.sum(), (rel < 1e-3).sum().to(torch.float64), (rel < 5e-3).sum().to(torch.float64),
        torch.logsumexp(a, 0), torch.logsumexp(b, 0),
    ])


def pass2(a: torch.Tensor, b: torch.Tensor, lse_a: torch.Tensor) -> torch.Tensor:
    """Pass 2 on one chunk: float64 ``[sum p, sum p*d, sum p*expm1(d)]`` (see module docstring)."""
    a = a.to(torch.float64)
    d = b.to(torch.float64) - a
    p = (a - lse_a).exp()
    return torch.stack([p.sum(), (p * d).sum(), (p * torch.expm1(d)).sum()])


def _pass1_fused(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # fp32 element-wise (exact for the bf16/fp16/fp32 inputs), float64 accumulation
    d = b - a
    ad = d.abs()
    ag = a.abs()
    rel = torch.where(ag > EPS, ad / ag, torch.zeros_like(ad))
    a64, b64, d64 = a.double(), b.double(), d.double()
    # log-sum-exp with fp32 exp (2x the lanes of fp64) summed in fp64: ~1e-9 absolute error
    ma, mb = a.max(), b.max()
    lse_a = torch.exp(a - ma).double().sum().log() + ma.double()
    lse_b = torch.exp(b - mb).double().sum().log() + mb.double()
    return torch.stack([
        (a64 * a64).sum(), (b64 * b64).sum(), (a64 * b64).sum(), (d64 * d64).sum(), ad.max().double(),
        ad.double().sum(), rel.max().double(), rel.double().sum(), (rel < 1e-3).sum().double(),
        (rel < 5e-3).sum().double(), lse_a, lse_b,
    ])


def _pass2_fused(a: torch.Tensor, b: torch.Tensor, lse_a: torch.Tensor) -> torch.Tensor:
    # the weights p in fp32 (their error scales the divergence by ~1e-7), d and expm1 in fp64
    p = torch.exp(a - lse_a.float()).double()
    d = b.double() - a.double()
    return torch.stack([p.sum(), (p * d).sum(), (p * torch.expm1(d)).sum()])


def fused() -> tuple[Callable, Callable] | None:
    """The compiled (pass1, pass2) for fp32 chunks of ``FUSED_CHUNK`` elements, or None."""
    global _fused
    if not _wanted:
        return None
    if _fused is None:
        with _lock:
            if _fused is None:
                _fused = _compile() or False
    return _fused or None


def _compile() -> tuple[Callable, Callable] | None:
    if os.environ.get("LLMFLOW_FUSED", "1").lower() in ("0", "false", "no", "off"):
        return None
    try:
        p1 = torch.compile(_pass1_fused, dynamic=False, fullgraph=True)
        p2 = torch.compile(_pass2_fused, dynamic=False, fullgraph=True)
        a = torch.linspace(-1, 1, FUSED_CHUNK)
        b = a * 1.001
        got, want = p1(a, b), pass1(a, b)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-9):
            _log.warning("compare: the compiled kernel disagrees with eager torch; using eager")
            return None
        if not torch.allclose(p2(a, b, got[10]), pass2(a, b, want[10]), rtol=1e-5, atol=1e-9):
            _log.warning("compare: the compiled KL kernel disagrees with eager torch; using eager")
            return None
        return p1, p2
    except Exception as exc:  # no compiler, unsupported platform ...: eager works everywhere
        _log.info("compare: fused kernels unavailable (%s: %s); using eager torch", type(exc).__name__, exc)
        return None
