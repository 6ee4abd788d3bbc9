"""The numbers of one golden/target tensor pair, and the pass/warn/fail verdict drawn from them.

``compare_tensors`` is the hot loop of every compare: a 7B model's dump is ~100k pairs and
gigabytes of data. It reads both tensors once, piece by piece (``kernels.py``): float32/
bfloat16/float16 tensors through the compiled kernel (spans of ``kernels.FUSED_SPAN`` elements;
fp16 converted into small reused fp32 buffers; ~6 us for a 576-element pair, where eager
torch's ~30 ops take ~110 us), other dtypes in eager float64 chunks of ``CHUNK``, and a piece with
NaN/Inf (a kernel span row by row first) eagerly with those elements counted and left out.
Every piece returns float64 sums; ``_merge`` adds them up, rescaling the softmax-weighted KL
sums of each piece by exp(lse_piece - lse) (online softmax), and ``_kl`` turns them into
KL = z + (log1p(u) - u) (see ``kernels``). The temporary memory is a few pieces whatever the
tensor size.

Column names follow msit llm compare, with msprobe's error ratios and a few of our own:

=============================  =================================================================
column                         definition (g golden, t target, d = t - g, eps = float32 eps)
=============================  =================================================================
cosine_similarity              g.t / (|g| |t|); 1 when both are all zero, NaN when one is
max_relative_error             max of |d| / |g| over elements with |g| > eps (others count 0)
mean_relative_error            mean of the same over all elements (msit's ``np.where(...).mean()``)
max_absolute_error             max |d|
mean_absolute_error            mean |d|
kl_divergence                  KL(softmax(g) || softmax(t)) over the flattened tensors
relative_euclidean_distance    |d| / |g| (0 when both are zero, inf when only g is zero)
rmse                           sqrt(mean d^2)
one_thousandth_err_ratio       share of elements whose relative error (as above) is < 0.001
five_thousandths_err_ratio     share of elements whose relative error is < 0.005
golden_nan, golden_inf, ...    NaN / +-Inf counts per side; metrics use the elements finite on both
golden_max, ..., target_norm   each side's max, min, mean and L2 norm over its own finite elements
                               (msit's and msprobe's per-side statistics, from the same read)
=============================  =================================================================

A pair that cannot be compared (shape mismatch, empty, no finite element) gets a ``code``
(``llmflow.compare.codes``), a ``reason`` and NaN metrics instead of raising: one odd tensor never
stops a 100k-row compare. ``thresholds.judge`` turns a row into its final code and verdict.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any

import torch

from llmflow.compare import kernels
from llmflow.compare.codes import Code
from llmflow.compare.columns import COUNT_COLUMNS, METRIC_COLUMNS, SIDE_COLUMNS, STAT_COLUMNS, known_metrics
from llmflow.compare.statistics import (
    compare_stats,
    put_sides,
    side_stats,
)
from llmflow.compare.thresholds import judge, resolve_thresholds, verdict
from llmflow.dtypes import DEFAULT_THRESHOLDS, dtype_class

__all__ = ["COLUMNS", "METRIC_COLUMNS", "CHUNK", "DEFAULT_THRESHOLDS", "compare_tensors", "compare_stats",
           "dtype_class", "judge", "resolve_thresholds", "verdict", "STAT_COLUMNS", "SIDE_COLUMNS",
           "known_metrics", "side_stats"]

EPS = kernels.EPS
CHUNK = 1 << 16  # elements per eager chunk: 64k float64 values x a few temporaries fit in L2 cache
_FUSABLE = (*kernels.KERNEL_DTYPES, torch.float16)  # fp16 through a float32 buffer (``_f32``)
_CONVERT_SPAN = 8 * kernels.FUSED_CHUNK  # fp16 elements per kernel call: 2 MiB fp32 buffers
_scratch = threading.local()

COLUMNS = (METRIC_COLUMNS + SIDE_COLUMNS + COUNT_COLUMNS
           + ("numel", "shape_mismatch", "dtype_mismatch", "code", "reason"))
_OK = Code.OK.value


_NAN_ROW = dict.fromkeys(METRIC_COLUMNS + SIDE_COLUMNS, math.nan)
_ZERO_COUNTS = dict.fromkeys(COUNT_COLUMNS, 0)


def _empty_row(golden: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    row: dict[str, Any] = {**_NAN_ROW, **_ZERO_COUNTS}
    row.update(numel=golden.numel(), shape_mismatch=tuple(golden.shape) != tuple(target.shape),
               dtype_mismatch=golden.dtype != target.dtype, code=_OK, reason="")
    return row


def _nonfinite(x: torch.Tensor) -> tuple[int, int]:
    return int(torch.isnan(x).sum()), int(torch.isinf(x).sum())


def compare_tensors(golden: torch.Tensor, target: torch.Tensor, kl: bool = True) -> dict[str, Any]:
    """Every metric of ``COLUMNS`` for one pair; never raises on odd data (see ``reason``). Without
    ``kl`` the KL divergence is not computed (its column None): its exp is about half the compiled
    kernel's arithmetic."""
    golden, target = golden.detach(), target.detach()
    row = _empty_row(golden, target)
    if not kl:
        row["kl_divergence"] = None
    if row["shape_mismatch"]:
        if golden.numel() == target.numel() and golden.numel() > 0:
            # same data, different view (e.g. [1, n, h] vs [n, h]): compare flat, but say so
            row["reason"] = f"compared flat: golden shape {list(golden.shape)}, target {list(target.shape)}"
            target = target.reshape(golden.shape)
        else:
            row["reason"] = f"shape mismatch: golden {list(golden.shape)}, target {list(target.shape)}"
            row["code"] = Code.SHAPE_MISMATCH.value
            put_sides(row, side_stats(golden), side_stats(target))
            return row
    if golden.numel() == 0:
        row["reason"] = "empty tensor on both sides"
        row["code"] = Code.EMPTY_TENSOR.value
        return row
    g_float, t_float = golden.is_floating_point(), target.is_floating_point()
    if g_float != t_float and not (golden.is_complex() or target.is_complex()):
        kinds = ("floating" if g_float else "integer", "floating" if t_float else "integer")
        row["code"] = Code.DTYPE_MISMATCH.value
        row["reason"] = "; ".join(filter(None, [row["reason"], f"{kinds[0]} golden, {kinds[1]} target"]))
    if golden.is_complex() or target.is_complex():
        golden, target = torch.view_as_real(golden), torch.view_as_real(target)
    if golden.dtype == torch.bool:
        golden = golden.to(torch.uint8)
    if target.dtype == torch.bool:
        target = target.to(torch.uint8)
    g = golden.cpu().reshape(-1) if golden.is_contiguous() else golden.cpu().contiguous().reshape(-1)
    t = target.cpu().reshape(-1) if target.is_contiguous() else target.cpu().contiguous().reshape(-1)
    acc = _reduce(g, t, kl)
    row.update(_finish(acc))
    row["kl_divergence"] = _kl(acc) if kl else None
    reasons = [row["reason"]] if row["reason"] else []
    for side in ("golden", "target"):
        n_nan, n_inf = row[f"{side}_nan"], row[f"{side}_inf"]
        if n_nan or n_inf:
            reasons.append(f"{side} has {n_nan} NaN, {n_inf} Inf")
    if acc["valid"] == 0:
        reasons.append("no element finite on both sides")
        row["code"] = Code.NO_FINITE.value
    row["reason"] = "; ".join(reasons)
    return row


def _reduce(g: torch.Tensor, t: torch.Tensor, kl: bool = True) -> dict[str, Any]:
    """Pass 1 over both flat tensors, piece by piece, accumulating float64 sums (``kernels``);
    the KL's softmax sums only where ``kl``."""
    acc: dict[str, Any] = dict(gg=0.0, tt=0.0, gt=0.0, dd=0.0, max_abs=0.0, sum_abs=0.0, max_rel=0.0,
                               sum_rel=0.0, c1=0, c5=0, valid=0, golden_nan=0, golden_inf=0,
                               target_nan=0, target_inf=0, lse_g=-math.inf, lse_t=-math.inf,
                               kl_w=0.0, kl_y=0.0, kl_z=0.0, g_max=-math.inf, g_min=math.inf, g_sum=0.0,
                               g_sq=0.0, g_n=0, t_max=-math.inf, t_min=math.inf, t_sum=0.0, t_sq=0.0, t_n=0)
    n = g.numel()
    if not (g.is_floating_point() or t.is_floating_point()) and torch.equal(g, t):
        # integer data, equal element for element (position ids, cache positions, masks: most
        # integer pairs of a dump): the sums of an exact match in 3 ops, not ~30 eager float64
        # ones (~300 us a pair, a tenth of a real module-level compare)
        g64 = g.to(torch.float64).reshape(-1)
        hi, lo, total = float(g64.max()), float(g64.min()), float(kernels.fixed_sum(g64))
        lse = hi + math.log(float(kernels.fixed_sum((g64 - hi).exp_())))
        sq = float(kernels.fixed_dot(g64, g64))
        acc.update(gg=sq, tt=sq, gt=sq, c1=n, c5=n, valid=n, lse_g=lse, lse_t=lse, kl_w=1.0)
        for side in "gt":
            acc.update({f"{side}_max": hi, f"{side}_min": lo, f"{side}_sum": total, f"{side}_sq": sq,
                        f"{side}_n": n})
        return acc
    fast = g.dtype in _FUSABLE and t.dtype in _FUSABLE and kernels.fused()
    # (start, stop, fused): kernel spans, or eager chunks; fp16 spans are converted into
    # small reused buffers (a fresh 16 MiB tensor per span costs more in page faults than the
    # conversion) and read back from cache
    pieces: deque[tuple[int, int, bool]] = deque()
    if fast:
        read_as_is = g.dtype in kernels.KERNEL_DTYPES and t.dtype in kernels.KERNEL_DTYPES
        span = kernels.FUSED_SPAN if read_as_is else _CONVERT_SPAN
        pieces.extend((s, min(s + span, n), True) for s in range(0, n, span))
    else:
        pieces.extend((s, min(s + CHUNK, n), False) for s in range(0, n, CHUNK))
    while pieces:
        start, stop, on_kernel = pieces.popleft()
        a, b = g[start:stop], t[start:stop]
        if on_kernel:
            vals = fast(_f32(a, 0), _f32(b, 1), kl).tolist()
        else:
            vals = kernels.pass1(a, b, kl).tolist()
        if on_kernel and not all(map(math.isfinite, vals)):
            if stop - start > kernels.FUSED_CHUNK:
                # NaN/Inf somewhere in the span: redo it row by row, so only those rows go slow
                pieces.extendleft((s, min(s + kernels.FUSED_CHUNK, stop), True)
                                  for s in reversed(range(start, stop, kernels.FUSED_CHUNK)))
                continue
            if math.isfinite(vals[0] + vals[1]):
                # finite data beyond the kernel's fp32 range (a difference > 88, exp overflows)
                vals = kernels.pass1(a, b, kl).tolist()
        if not math.isfinite(vals[0] + vals[1]):
            # the rare slow path: count NaN/Inf per side, each side's statistics over its own
            # finite elements, the metrics over the elements finite on both
            for side, x in (("golden", a), ("target", b)):
                n_nan, n_inf = _nonfinite(x)
                acc[f"{side}_nan"] += n_nan
                acc[f"{side}_inf"] += n_inf
                _merge_side(acc, side[0], x[torch.isfinite(x)].to(torch.float64))
            keep = torch.isfinite(a) & torch.isfinite(b)
            a, b = a[keep], b[keep]
            if a.numel() == 0:
                continue
            _merge(acc, kernels.pass1(a, b, kl).tolist(), a.numel(), sides=False, softmax=kl)
            continue
        _merge(acc, vals, a.numel(), softmax=kl)
    return acc


def _merge_side(acc: dict[str, Any], side: str, x: torch.Tensor) -> None:
    """Add one side's finite float64 elements to its statistics (``side``: "g" or "t")."""
    if x.numel() == 0:
        return
    acc[f"{side}_max"] = max(acc[f"{side}_max"], float(x.max()))
    acc[f"{side}_min"] = min(acc[f"{side}_min"], float(x.min()))
    acc[f"{side}_sum"] += float(kernels.fixed_sum(x))
    acc[f"{side}_sq"] += float(kernels.fixed_dot(x, x))
    acc[f"{side}_n"] += x.numel()


def _f32(x: torch.Tensor, slot: int) -> torch.Tensor:
    """``x`` as the kernel reads it: itself (float32, bfloat16), or converted to float32 into this
    thread's buffer ``slot`` (reused)."""
    if x.dtype in kernels.KERNEL_DTYPES:
        return x
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(slot)
    if buf is None or buf.numel() < x.numel():
        buf = buffers[slot] = torch.empty(max(x.numel(), _CONVERT_SPAN), dtype=torch.float32)
    return buf[:x.numel()].copy_(x)


def _merge(acc: dict[str, Any], vals: list[float], count: int, sides: bool = True,
           softmax: bool = True) -> None:
    """Add one piece's ``kernels.N_VALUES`` to the running sums (``sides``: its statistics of each
    side too; not for a piece filtered to the elements finite on both; ``softmax``: its KL sums,
    which a piece computed without them holds as 0)."""
    if sides:  # (unrolled: this runs for every piece of every pair)
        g_max, g_min, g_sum, t_max, t_min, t_sum = vals[14:20]
        if g_max > acc["g_max"]:
            acc["g_max"] = g_max
        if g_min < acc["g_min"]:
            acc["g_min"] = g_min
        if t_max > acc["t_max"]:
            acc["t_max"] = t_max
        if t_min < acc["t_min"]:
            acc["t_min"] = t_min
        acc["g_sum"] += g_sum
        acc["t_sum"] += t_sum
        acc["g_sq"] += vals[0]
        acc["t_sq"] += vals[1]
        acc["g_n"] += count
        acc["t_n"] += count
    for key, v in zip(("gg", "tt", "gt", "dd"), vals[:4], strict=True):
        acc[key] += v
    acc["max_abs"] = max(acc["max_abs"], vals[4])
    acc["sum_abs"] += vals[5]
    acc["max_rel"] = max(acc["max_rel"], vals[6])
    acc["sum_rel"] += vals[7]
    acc["c1"] += int(vals[8])
    acc["c5"] += int(vals[9])
    acc["valid"] += count
    if not softmax:
        return
    # the KL sums, each piece's weights normalised by its own log-sum-exp (sum w = 1): rescale
    # the running sums and the piece's to the merged log-sum-exp (online softmax)
    lse = _logaddexp(acc["lse_g"], vals[10])
    old_scale = math.exp(acc["lse_g"] - lse) if acc["lse_g"] > -math.inf else 0.0
    new_scale = math.exp(vals[10] - lse) if vals[10] > -math.inf else 0.0
    acc["kl_w"] = acc["kl_w"] * old_scale + new_scale
    acc["kl_y"] = acc["kl_y"] * old_scale + vals[12] * new_scale
    acc["kl_z"] = acc["kl_z"] * old_scale + vals[13] * new_scale
    acc["lse_g"] = lse
    acc["lse_t"] = _logaddexp(acc["lse_t"], vals[11])


def _logaddexp(x: float, y: float) -> float:
    if x == -math.inf:
        return y
    if y == -math.inf:
        return x
    m = max(x, y)
    return m + math.log(math.exp(x - m) + math.exp(y - m))


def _finish(acc: dict[str, float]) -> dict[str, Any]:
    """Turn the float64 sums of ``_reduce`` into the row's metrics."""
    out: dict[str, Any] = {k: int(acc[k]) for k in COUNT_COLUMNS}
    if acc["g_n"]:
        out.update(golden_max=acc["g_max"], golden_min=acc["g_min"], golden_mean=acc["g_sum"] / acc["g_n"],
                   golden_norm=math.sqrt(acc["g_sq"]))
    if acc["t_n"]:
        out.update(target_max=acc["t_max"], target_min=acc["t_min"], target_mean=acc["t_sum"] / acc["t_n"],
                   target_norm=math.sqrt(acc["t_sq"]))
    n = acc["valid"]
    if n == 0:
        return out
    g_norm, t_norm, d_norm = math.sqrt(acc["gg"]), math.sqrt(acc["tt"]), math.sqrt(acc["dd"])
    if g_norm <= EPS and t_norm <= EPS:
        cos = 1.0
    elif g_norm <= EPS or t_norm <= EPS:
        cos = math.nan  # direction of a zero vector: undefined (msit says the same)
    else:
        cos = max(-1.0, min(1.0, acc["gt"] / (g_norm * t_norm)))
    if g_norm > EPS:
        red = d_norm / g_norm
    else:
        red = 0.0 if d_norm <= EPS else math.inf
    out.update(
        cosine_similarity=cos,
        max_relative_error=acc["max_rel"],
        mean_relative_error=acc["sum_rel"] / n,
        max_absolute_error=acc["max_abs"],
        mean_absolute_error=acc["sum_abs"] / n,
        relative_euclidean_distance=red,
        rmse=math.sqrt(acc["dd"] / n),
        one_thousandth_err_ratio=acc["c1"] / n,
        five_thousandths_err_ratio=acc["c5"] / n,
    )
    return out


def _kl(acc: dict[str, Any]) -> float:
    """KL(softmax(g) || softmax(t)) over all elements finite on both sides, from ``_reduce``'s sums.

    For logits ``[1, vocab]`` this is the divergence of the two next-token distributions; for
    activations it is msit's ``kl_divergence`` column on the flattened tensor. With
    y = sum w d, z = sum w (expm1(d) - d) and u = y + z = sum w expm1(d) (``kernels``):
    KL = z + (log1p(u) - u) = -y + log1p(u).
    """
    if acc["valid"] == 0 or not (math.isfinite(acc["lse_g"]) and math.isfinite(acc["lse_t"])):
        return math.nan
    w = acc["kl_w"]
    if not w > 0:
        return math.nan
    y, z = acc["kl_y"] / w, acc["kl_z"] / w
    u = y + z
    if math.isfinite(u) and -0.5 < u <= 1.0:
        # z (a sum of terms >= 0, each to fp32 precision) carries a small divergence precisely
        kl = z + _log1p_minus_x(u)
    elif math.isfinite(u) and u > 1.0:
        kl = -y + math.log1p(u)  # z and u both large: their difference would cancel
    else:
        # a difference beyond exp's range, or a target that puts almost no mass where the golden
        # does (u near -1, where y + z cancels): the divergence is then large (> log 2) or the
        # tensors differ by about a constant shift, and the log-sum-exps are precise enough
        kl = -y + acc["lse_t"] - acc["lse_g"] - math.log(w)
    return max(kl, 0.0) if math.isfinite(kl) else math.nan


def _log1p_minus_x(u: float) -> float:
    """log1p(u) - u without cancellation for small u (-u^2/2 + u^3/3 - ...)."""
    if abs(u) >= 1e-2:
        return math.log1p(u) - u
    return -u * u * sum((-u) ** k / (k + 2) for k in range(9))
