"""Rank modules by their *own* error against the typical error of the same module type.

Isolation replay (``replay.py``) gives each module's own error: the module run on the golden
inputs in the target's dtype/device, compared with the golden output. A bf16 target is never
error-free, and the noise differs by module type (an RMSNorm rounds differently from a 576x1536
matmul), so an absolute threshold cannot tell a fault from noise. What stands out is a module
whose own error is far above the *same module in the other layers*: ``mlp.down_proj`` of layer 22
against ``mlp.down_proj`` of layers 0..29. That ratio is the score.

An *overflow* is another matter: a module whose replay on finite golden inputs gives Inf or NaN
where the golden output is finite (``row["nonfinite"] > 0``, see ``replay.own_error``) is wrong
whatever its peers do (a port's softmax without the max-subtraction overflows in every layer whose
scores are large enough). Such rows rank first, in execution order, with an infinite score.

Everything here works on plain rows (dicts) so it can be unit-tested on synthetic tables.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from statistics import median
from typing import Any

from llmflow.compare.thresholds import finite_or_none
from llmflow.localize.own_error import ranked_l2
from llmflow.structure import DEFAULT_RATIO_THRESHOLD, LayerStack, layer_index, layer_of, module_type

__all__ = ["DEFAULT_RATIO_THRESHOLD", "first_jump", "is_descendant", "is_overflow", "layer_curve",
           "layer_index", "layer_of", "module_type", "overflow_reason", "pick_candidate", "rank_modules",
           "set_aside"]

#: A module with no peers (a type seen once: the final norm, lm_head, the rotary embedding) is
#: compared with the median of all modules; rounding differs more between kinds of module than
#: within one (a bf16 rotary embedding sat at 1.7-3.6x the median in clean SmolLM2 runs), so it
#: must stand out this many times further.
SINGLETON_MARGIN = 3.0
#: An output of fewer elements than this (a one-value gate at a decode step) gives a relative
#: error that is one draw of the rounding, not a statistic: 3x another layer's draw is chance.
#: Such a module is anomalous only when its error is also large in itself.
SMALL_OUTPUT, SMALL_OUTPUT_MIN_ERROR = 32, 0.05
#: A module's relative error divides by its output's norm, floored so that an output of almost
#: nothing is not divided by almost nothing. An output of fewer than SMALL_OUTPUT values (a
#: one-value gate at a decode step, near 0 in some layer) is floored at the median norm of its
#: type; a larger one at this fraction of it: its outputs legitimately differ in size between
#: layers (a family without a norm before its attention projects the residual stream, which grows
#: layer by layer), and a floor at the median itself would shrink the first layers' errors and
#: make the later layers' ordinary rounding stand out.
NORM_FLOOR_FRACTION = 0.1


def is_descendant(name: str, ancestor: str) -> bool:
    """True when ``name`` is a strict sub-module of ``ancestor`` (dotted path prefix)."""
    return name.startswith(ancestor + ".")


def is_overflow(row: dict[str, Any]) -> bool:
    """Did this module's replay give Inf/NaN where the golden output is finite?"""
    return bool(row.get("nonfinite"))


def overflow_reason(row: dict[str, Any]) -> str:
    """The sentence a ranked overflow row carries in ``reason``."""
    n, total = int(row["nonfinite"]), row.get("numel")
    of = f" of {total}" if total else ""
    return (f"overflow: replayed on finite golden inputs, {n}{of} output values are Inf/NaN where the "
            "golden's are finite")


def rank_modules(rows: Iterable[dict[str, Any]], *, key: str = "rel_l2",
                 ratio_threshold: float = DEFAULT_RATIO_THRESHOLD,
                 stack: LayerStack | None = None, op_floor: float = 0.0) -> list[dict[str, Any]]:
    """Score each row (one module with its own error ``row[key]``) and sort, worst first.

    Adds to a copy of every row:
      ``module_type``, ``layer``;
      ``error``: ``row[key]``; where a row also carries ``l2`` and ``norm`` (||t - g||, ||g||), the
      error is ``l2 / max(norm, median norm of its type)`` for an output of fewer than SMALL_OUTPUT
      values, ``l2 / max(norm, NORM_FLOOR_FRACTION x that median)`` for a larger one: a module whose
      output happens to be tiny in one layer (a one-value gate at a decode step) would otherwise
      divide by almost nothing and stand out on rounding alone;
      ``typical``: the median own error of the *other* modules of the same type (leave-one-out,
      so with two layers the faulty one is compared with the healthy one); for a type seen once,
      the median over all modules (the dtype's overall noise level);
      ``peers``: how many other modules of its type there are (0: ``typical`` is all modules');
      ``score``: ``error / typical`` (how many times the usual error for this kind of module);
      ``z``: robust z-score of log(error) within the type (median/MAD), None when undefined;
      ``anomalous``: ``score >= ratio_threshold`` (times SINGLETON_MARGIN for a type seen once; for
      an output of fewer than SMALL_OUTPUT elements, also an error of SMALL_OUTPUT_MIN_ERROR),
      and an error of at least ``op_floor``: the error one correct op shows in the coarser dtype
      the two sides compute in (``dtypes.OP_ERROR_FLOOR``), since a module is at least one op.
      Where the other modules match exactly (typical 0) any error is a large ratio: an fp32
      lm_head split over two ranks, whose GEMM sums in another order, differs by 1e-8;
      ``update_score``: for a row that carries ``update`` (a decoder layer replayed whole: the norm
      of what it adds to the residual stream), ``l2 / update`` over the same of its type's other
      rows; such a row is anomalous only where this stands out as well (``_update_scores``).
    Anomalous rows rank before the others (a module's fault is not hidden behind a peerless module
    scoring higher without standing out).
    Overflow rows (``is_overflow``) come first, in the order given (execution order): ``error`` and
    ``score`` +inf, ``anomalous``, ``overflow`` True and ``reason`` saying so; ``typical`` is their
    type's median finite error. Rows without a finite error (not replayable) are kept at the end
    with ``score`` None.
    """
    rows = [dict(r) for r in rows]
    overflows = {id(r): i for i, r in enumerate(r for r in rows if is_overflow(r))}
    by_type: dict[str, list[int]] = defaultdict(list)
    errors: list[float] = []
    norms: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        r["module_type"] = module_type(r["name"], stack)
        if finite_or_none(r.get("norm")) is not None:
            norms[r["module_type"]].append(float(r["norm"]))
    median_norm = {t: median(v) for t, v in norms.items()}
    for i, r in enumerate(rows):
        r["layer"] = layer_of(r["name"], stack)
        err = finite_or_none(r.get(key))
        l2, norm = finite_or_none(ranked_l2(r)), finite_or_none(r.get("norm"))
        if err is not None and key == "rel_l2" and l2 is not None and norm is not None:
            few = (r.get("numel") or SMALL_OUTPUT) < SMALL_OUTPUT
            floor = median_norm.get(r["module_type"], 0.0) * (1.0 if few else NORM_FLOOR_FRACTION)
            err = l2 / max(norm, floor, 1e-30)
        r["error"] = err
        if err is not None:
            by_type[r["module_type"]].append(i)
            errors.append(err)
    global_typical = median(errors) if errors else 0.0
    tiny = 1e-12
    for idx in by_type.values():
        _update_scores([rows[i] for i in idx])
        errs = [rows[i]["error"] for i in idx]
        logs = [math.log(max(e, tiny)) for e in errs]
        log_med = median(logs)
        mad = median(abs(x - log_med) for x in logs) * 1.4826
        for pos, i in enumerate(idx):
            others = errs[:pos] + errs[pos + 1:]
            typical = median(others) if others else global_typical
            r = rows[i]
            r["typical"] = typical
            r["peers"] = len(others)
            r["score"] = r["error"] / max(typical, tiny) if r["error"] > 0 else 0.0
            r["z"] = (logs[pos] - log_med) / mad if mad > 0 else None
            small = (r.get("numel") or SMALL_OUTPUT) < SMALL_OUTPUT and r["error"] < SMALL_OUTPUT_MIN_ERROR
            margin = 1.0 if others else SINGLETON_MARGIN
            r["anomalous"] = not small and r["error"] >= op_floor and r["score"] >= ratio_threshold * margin
            if r.get("update_score") is not None:
                r["anomalous"] = r["anomalous"] and r["update_score"] >= ratio_threshold * margin
    for r in rows:
        if id(r) in overflows:
            peers = [rows[i]["error"] for i in by_type.get(r["module_type"], [])]
            r.update(error=math.inf, typical=median(peers) if peers else global_typical, score=math.inf,
                     z=None, anomalous=True, overflow=True, reason=overflow_reason(r))
        r.setdefault("typical", None)
        r.setdefault("score", None)
        r.setdefault("z", None)
        r.setdefault("anomalous", False)
    return _ordered(rows, lambda r: overflows.get(id(r)))


def _ordered(rows: list[dict[str, Any]], overflow_at: Callable[[dict[str, Any]], int | None],
             ) -> list[dict[str, Any]]:
    """``rows`` in the ranking's order, numbered: overflows first in execution order
    (``overflow_at``), then the anomalous rows, each group by score, worst first."""
    # (a tie, as a container and the one module inside it that does all its work: the inner first)
    rows.sort(key=lambda r: (overflow_at(r) is None, overflow_at(r) or 0, not r["anomalous"],
                             r["score"] is None, -(r["score"] or 0.0), -r["name"].count("."), r["name"]))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
    return rows


def set_aside(ranked: list[dict[str, Any]], row: dict[str, Any]) -> list[dict[str, Any]]:
    """The ranking with ``row`` (one of its rows) no longer anomalous, in the ranking's order: a
    module standing out from its peers that a later check explains (``rounding.py``)."""
    row["anomalous"] = False
    return _ordered(ranked, lambda r: r["rank"] if r.get("overflow") else None)


def _update_scores(rows: list[dict[str, Any]]) -> None:
    """Each row's ``update_score`` among rows of one type that carry ``update``.

    A decoder layer replayed whole, its error measured against its output plus its update
    (``own_error.relative_to_update``), can still stand out on rounding where it adds much to the
    stream: a clean bf16 SmolLM2's layer 28, 14x the other layers' median against its output, is
    6x against output plus update and 1.9x against its update alone. A fault in the layer moves
    every measure, so a row carrying ``update`` must also stand out against its update alone."""
    ratios = {id(r): r["l2"] / r["update"] for r in rows
              if finite_or_none(r.get("l2")) is not None and (finite_or_none(r.get("update")) or 0) > 0}
    for r in rows:
        if id(r) in ratios:
            others = [v for k, v in ratios.items() if k != id(r)]
            r["update_score"] = ratios[id(r)] / max(median(others), 1e-30) if others else None


def pick_candidate(ranked: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The module to blame: the top-ranked one, narrowed to its most specific anomalous descendant.

    A fault in ``q_proj`` also makes the ``self_attn`` container anomalous; whichever scores
    higher, the leaf is the better answer. So among the anomalous descendants of the top module
    (if any), take the best-scoring one, and repeat. Below an overflowing module only overflowing
    descendants count (the first in execution order). Returns None for an empty ranking.
    """
    scored = [r for r in ranked if r.get("score") is not None]
    if not scored:
        return None
    best = scored[0]
    while True:
        deeper = [r for r in scored if r.get("anomalous") and is_descendant(r["name"], best["name"])
                  and (is_overflow(r) or not is_overflow(best))]
        if not deeper:
            return best
        best = max(deeper, key=lambda r: r["score"])


def layer_curve(rows: Iterable[dict[str, Any]], *, key: str = "error",
                stack: LayerStack | None = None) -> dict[int, float]:
    """Layer index -> the worst ``row[key]`` among that layer's modules (for the report chart)."""
    curve: dict[int, float] = {}
    for r in rows:
        idx = layer_index(r["name"], stack)
        v = finite_or_none(r.get(key))
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
        v = finite_or_none(v)
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
