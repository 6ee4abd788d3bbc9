"""Statistics of a tensor, and the compare of two statistics-only entries.

Each side's max, min, mean and L2 norm are columns of every compare row (msit and msprobe show
them beside the metrics): ``compare_tensors`` gets them from the same read as its metrics, the
rest of this module serves what that read cannot (a pair of different element counts, a dump
that recorded statistics only: ``compare_stats``, whose differences are judged like metrics).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llmflow.compare.codes import Code
from llmflow.compare.columns import SIDE_COLUMNS, STAT_COLUMNS, STATS
from llmflow.compare.kernels import EPS, fixed_dot, fixed_sum


def side_stats(x: torch.Tensor) -> dict[str, float]:
    """max, min, mean and L2 norm of one tensor over its finite elements (NaN when it has none)."""
    x = x.detach().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    x = x.to(torch.float64)
    finite = x[torch.isfinite(x)]
    if finite.numel() == 0:
        return {s: math.nan for s in STATS}
    return {"max": float(finite.max()), "min": float(finite.min()),
            "mean": float(fixed_sum(finite)) / finite.numel(),
            "norm": math.sqrt(float(fixed_dot(finite, finite)))}


def put_sides(row: dict[str, Any], golden: dict[str, float], target: dict[str, float]) -> None:
    for side, stats in (("golden", golden), ("target", target)):
        for s in STATS:
            row[f"{side}_{s}"] = stats[s]


def compare_stats(golden: dict[str, float] | None, target: dict[str, float] | None) -> dict[str, Any]:
    """Statistics-only entries: abs and relative differences of max, min, mean and norm, and each
    side's statistics as they were recorded.

    A statistic one side did not record (msprobe leaves an integer tensor's mean and norm out) is
    not available: its columns are None and the row is judged by what both sides have; a row
    where no statistic is on both sides is ``stats_missing``. A NaN/Inf statistic (the tensor
    holds NaN/Inf) is compared as such: the same non-finite value on both sides is
    ``nan_inf_shared``, on one side only, or a different one, ``nan_inf``.
    """
    row: dict[str, Any] = dict.fromkeys(STAT_COLUMNS + SIDE_COLUMNS)
    row["reason"] = ""
    row["code"] = Code.OK.value
    for side, stats in (("golden", golden), ("target", target)):
        for key in STATS:
            v = (stats or {}).get(key)
            if v is not None:
                row[f"{side}_{key}"] = float(v)
    if not golden or not target:
        row["reason"] = "statistics missing on the " + ("golden" if not golden else "target") + " side"
        row["code"] = Code.STATS_MISSING.value
        return row
    compared, shared, apart = [], [], []
    for key in STATS:
        gv, tv = row[f"golden_{key}"], row[f"target_{key}"]
        if gv is None or tv is None:
            continue
        compared.append(key)
        if not (math.isfinite(gv) and math.isfinite(tv)):
            same = gv == tv or (math.isnan(gv) and math.isnan(tv))
            (shared if same else apart).append(f"{key} golden {gv:g}, target {tv:g}")
            continue
        diff = abs(tv - gv)
        row[f"{key}_diff"] = diff
        row[f"{key}_rel_diff"] = diff / abs(gv) if abs(gv) > EPS else (0.0 if diff <= EPS else math.inf)
    reasons = []
    if not compared:
        have = {side: [k for k in STATS if row[f"{side}_{k}"] is not None] for side in ("golden", "target")}
        row["code"] = Code.STATS_MISSING.value
        row["reason"] = (f"no statistic on both sides (golden has {', '.join(have['golden']) or 'none'}, "
                         f"target {', '.join(have['target']) or 'none'})")
        return row
    if apart:
        row["code"] = Code.NAN_INF.value
        reasons.append("NaN/Inf statistics on one side only: " + "; ".join(apart))
    elif shared:
        row["code"] = Code.NAN_INF_SHARED.value
        reasons.append("NaN/Inf statistics on both sides: " + "; ".join(shared))
    for side, stats in (("golden", golden), ("target", target)):
        row[f"{side}_nan"] = int(stats.get("nan") or 0)
        row[f"{side}_inf"] = int(stats.get("inf") or 0)
        if row[f"{side}_nan"] or row[f"{side}_inf"]:
            reasons.append(f"{side} has {row[side + '_nan']} NaN, {row[side + '_inf']} Inf")
    row["reason"] = "; ".join(reasons)
    return row
