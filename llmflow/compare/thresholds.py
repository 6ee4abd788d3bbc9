"""Pass / warn / fail: how far a target tensor may drift from golden, judged by the TARGET's dtype.

A bf16 target carries ~3 significant digits, so it cannot be held to fp32's tolerances; msprobe
fails every row of an fp32-vs-bf16 compare because the dtypes differ, we judge the numbers at the
precision the target stores. Defaults per dtype class are in ``DEFAULT_THRESHOLDS``
(llmflow/dtypes.py, beside the other per-dtype tolerances); a workflow overrides them with the
``thresholds:`` parameter, either for every dtype::

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
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from llmflow.compare.codes import RANK_OF_VALUE, VERDICT_OF_VALUE, Code
from llmflow.dtypes import CLASS_ALIASES as _ALIASES
from llmflow.dtypes import DEFAULT_THRESHOLDS, dtype_class, dtype_name
from llmflow.errors import UserError

HIGHER_IS_BETTER = {"cosine_similarity", "one_thousandth_err_ratio", "five_thousandths_err_ratio"}


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (a CSV cell, a metric), else None: the
    errors that rankings and medians may take (a NaN or Inf one is judged on its own)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _exponent_text(value: Any) -> Any:
    """A number YAML 1.1 (PyYAML) leaves as text, ``1e-9`` (an exponent without a dot; JSON and
    YAML 1.2 read it as a number), as that number; anything else as it is."""
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        return float(value)
    return value


def _limit(metric: str, value: Any, where: str) -> dict[str, Any]:
    """One metric's limits ``{warn, fail[, higher_is_better]}``; UserError naming the field."""
    value = _exponent_text(value)
    if isinstance(value, dict):
        value = {k: _exponent_text(v) if k in ("warn", "fail") else v for k, v in value.items()}
    if _number(value):  # the fail limit, warned at too
        _check_order(metric, {"warn": float(value), "fail": float(value)}, where, bare=True)
        return {"warn": float(value), "fail": float(value)}
    if not isinstance(value, dict) or not ({"warn", "fail"} & set(value)):
        raise UserError(f"{where}.{metric}: expected a number or {{warn: x, fail: y}}, got {value!r}")
    extra = set(value) - {"warn", "fail", "higher_is_better"}
    if extra:
        raise UserError(f"{where}.{metric}: unknown field {sorted(map(str, extra))[0]!r} "
                        "(fields: warn, fail, higher_is_better)")
    out: dict[str, Any] = {}
    for k in ("warn", "fail"):
        if k in value:
            if not _number(value[k]):
                raise UserError(f"{where}.{metric}.{k}: expected a number, got {value[k]!r}")
            out[k] = float(value[k])
    out.setdefault("warn", out.get("fail"))
    out.setdefault("fail", out["warn"])
    if "higher_is_better" in value:
        if not isinstance(value["higher_is_better"], bool):
            raise UserError(f"{where}.{metric}.higher_is_better: expected true or false, "
                            f"got {value['higher_is_better']!r}")
        out["higher_is_better"] = value["higher_is_better"]
    _check_order(metric, out, where)
    return out


# the built-in metrics bounded on both sides: a limit outside fails (or passes) every row
_BOUNDS = {"cosine_similarity": (-1.0, 1.0), "one_thousandth_err_ratio": (0.0, 1.0),
           "five_thousandths_err_ratio": (0.0, 1.0)}


def _check_order(metric: str, limits: dict[str, Any], where: str, bare: bool = False) -> None:
    """A row warns before it fails: the warn limit lies on the good side of the fail limit, and
    both within the metric's range (UserError naming the field otherwise; ``bare``: one number
    gave both)."""
    low, high = _BOUNDS.get(metric, (-math.inf, math.inf))
    for k in ("warn", "fail"):
        if not low <= limits[k] <= high:
            field = f"{where}.{metric}" if bare else f"{where}.{metric}.{k}"
            raise UserError(f"{field}: {limits[k]:g} lies outside the metric's range [{low:g}, {high:g}]")
    if limits.get("higher_is_better", metric in HIGHER_IS_BETTER):
        if limits["warn"] < limits["fail"]:
            raise UserError(f"{where}.{metric}: warn {limits['warn']:g} is below fail {limits['fail']:g}; "
                            f"higher is better for {metric}, so warn >= fail")
    elif limits["warn"] > limits["fail"]:
        raise UserError(f"{where}.{metric}: warn {limits['warn']:g} is above fail {limits['fail']:g}; "
                        f"lower is better for {metric}, so warn <= fail")


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


# -- the dtype that judges ------------------------------------------------------------------------

#: Names ``--target-dtype`` (and the compare stage's ``target_dtype``) accept: a concrete format.
#: ``float8`` alone is refused: e4m3 and e5m2 keep 3 and 2 mantissa bits.
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
               "float8_e5m2", "float8_e5m2fnuz", "int8", "int4", "fp64", "double", "fp32", "float",
               "tf32", "fp16", "half", "bf16", "w8a8", "w8a16", "w4a16")
# fewer significant bits, lower rank: a pair is judged at the coarser of the model's and its own
_PRECISION = {"float64": 6, "float32": 5, "float16": 4, "bfloat16": 3, "float8": 2, "int8": 1, "int4": 0}


def check_dtype_name(name: Any, where: str = "--target-dtype") -> str:
    """``name`` normalised (``torch.bfloat16`` -> ``bfloat16``), or a UserError listing the names."""
    text = dtype_name(str(name).strip().lower())
    if text not in DTYPE_NAMES:
        hint = " (float8 is ambiguous: float8_e4m3fn or float8_e5m2)" if text in ("float8", "fp8") else ""
        raise UserError(f"{where}: unknown dtype {name!r}{hint}; known: {', '.join(DTYPE_NAMES)}")
    return text


def coarser(a: str | None, b: str | None) -> str | None:
    """The less precise of two floating dtype names (None when both are None)."""
    if a is None or b is None:
        return a or b
    return a if _PRECISION.get(dtype_class(a), 5) <= _PRECISION.get(dtype_class(b), 5) else b


# -- validation of the thresholds mapping, before any work ---------------------------------------

def check_thresholds(thresholds: Any, metrics: Iterable[str] | None = None,
                     where: str = "thresholds") -> None:
    """Refuse a malformed thresholds mapping, naming the metric and field (UserError).

    ``metrics``: the metric columns a compare writes (custom algorithms included); a key that is
    neither one of them nor a dtype class is refused. None: any metric name is accepted.
    """
    if thresholds is None:
        return
    if not isinstance(thresholds, dict):
        raise UserError(f"{where}: expected a mapping of metric -> limits, got {thresholds!r}")
    known = set(metrics) if metrics is not None else None

    def one(metric: str, value: Any, at: str) -> None:
        if known is not None and metric not in known:
            raise UserError(f"{at}.{metric}: not a metric of this compare (metrics: "
                            f"{', '.join(sorted(known))}; limits go under a metric, e.g. "
                            "{cosine_similarity: {warn: 0.999, fail: 0.99}})")
        _limit(metric, value, at)

    for key, value in thresholds.items():
        key = str(key)
        if key in DEFAULT_THRESHOLDS or key in _ALIASES:
            if not isinstance(value, dict):
                raise UserError(f"{where}.{key}: expected a mapping of metric -> limits, got {value!r}")
            for metric, lim in value.items():
                one(str(metric), lim, f"{where}.{key}")
        else:
            one(key, value, where)


def limited_metrics(thresholds: dict | None) -> set[str]:
    """The metrics a thresholds mapping sets limits for, globally or in a dtype's block."""
    names: set[str] = set()
    for key, value in (thresholds or {}).items():
        if (key in DEFAULT_THRESHOLDS or key in _ALIASES) and isinstance(value, dict):
            names.update(map(str, value))
        else:
            names.add(str(key))
    return names


# -- the verdict of one row -------------------------------------------------------------------------

@dataclass
class Judgement:
    """What ``judge`` concludes about one row: its code (a ``Code`` value), verdict, reason and the
    tripped metrics."""

    code: str
    verdict: str
    reason: str
    tripped: dict[str, str] = field(default_factory=dict)  # metric -> "warn" | "fail"


@lru_cache(maxsize=256)
def _limits_cached(cls: str, overrides_json: str) -> tuple[tuple[str, float, float, bool], ...]:
    """``(metric, warn, fail, higher_is_better)`` of one class: what ``judge`` loops over."""
    return tuple((m, lim["warn"], lim["fail"], lim.get("higher_is_better", m in HIGHER_IS_BETTER))
                 for m, lim in _resolve_cached(cls, overrides_json).items())


def _limits(target_dtype: Any, thresholds: dict | None) -> tuple[tuple[str, float, float, bool], ...]:
    cls = dtype_class(target_dtype)
    if not thresholds:
        return _limits_cached(cls, "{}")
    resolve_thresholds(target_dtype, thresholds)  # (validates, and is cached)
    glob = {k: v for k, v in thresholds.items() if k not in DEFAULT_THRESHOLDS and k not in _ALIASES}
    per = {k: v for k, v in thresholds.items() if k in DEFAULT_THRESHOLDS or k in _ALIASES}
    return _limits_cached(cls, json.dumps({**glob, **per}, sort_keys=False, default=str))


def _as_float(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


_EARLY = frozenset(c.value for c in (Code.LOAD_ERROR, Code.SHAPE_MISMATCH, Code.STATS_MISSING,
                                     Code.NO_FINITE, Code.EMPTY_TENSOR))
_OK, _NAN_INF, _NAN_INF_SHARED = Code.OK.value, Code.NAN_INF.value, Code.NAN_INF_SHARED.value
_FAIL, _WARN = Code.THRESHOLD_FAIL.value, Code.THRESHOLD_WARN.value


def judge(row: dict, target_dtype: Any, thresholds: dict | None = None) -> Judgement:
    """The code, verdict and reason of one compared row.

    The row's own ``code`` (set by ``compare_tensors``/``compare_stats``: a shape mismatch, no
    finite element, an empty tensor, missing statistics) decides alone where nothing could be
    measured. Otherwise the findings are: NaN/Inf the golden does not have (``nan_inf``) or
    shares (``nan_inf_shared``), integer against floating data (``dtype_mismatch``), and every
    metric beyond its limits for ``target_dtype``'s class (``threshold_fail``/``threshold_warn``,
    each named in the reason: ``cosine_similarity 0.9712 < fail 0.98 (bfloat16)``). A NaN metric
    with a limit fails, except cosine similarity, which is undefined for an all-zero side
    (relative_euclidean_distance judges that case). (Runs for every row: kept to plain strings.)
    """
    base = str(row.get("reason") or "")
    own = row.get("code") or _OK
    if own in _EARLY:
        return Judgement(own, VERDICT_OF_VALUE[own], base)
    findings = [own] if own != _OK else []
    g_bad = int(row.get("golden_nan") or 0) + int(row.get("golden_inf") or 0)
    t_bad = int(row.get("target_nan") or 0) + int(row.get("target_inf") or 0)
    if t_bad > g_bad:
        findings.append(_NAN_INF)
    elif t_bad or g_bad:
        findings.append(_NAN_INF_SHARED)
    tripped: dict[str, str] = {}
    notes: list[str] = []
    for metric, warn, fail, higher in _limits(target_dtype, thresholds):
        v = row.get(metric)
        if v is None or type(v) is bool:
            continue
        if type(v) is not float:
            v = _as_float(v)
            if v is None:
                continue
        if v != v:  # NaN
            if metric != "cosine_similarity":
                tripped[metric] = "fail"
                notes.append(f"{metric} is NaN ({dtype_class(target_dtype)})")
            continue
        if (v < fail) if higher else (v > fail):
            level, lim = "fail", fail
        elif (v < warn) if higher else (v > warn):
            level, lim = "warn", warn
        else:
            continue
        tripped[metric] = level
        cls = dtype_class(target_dtype)
        notes.append(f"{metric} {v:.6g} {'<' if higher else '>'} {level} {lim:g} ({cls})")
    if tripped:
        findings.append(_FAIL if "fail" in tripped.values() else _WARN)
    code = min(findings, key=RANK_OF_VALUE.__getitem__) if findings else _OK
    reason = "; ".join(filter(None, [base, *notes])) if notes else base
    return Judgement(code, VERDICT_OF_VALUE[code], reason, tripped)


def verdict(row: dict, target_dtype: Any, thresholds: dict | None = None) -> str:
    """``"pass"``, ``"warn"`` or ``"fail"`` for one compared row (``judge``'s verdict)."""
    return judge(row, target_dtype, thresholds).verdict
