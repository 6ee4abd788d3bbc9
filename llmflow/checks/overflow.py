"""Find where Inf/NaN first appear in one dump (no golden needed), and where a NaN came from.

Each floating-point entry gets a flag: ``nan`` (any NaN), ``inf`` (any Inf, no NaN) or
``near-max`` (finite, but ``max|x| >= near_max_fraction * finfo(dtype).max``: fp16 65504, bf16 and
fp32 3.4e38). Statistics entries are judged from their recorded stats, tensor entries from the
tensor (loaded one at a time).

The *origin* of a (rank, step) is the first call, in execution order, whose outputs are flagged
while its dumped inputs are not: the module or API that turned clean numbers into bad ones.
Because a module's outputs are recorded after those of the modules it calls, the first flagged
output is the innermost culprit, not the decoder layer around it.

A NaN is then traced back (the idea of msprobe's nan_analyze): from the first NaN-producing call,
back through the earlier flagged calls of that step (Inf or near-max values are how a NaN is
usually born: ``inf - inf``, ``0 * inf``, a softmax of an Inf) to the first producer. Across ranks
a collective (all_reduce, all_gather, ...) whose local inputs are clean but whose output is not
only received the fault: the origin is the earliest non-collective origin on any rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmflow.dtypes import torch_dtype

if TYPE_CHECKING:  # torch is imported where a tensor is read: the stage's schema must not need it
    from llmflow.formats.base import DumpReader, Entry

DEFAULT_NEAR_MAX_FRACTION = 0.5
SEVERITY = {"near-max": 1, "inf": 2, "nan": 3}
_COLLECTIVE = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "reducescatter",
               "broadcast", "all_to_all", "alltoall", "send", "recv", "isend", "irecv", "gather",
               "scatter", "hccl", "lccl", "nccl")
CSV_COLUMNS = ("step", "rank", "order", "name", "kind", "index", "level", "module_type", "dtype", "shape",
               "flag", "nan", "inf", "max_abs", "limit", "origin")


def dtype_max(dtype: str | None) -> float | None:
    """The largest finite value of a floating dtype name (``"float16"``, ``"torch.bfloat16"``)."""
    if not dtype:
        return None
    import torch

    dt = torch_dtype(dtype)
    if dt is None or not dt.is_floating_point:
        return None
    return float(torch.finfo(dt).max)


@dataclass
class Flagged:
    """One entry with its verdict (``flag`` None = clean)."""

    entry: Entry
    flag: str | None
    nan: float
    inf: float
    max_abs: float
    limit: float | None

    def row(self, origin: bool = False) -> dict[str, Any]:
        e = self.entry
        return {"step": e.step, "rank": e.rank, "order": e.order, "name": e.name, "kind": e.kind,
                "index": e.index, "level": e.level, "module_type": e.module_type, "dtype": e.dtype,
                "shape": list(e.shape) if e.shape is not None else None, "flag": self.flag,
                "nan": self.nan, "inf": self.inf, "max_abs": self.max_abs, "limit": self.limit,
                "origin": origin}


def judge(entry: Entry, reader: DumpReader, fraction: float) -> Flagged | None:
    """The flag of one entry, or None when it is not a floating-point tensor."""
    limit = dtype_max(entry.dtype)
    if limit is None:
        return None
    if entry.stats is not None and not entry.has_data:
        s = entry.stats
        nan, inf = float(s.get("nan", 0) or 0), float(s.get("inf", 0) or 0)
        finite = [abs(float(v)) for v in (s.get("max"), s.get("min")) if v is not None
                  and math.isfinite(float(v))]
        max_abs = max(finite, default=0.0)
    elif entry.has_data:
        import torch

        t = reader.load(entry)
        if t.numel() == 0:
            return Flagged(entry, None, 0.0, 0.0, 0.0, limit)
        x = t.detach().float()
        nan_mask, inf_mask = torch.isnan(x), torch.isinf(x)
        nan, inf = float(nan_mask.sum()), float(inf_mask.sum())
        fin = x.abs().masked_fill(nan_mask | inf_mask, 0)
        max_abs = float(fin.max())
    else:
        return None
    flag = ("nan" if nan else "inf" if inf else
            "near-max" if max_abs >= fraction * limit else None)
    return Flagged(entry, flag, nan, inf, max_abs, fraction * limit)


@dataclass
class Call:
    """The entries of one module/API call within a (rank, step): its inputs and outputs."""

    name: str
    inputs: list[Flagged] = field(default_factory=list)
    outputs: list[Flagged] = field(default_factory=list)

    def worst(self, items: list[Flagged]) -> str | None:
        flags = [f.flag for f in items if f.flag]
        return max(flags, key=SEVERITY.__getitem__) if flags else None

    @property
    def first_out_order(self) -> int:
        return min((f.entry.order for f in self.outputs), default=1 << 60)


def is_collective(name: str) -> bool:
    """Does this module/API name look like a cross-rank collective?"""
    api = name.rsplit("/", 1)[-1].lower()
    return any(c in api for c in _COLLECTIVE) and "/" in name


def _calls(flagged: list[Flagged]) -> list[Call]:
    """Group one (rank, step)'s entries into calls, in the order of their first output."""
    calls: dict[str, Call] = {}
    for f in flagged:
        call = calls.setdefault(f.entry.name, Call(f.entry.name))
        (call.inputs if f.entry.kind == "input" else call.outputs).append(f)
    return sorted((c for c in calls.values() if c.outputs), key=lambda c: c.first_out_order)


def _event(call: Call, step: int, rank: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    outs = [f for f in call.outputs if f.flag in kinds]
    worst = call.worst(outs)
    first = min(outs, key=lambda f: f.entry.order)
    return {"step": step, "rank": rank, "name": call.name, "kind": worst,
            "module_type": first.entry.module_type, "level": first.entry.level, "order": first.entry.order,
            "max_abs": max(f.max_abs for f in outs), "nan": sum(f.nan for f in outs),
            "inf": sum(f.inf for f in outs), "inputs_clean": call.worst(call.inputs) not in kinds,
            "collective": is_collective(call.name), "module": call.name.split("/", 1)[0]}


def analyse_step(flagged: list[Flagged], step: int, rank: int) -> dict[str, Any]:
    """Origins of one (rank, step): the first non-finite origin, the first near-max origin, and
    the trace from the first NaN back to the first producer."""
    calls = _calls(flagged)
    out: dict[str, Any] = {"step": step, "rank": rank, "nonfinite_origin": None, "near_max_origin": None,
                           "nan_trace": []}
    for kinds, key in ((("nan", "inf"), "nonfinite_origin"), (("near-max", "nan", "inf"), "near_max_origin")):
        bad = [c for c in calls if c.worst(c.outputs) in kinds]
        if not bad:
            continue
        clean_in = [c for c in bad if c.worst(c.inputs) not in kinds]
        # no call turned clean into bad: the values were bad before the first dumped call
        origin = clean_in[0] if clean_in else bad[0]
        inner = next((c for c in bad if c.name.startswith(origin.name + "/")), None)
        out[key] = _event(inner or origin, step, rank, kinds)
        if inner is not None and inner.worst(inner.inputs) in kinds:
            # the module's own inputs are clean, yet an op inside it is handed bad values no dumped
            # call made: a tensor of the module's own, a weight above all (one cast to a lower dtype)
            held = min((f for f in inner.inputs if f.flag in kinds), key=lambda f: f.entry.order)
            out[key]["note"] = (f"its input {held.entry.index} already holds {held.flag} values, which no "
                                f"dumped call made while {origin.name}'s own inputs are clean: a tensor "
                                f"of the module's own, such as a weight that overflowed when cast to "
                                f"{held.entry.dtype}")
            out[key]["held_input"] = held.entry.index
        elif not clean_in:
            out[key]["note"] = "inputs already non-finite: produced before the first dumped call"
    first_nan = next((i for i, c in enumerate(calls) if c.worst(c.outputs) == "nan"), None)
    if first_nan is not None:
        trace = [_event(calls[first_nan], step, rank, ("nan",))]
        for c in reversed(calls[:first_nan]):  # walk back through the earlier flagged calls
            kind = c.worst(c.outputs)
            if kind is None:
                continue
            trace.append(_event(c, step, rank, (kind,)))
            if c.worst(c.inputs) is None:
                break  # clean inputs: the first producer
        out["nan_trace"] = trace
    return out


def scan(reader: DumpReader, *, near_max_fraction: float = DEFAULT_NEAR_MAX_FRACTION,
         steps: Iterable[int] | None = None, ranks: Iterable[int] | None = None,
         on_entry: Callable[[], None] | None = None) -> dict[str, Any]:
    """Scan every floating entry of a dump (weights excluded) in execution order.

    Returns ``{"first_origin", "origins" (per rank and step), "nan_trace", "counts", "anomalies",
    "rows" (every flagged entry, execution order)}``.
    """
    want_steps = set(steps) if steps is not None else None
    want_ranks = set(ranks) if ranks is not None else None
    groups: dict[tuple[int, int], list[Flagged]] = defaultdict(list)
    counts = {"nan": 0, "inf": 0, "near-max": 0, "entries_scanned": 0}
    for e in reader.entries():
        if e.kind == "weight" or e.step < 0:
            continue
        if (want_steps is not None and e.step not in want_steps) or \
                (want_ranks is not None and e.rank not in want_ranks):
            continue
        f = judge(e, reader, near_max_fraction)
        if on_entry is not None:
            on_entry()
        if f is None:
            continue
        counts["entries_scanned"] += 1
        if f.flag:
            counts[f.flag] += 1
        groups[(e.step, e.rank)].append(f)
    origins = [analyse_step(groups[k], *k) for k in sorted(groups)]
    first = first_origin(origins)
    rows: list[dict[str, Any]] = []
    for (step, rank) in sorted(groups):
        for f in sorted(groups[(step, rank)], key=lambda f: f.entry.order):
            if f.flag:
                is_origin = first is not None and (step, rank, f.entry.name) == \
                    (first["step"], first["rank"], first["name"]) and f.entry.kind != "input"
                rows.append(f.row(origin=is_origin))
    trace = _across_ranks(next((o["nan_trace"] for o in origins if o["nan_trace"]), []), origins)
    counts["steps"] = sorted({s for s, _ in groups})
    counts["ranks"] = sorted({r for _, r in groups})
    return {"first_origin": first, "origins": [o for o in origins if o["nonfinite_origin"]
                                               or o["near_max_origin"]],
            "nan_trace": trace, "counts": counts, "anomalies": len(rows), "rows": rows,
            "near_max_fraction": near_max_fraction}


def _across_ranks(trace: list[dict[str, Any]], origins: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A trace that ends at a collective with clean local inputs continues on the rank that sent
    the bad values: the same step's first non-collective origin on another rank."""
    if not trace or not (trace[-1]["collective"] and trace[-1]["inputs_clean"]):
        return trace
    last = trace[-1]
    for o in origins:
        ev = o["nonfinite_origin"] or o["near_max_origin"]
        if o["step"] == last["step"] and o["rank"] != last["rank"] and ev and not ev["collective"]:
            return [*trace, {**ev, "note": f"sent to rank {last['rank']} through {last['name']}"}]
    return trace


def first_origin(origins: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The overall origin: the earliest step with a non-finite value (else with a near-max one);
    within it, a non-collective origin before a collective one (a collective only received the
    fault from another rank), then execution order, then rank."""
    for key in ("nonfinite_origin", "near_max_origin"):
        events = [o[key] for o in origins if o[key]]
        if not events:
            continue
        step = min(ev["step"] for ev in events)
        same = [ev for ev in events if ev["step"] == step]
        best = dict(min(same, key=lambda ev: (ev["collective"] and ev["inputs_clean"], ev["order"],
                                              ev["rank"])))
        if best["collective"] and best["inputs_clean"]:
            best["note"] = "a collective received the fault from another rank whose dump is not here"
        received = [ev for ev in same if ev is not best and ev["collective"] and ev["rank"] != best["rank"]]
        if received:
            best["propagated_to"] = [{"rank": ev["rank"], "name": ev["name"]} for ev in received]
        return best
    return None


def overflow_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The ``overflow`` block of summary.json."""
    first = result["first_origin"]
    return {
        "first_origin": None if first is None else {
            k: first[k] for k in ("step", "rank", "name", "kind", "max_abs", "module_type", "module")},
        "counts": result["counts"], "anomalies": result["anomalies"],
        "nan_trace": [{k: ev[k] for k in ("step", "rank", "name", "kind")} for ev in result["nan_trace"]],
    }
