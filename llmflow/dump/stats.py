"""Per-tensor statistics: max, min, mean, L2 norm, NaN count, Inf count (``STAT_KEYS`` order).

Statistics mode is dominated by per-call overhead, not arithmetic: a decode step of a 30-layer
model captures ~1000 small tensors. So the forward pass only takes a copy of each tensor, and the
writer thread computes the statistics of many tensors at once (``batched_stats``): tensors of one
(device, dtype, shape) are stacked and reduced along one axis, a handful of ops per group instead
of five per tensor, all on the tensors' own device, read back once per group. NaN/Inf are counted
only for tensors whose sum is not finite: a finite sum proves there is no NaN and no Inf.

Reductions accumulate in float32 at least (a bf16 sum of 10^5 values would round badly), float64
for float64 and integer tensors. An empty tensor gets NaN statistics and zero counts.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from llmflow.formats.base import STAT_KEYS

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
    for (_, dtype, _), idx in groups.items():
        wide = _wide(dtype)
        x = torch.stack([tensors[i] for i in idx]).reshape(len(idx), -1)
        if x.is_complex():
            x = x.abs()
        if x.dtype != wide:
            x = x.to(wide)
        mn, mx = x.amin(dim=1), x.amax(dim=1)  # aminmax(dim=1) measured 6x slower on CPU
        total = x.sum(dim=1)
        norm = torch.linalg.vector_norm(x, dim=1)
        rows = torch.stack([mx, mn, total, norm], dim=1).tolist()
        n = x.shape[1]
        for j, (i, (vmax, vmin, vsum, vnorm)) in enumerate(zip(idx, rows, strict=True)):
            nan = inf = 0
            if not math.isfinite(vsum):
                nan, inf = int(torch.isnan(x[j]).sum()), int(torch.isinf(x[j]).sum())
            out[i] = [vmax, vmin, vsum / n, vnorm, nan, inf]
    return out  # type: ignore[return-value]


def tensor_stats(t: torch.Tensor) -> dict[str, float]:
    """The statistics of one tensor (same definitions as ``batched_stats``), by name."""
    return dict(zip(STAT_KEYS, batched_stats([t.detach()])[0], strict=True))
