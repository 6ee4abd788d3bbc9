"""Rank modules by their *own* error against the typical error of the same module type.

Isolation replay (``replay.py``) gives each module's own error: the module run on the golden
inputs in the target's dtype/device, compared with the golden output. A bf16 target is never
error-free, and the noise differs by module type (an RMSNorm rounds differently from a 576x1536
matmul), so an absolute threshold cannot tell a fault from noise. What stands out is a module
whose own error is far above the *same module in the other layers*: ``mlp.down_proj`` of layer 22
against ``mlp.down_proj`` of layers 0..29. That ratio is the score.

Everything here works on plain rows (dicts) so it can be unit-tested on synthetic tables.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from statistics import median
from typing import Any

# The first all-digit dotted segment is the layer index: model.layers.7.mlp -> model.layers.7
_LAYER_RE = re.compile(r"^((?:[^./]+\.)*?\d+)(?=\.|$)")

#: A module is *anomalous* when its own error is this many times its type's typical error.
DEFAULT_RATIO_THRESHOLD = 3.0


def layer_of(name: str) -> str | None:
    """The layer a module belongs to: ``model.layers.7.mlp.down_proj`` -> ``model.layers.7``.

    The layer is the path up to the first all-digit segment; ``None`` for modules outside the
    layer stack (``model.norm``, ``lm_head``). API names (``module/api.n``) use their module part.
    """
    module = name.split("/", 1)[0]
    m = _LAYER_RE.match(module)
    return m.group(1) if m else None


def layer_index(name: str) -> int | None:
    """The integer index of ``layer_of(name)``, or None."""
    layer = layer_of(name)
    return int(layer.rsplit(".", 1)[-1]) if layer else None


def module_type(name: str) -> str:
    """The name with its layer index replaced by ``*``: the key modules are compared within.

    ``model.layers.7.mlp.down_proj`` -> ``model.layers.*.mlp.down_proj``; names outside the layer
    stack are their own type.
    """
    layer = layer_of(name)
    if layer is None:
        return name
    prefix, _, _ = layer.rpartition(".")
    return (prefix + "." if prefix else "") + "*" + name[len(layer):]


def is_descendant(name: str, ancestor: str) -> bool:
    """True when ``name`` is a strict sub-module of ``ancestor`` (dotted path prefix)."""
    return name.startswith(ancestor + ".")


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def rank_modules(rows: Iterable[dict[str, Any]], *, key: str = "rel_l2",
                 ratio_threshold: float = DEFAULT_RATIO_THRESHOLD) -> list[dict[str, Any]]:
    """Score each row (one module with its own error ``row[key]``) and sort, worst first.

    Adds to a copy of every row:
      ``module_type``, ``layer``;
      ``typical``: the median own error of the *other* modules of the same type (leave-one-out,
      so with two layers the faulty one is compared with the healthy one); for a type seen once,
      the median over all modules (the dtype's overall noise level);
      ``score``: ``error / typical`` (how many times the usual error for this kind of module);
      ``z``: robust z-score of log(error) within the type (median/MAD), None when undefined;
      ``anomalous``: ``score >= ratio_threshold``.
    Rows without a finite error (not replayable) are kept at the end with ``score`` None.
    """
    rows = [dict(r) for r in rows]
    by_type: dict[str, list[int]] = defaultdict(list)
    errors: list[float] = []
    for i, r in enumerate(rows):
        r["module_type"] = module_type(r["name"])
        r["layer"] = layer_of(r["name"])
        err = _finite(r.get(key))
        r["error"] = err
        if err is not None:
            by_type[r["module_type"]].append(i)
            errors.append(err)
    global_typical = median(errors) if errors else 0.0
    tiny = 1e-12
    for idx in by_type.values():
        errs = [rows[i]["error"] for i in idx]
        logs = [math.log(max(e, tiny)) for e in errs]
        log_med = median(logs)
        mad = median(abs(x - log_med) for x in logs) * 1.4826
        for pos, i in enumerate(idx):
            others = errs[:pos] + errs[pos + 1:]
            typical = median(others) if others else global_typical
            r = rows[i]
            r["typical"] = typical
            r["score"] = r["error"] / max(typical, tiny) if r["error"] > 0 else 0.0
            r["z"] = (logs[pos] - log_med) / mad if mad > 0 else None
            r["anomalous"] = r["score"] >= ratio_threshold
    for r in rows:
        r.setdefault("typical", None)
        r.setdefault("score", None)
        r.setdefault("z", None)
        r.setdefault("anomalous", False)
    rows.sort(key=lambda r: (r["score"] is None, -(r["score"] or 0.0), r["name"]))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
    return rows


def pick_candidate(ranked: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The module to blame: the top-ranked one, narrowed to its most specific anomalous descendant.

    A fault in ``q_proj`` also makes the ``self_attn`` container anomalous; whichever scores
    higher, the leaf is the better answer. So among the anomalous descendants of the top module
    (if any), take the best-scoring one, and repeat. Returns None for an empty ranking.
    """
    scored = [r for r in ranked if r.get("score") is not None]
    if not scored:
        return None
    best = scored[0]
    while True:
        deeper = [r for r in scored if r.get("anomalous") and is_descendant(r["name"], best["name"])]
        if not deeper:
            return best
        best = max(deeper, key=lambda r: r["score"])


def layer_curve(rows: Iterable[dict[str, Any]], *, key: str = "error") -> dict[int, float]:
    """Layer index -> the worst ``row[key]`` among that layer's modules (for the report chart)."""
    curve: dict[int, float] = {}
    for r in rows:
        idx = layer_index(r["name"])
        v = _finite(r.get(key))
        if idx is None or v is None:
            continue
        curve[idx] = max(curve.get(idx, v), v)
    return dict(sorted(curve.items()))


def first_jump(values: list[float | None], *, ratio: float = DEFAULT_RATIO_THRESHOLD,
               floor: float = 0.0) -> int | None:
    """Index of the first value that is ``ratio`` times the largest value before it (and above
    ``floor``): the point where a chain of errors (consecutive ops, layer outputs) jumps.

    The first finite value counts as a jump only when it is above ``floor * ratio``, since it has
    nothing before it to be compared with.
    """
    running: float | None = None
    for i, v in enumerate(values):
        v = _finite(v)
        if v is None:
            continue
        if running is None:
            if floor > 0 and v >= floor * ratio:
                return i
            running = v
            continue
        if v > floor and v >= ratio * max(running, floor, 1e-12):
            return i
        running = max(running, v)
    return None
