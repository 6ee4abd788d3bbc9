"""Pass / warn / fail: how far a target tensor may drift from golden, judged by the TARGET's dtype.

A bf16 target carries ~3 significant digits, so it cannot be held to fp32's tolerances; msprobe
fails every row of an fp32-vs-bf16 compare because the dtypes differ, we judge the numbers at the
precision the target stores. Defaults per dtype class are in ``DEFAULT_THRESHOLDS``; a workflow
overrides them with the ``thresholds:`` parameter, either for every dtype::

    thresholds: {cosine_similarity: {warn: 0.9999, fail: 0.999}}

or per dtype class (``float32``, ``float16``, ``bfloat16``, ``float8``, ``int8``, ``int4``,
``integer``)::

    thresholds: {bfloat16: {relative_euclidean_distance: {warn: 0.01, fail: 0.05}}}

A bare number is the fail limit. For metrics where higher is better (cosine, the error ratios)
a row is flagged when the value falls BELOW the limit, otherwise when it rises ABOVE it; a custom
algorithm column may say ``higher_is_better: true``.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any

from llmflow.errors import UserError

HIGHER_IS_BETTER = {"cosine_similarity", "one_thousandth_err_ratio", "five_thousandths_err_ratio"}

_T = dict[str, dict[str, float]]


def _lim(warn: float, fail: float) -> dict[str, float]:
    return {"warn": warn, "fail": fail}


DEFAULT_THRESHOLDS: dict[str, _T] = {
    "float64": {"cosine_similarity": _lim(0.999999, 0.9999),
                "relative_euclidean_distance": _lim(1e-5, 1e-3), "norm_rel_diff": _lim(1e-5, 1e-3)},
    "float32": {"cosine_similarity": _lim(0.99999, 0.999),
                "relative_euclidean_distance": _lim(1e-4, 1e-2), "norm_rel_diff": _lim(1e-4, 1e-2)},
    "float16": {"cosine_similarity": _lim(0.9999, 0.99),
                "relative_euclidean_distance": _lim(5e-3, 5e-2), "norm_rel_diff": _lim(5e-3, 5e-2)},
    "bfloat16": {"cosine_similarity": _lim(0.999, 0.98),
                 "relative_euclidean_distance": _lim(3e-2, 2e-1), "norm_rel_diff": _lim(3e-2, 2e-1)},
    "float8": {"cosine_similarity": _lim(0.99, 0.95),
               "relative_euclidean_distance": _lim(1e-1, 3e-1), "norm_rel_diff": _lim(1e-1, 3e-1)},
    "int8": {"cosine_similarity": _lim(0.99, 0.95),
             "relative_euclidean_distance": _lim(1e-1, 3e-1), "norm_rel_diff": _lim(1e-1, 3e-1)},
    "int4": {"cosine_similarity": _lim(0.98, 0.9),
             "relative_euclidean_distance": _lim(2e-1, 5e-1), "norm_rel_diff": _lim(2e-1, 5e-1)},
    # token ids, positions, masks: any difference is a failure
    "integer": {"max_absolute_error": _lim(0.0, 0.0), "norm_rel_diff": _lim(0.0, 0.0)},
}

_ALIASES = {
    "fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32", "tf32": "float32",
    "fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp8": "float8", "w8a8": "int8",
    "w8a16": "int8", "w4a16": "int4", "uint8": "integer", "int16": "integer", "int32": "integer",
    "int64": "integer", "bool": "integer", "long": "integer", "int": "integer",
}


def dtype_class(dtype: Any) -> str:
    """The threshold class of a dtype name (``"torch.bfloat16"``, ``"bf16"``, ``"int4"`` ...)."""
    name = str(dtype or "float32").lower().removeprefix("torch.")
    if name in DEFAULT_THRESHOLDS:
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    if name.startswith("float8"):
        return "float8"
    if name.startswith(("int", "uint")):
        return "integer"
    return "float32"


def _limit(metric: str, value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"warn": float(value), "fail": float(value)}
    if not isinstance(value, dict) or not set(value) <= {"warn", "fail", "higher_is_better"} or not (
            {"warn", "fail"} & set(value)):
        raise UserError(f"{where}.{metric}: expected a number or {{warn: x, fail: y}}, got {value!r}")
    out: dict[str, Any] = {}
    for k in ("warn", "fail"):
        if k in value:
            if not isinstance(value[k], (int, float)) or isinstance(value[k], bool):
                raise UserError(f"{where}.{metric}.{k}: expected a number, got {value[k]!r}")
            out[k] = float(value[k])
    out.setdefault("warn", out.get("fail"))
    out.setdefault("fail", out["warn"])
    if "higher_is_better" in value:
        out["higher_is_better"] = bool(value["higher_is_better"])
    return out


@lru_cache(maxsize=256)
def _resolve_cached(cls: str, overrides_json: str) -> dict[str, dict[str, Any]]:
    resolved: dict[str, dict[str, Any]] = {k: dict(v) for k, v in DEFAULT_THRESHOLDS[cls].items()}
    overrides = json.loads(overrides_json)
    for key, value in overrides.items():
        if key in DEFAULT_THRESHOLDS or key in _ALIASES:
            if dtype_class(key) != cls:
                continue
            if not isinstance(value, dict):
                raise UserError(f"thresholds.{key}: expected a mapping of metric -> limits")
            for metric, lim in value.items():
                resolved[metric] = _limit(metric, lim, f"thresholds.{key}")
        else:
            resolved[key] = _limit(key, value, "thresholds")
    return resolved


def resolve_thresholds(target_dtype: Any, thresholds: dict | None = None) -> dict[str, dict[str, Any]]:
    """Metric -> {warn, fail[, higher_is_better]} for one target dtype, overrides applied.

    Per-dtype override blocks beat global ones regardless of their order in the mapping.
    """
    cls = dtype_class(target_dtype)
    if not thresholds:
        return _resolve_cached(cls, "{}")
    if not isinstance(thresholds, dict):
        raise UserError(f"thresholds: expected a mapping, got {thresholds!r}")
    glob = {k: v for k, v in thresholds.items() if k not in DEFAULT_THRESHOLDS and k not in _ALIASES}
    per = {k: v for k, v in thresholds.items() if k in DEFAULT_THRESHOLDS or k in _ALIASES}
    return _resolve_cached(cls, json.dumps({**glob, **per}, sort_keys=False, default=str))


def _as_float(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def verdict(row: dict, target_dtype: Any, thresholds: dict | None = None) -> str:
    """``"pass"``, ``"warn"`` or ``"fail"`` for one compared row.

    Fail: shape mismatch that could not be compared, NaN/Inf the golden side does not have, no
    comparable element, or a metric beyond its fail limit. Warn: NaN/Inf on both sides alike, or a
    metric beyond its warn limit. A NaN metric with a limit fails, except cosine similarity, which
    is undefined for an all-zero side (relative_euclidean_distance judges that case).
    """
    reason = str(row.get("reason") or "")
    if reason.startswith("shape mismatch") and _as_float(row.get("cosine_similarity")) is None:
        return "fail"
    if "no element finite" in reason or "empty tensor" in reason:
        return "fail"
    if reason.startswith("statistics missing"):
        return "fail"
    g_bad = int(row.get("golden_nan") or 0) + int(row.get("golden_inf") or 0)
    t_bad = int(row.get("target_nan") or 0) + int(row.get("target_inf") or 0)
    if t_bad > g_bad:
        return "fail"
    result = "warn" if t_bad or g_bad else "pass"
    for metric, lim in resolve_thresholds(target_dtype, thresholds).items():
        if metric not in row:
            continue
        v = _as_float(row[metric])
        if v is None:
            continue
        higher = lim.get("higher_is_better", metric in HIGHER_IS_BETTER)
        if math.isnan(v):
            if metric == "cosine_similarity":
                continue
            return "fail"
        if (v < lim["fail"]) if higher else (v > lim["fail"]):
            return "fail"
        if (v < lim["warn"]) if higher else (v > lim["warn"]):
            result = "warn"
    return result
