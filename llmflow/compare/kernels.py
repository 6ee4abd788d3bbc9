"""The per-chunk reductions behind ``compare_tensors``: eager torch, and a fused compiled version.

One pass over a chunk of golden ``a`` and target ``b`` returns, in this order (``N_VALUES``)::

    sum a^2, sum b^2, sum a*b, sum d^2, max|d|, sum|d|, max rel, sum rel, #rel<1e-3, #rel<5e-3,
    lse(a), lse(b), sum w, sum w*d, sum w*expm1(d)

with d = b - a, rel = |d| / |a| where |a| > eps (else 0), lse the log-sum-exp and
w = exp(a - lse(a)) the chunk's own softmax weights. ``metrics`` merges chunks by rescaling with
their log-sum-exps (the online-softmax identity), and gets
KL(softmax(a) || softmax(b)) = -sum(w d)/W + log1p(sum(w expm1 d)/W), a form that needs no
precise log-sum-exp and keeps tiny divergences (fp32 vs fp32: 1e-12) exact: one read of the data
for every metric, KL included. All sums are accumulated in float64.

Eager torch needs ~20 separate element-wise passes per chunk; on big tensors that, not the disk,
is the bottleneck (~0.6 GB/s on 2 cores). Compiled, each pass is a loop or two over the data
(~4 GB/s on 2 cores, fp32), so chunks of exactly ``FUSED_CHUNK`` elements of a tensor
at least that large go through the compiled kernels when a C++ compiler is available. They are
compiled ahead of time (torch.export + AOTInductor) once per machine and torch version into the
llmflow cache, and loaded through torch's C++ package loader, which takes milliseconds per process
where ``torch.compile`` takes seconds (so worker processes start fast). Where that fails,
``torch.compile`` is tried, then eager torch. ``LLMFLOW_FUSED=0`` turns the compiled kernels off;
every compiled kernel is checked against eager torch before it is used.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
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
N_VALUES = 15
FUSED_CHUNK = 1 << 18  # 1 MiB per side in fp32: the kernel's second loop reads it from cache
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_fused: Callable | None | bool = None  # None: not tried yet; False: unavailable
# The kernel is compiled ahead of time once per machine (~20 s; `make install` does it) and then
# loads in milliseconds. Without that cache a compare builds it only when it has this much to
# read per process, where the build pays for itself (eager torch: ~0.6 GB/s on 2 cores, fused:
# ~4 GB/s).
FUSE_MIN_BYTES = 8 << 30


def pass1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One chunk (any float dtype, same shape, finite); a float64 tensor of ``N_VALUES`` values."""
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    d = b - a
    ad = d.abs()
    ag = a.abs()
    rel = torch.where(ag > EPS, ad / ag, torch.zeros_like(ad))
    lse_a = torch.logsumexp(a, 0)
    w = (a - lse_a).exp()
    return torch.stack([
        (a * a).sum(), (b * b).sum(), (a * b).sum(), (d * d).sum(), ad.max(), ad.sum(), rel.max(),
        rel.sum(), (rel < 1e-3).sum().to(torch.float64), (rel < 5e-3).sum().to(torch.float64),
        lse_a, torch.logsumexp(b, 0), w.sum(), (w * d).sum(), (w * torch.expm1(d)).sum(),
    ])


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
    # the KL weights in fp32 (their error scales the divergence by ~1e-7), d and expm1 in fp64
    w = torch.exp(a - lse_a.float()).double()
    return torch.stack([
        (a64 * a64).sum(), (b64 * b64).sum(), (a64 * b64).sum(), (d64 * d64).sum(), ad.max().double(),
        ad.double().sum(), rel.max().double(), rel.double().sum(), (rel < 1e-3).sum().double(),
        (rel < 5e-3).sum().double(), lse_a, lse_b, w.sum(), (w * d64).sum(), (w * torch.expm1(d64)).sum(),
    ])


def fused(build: bool = False) -> Callable | None:
    """The compiled ``pass1`` for fp32 chunks of exactly ``FUSED_CHUNK`` elements, or None.

    Loads the cached package (milliseconds); compiles it only with ``build`` (seconds), which
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
    return not _disabled() and (package_dir() / "pass1.pt2").is_file()


def package_dir() -> Path:
    """Where the kernels compiled for this torch and this kernel source are cached."""
    from llmflow.models import cache_dir

    src = inspect.getsource(_pass1_fused) + str(FUSED_CHUNK)
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"torch-{torch.__version__}-{platform.machine()}-{key}"


def build_packages() -> Path:
    """Compile the kernel ahead of time (torch.export + AOTInductor, ~20 s once per machine)."""
    final = package_dir()
    if packaged():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        a, b = torch.linspace(-1, 1, FUSED_CHUNK), torch.linspace(-2, 2, FUSED_CHUNK)  # distinct: no aliasing
        with warnings.catch_warnings():  # torch's own deprecation chatter from export
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.export.export(_AsModule(_pass1_fused), (a, b), strict=False)
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp / "pass1.pt2"))
        if not final.exists():
            os.replace(tmp, final)  # atomic: a concurrent builder's result is as good as ours
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


class _AsModule(torch.nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


def _disabled() -> bool:
    return os.environ.get("LLMFLOW_FUSED", "1").lower() in ("0", "false", "no", "off")


def _load_or_build() -> Callable | None:
    """The AOT package (built on first need), else torch.compile, else None (eager torch)."""
    try:
        d = build_packages()
        # the C++ loader: no import of torch._inductor (~1 s), so every worker starts in ms
        loader = torch._C._aoti.AOTIModelPackageLoader(str(d / "pass1.pt2"), "model", False, 1, -1)

        def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return loader.run([a, b])[0]

        if _agrees(kernel):
            return kernel
    except Exception as exc:  # no compiler, a private API that moved ...: try the JIT
        _log.info("compare: ahead-of-time kernels unavailable (%s: %s)", type(exc).__name__, exc)
    try:
        kernel = torch.compile(_pass1_fused, dynamic=False, fullgraph=True)
        if _agrees(kernel):
            return kernel
    except Exception as exc:  # no compiler, unsupported platform ...: eager works everywhere
        _log.info("compare: fused kernels unavailable (%s: %s); using eager torch", type(exc).__name__, exc)
    return None


def _agrees(kernel: Callable) -> bool:
    """The compiled kernel gives eager torch's results on a test chunk."""
    a = torch.linspace(-1, 1, FUSED_CHUNK)
    b = a * 1.001
    if not torch.allclose(kernel(a, b), pass1(a, b), rtol=1e-5, atol=1e-9):
        _log.warning("compare: the compiled kernel disagrees with eager torch; using eager")
        return False
    return True


if __name__ == "__main__":  # python -m llmflow.compare.kernels: build the kernels now (install time)
    # build=True: on a fresh machine nothing is cached yet, and building it is this command's job
    print(f"llmflow: fused compare kernels in {package_dir()}"
          if fused(build=True) and packaged() else "llmflow: fused compare kernels unavailable here; compare uses eager torch")
