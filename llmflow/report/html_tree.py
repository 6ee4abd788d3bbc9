"""The module tree of the replayed step: the model's own hierarchy, each node with its errors.

The tree is the dump's ``topology.json`` (``{name, type, children}`` per module). Each node shows
its own error (the isolation replay's: the module run alone on the golden inputs, from the
verdict's candidates, relative to the same module in the other layers) and its raw error (the
compare rows of the replayed step: everything upstream included). The decoder layers are the
one list that repeats: it shows one collapsed row per layer, each with the worst own error inside
it (the verdict's isolated curve), so an 80-layer model is 80 rows until one is opened. The path
to the chosen module is open and the module highlighted; the ops the bisect replayed inside it
hang under it.

Colours come from ``score`` (own error / the typical own error of that module elsewhere): at the
replay's ratio threshold or above, or flagged anomalous, "fail"; from half of it, "warn"; below,
"ok". A module the replay ranked below the listed candidates is "ok" when the last listed one is;
a module that could not be replayed says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from llmflow.results.verdict import Candidate, OpRow, Verdict
from llmflow.structure import layer_of_name

MAX_NODES = 20_000  # a tree beyond this is cut (the page stays usable); the dump keeps it whole


def _number(v: float | None) -> float | None:
    """A verdict's number, None for one not measured (None or NaN); an overflow's is ``inf``."""
    return None if v is None or math.isnan(v) else v


def _level(score: float | None, anomalous: bool, threshold: float) -> str:
    if score is None:
        return "none"
    if anomalous or score >= threshold:
        return "fail"
    return "warn" if score >= threshold / 2 else "ok"


def _layer_list(node: Mapping[str, Any]) -> bool:
    """Whether ``node`` is a list of repeats: two children or more, all of one class, named by index."""
    kids = node.get("children") or []
    return (len(kids) >= 2 and len({k.get("type") for k in kids}) == 1
            and all(str(k.get("name", "")).rsplit(".", 1)[-1].isdigit() for k in kids))


def module_tree(topology: Mapping[str, Any] | None, verdict: Verdict | None,
                raw_errors: Mapping[str, float] | None = None,
                raw_verdicts: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """What the template draws, or None without a topology: ``{"nodes": [root], "step_label",
    "chosen", "n_nodes", "cut"}``; each node ``{name, label, type, own, score, level, raw,
    raw_level, note, chosen, open, kind, children, count, worst}``.

    ``raw_errors``: module name -> relative L2 error of its output at the replayed step (compare
    rows); ``raw_verdicts``: that row's verdict."""
    if not isinstance(topology, Mapping) or not topology.get("children"):
        return None
    replay = verdict.replay if verdict is not None else None
    threshold = (_number(replay.ratio_threshold) if replay else None) or 3.0
    chosen = (verdict.first_bad_module or verdict.first_bad_layer) if verdict is not None else None
    cands: dict[str, Candidate] = {c.name: c for c in verdict.candidates} if verdict is not None else {}
    scores = [s for c in cands.values() if (s := _number(c.score)) is not None]
    floor = min(scores) if scores else None  # the lowest listed: modules left out rank below it
    reasons = replay.reasons if replay else {}
    not_replayable = {m: reason for reason, names in reasons.items() for m in names}
    isolated = _isolated_curve(verdict) if verdict is not None else {}
    raw_errors, raw_verdicts = raw_errors or {}, raw_verdicts or {}
    ops = verdict.ops if verdict is not None else []
    first_bad_op = verdict.first_bad_op if verdict is not None else None
    path_open = set()
    if chosen:
        parts = str(chosen).split(".")
        path_open = {".".join(parts[:i]) for i in range(len(parts))} | {""}
    count = [0]

    def build(node: Mapping[str, Any], depth: int, in_list: bool) -> dict[str, Any]:
        count[0] += 1
        name = str(node.get("name") or "")
        c = cands.get(name)
        score = _number(c.score) if c else None
        own = _number(c.error) if c else None
        note = ""
        if c:
            level = _level(score, c.anomalous, threshold)
            if c.reason:
                note = c.reason
        elif name in not_replayable:
            level, note = "none", f"not replayed: {not_replayable[name]}"
        elif floor is not None and layer_of_name(name) is not None and name != layer_of_name(name) \
                and not node.get("children"):
            level = "ok" if floor < threshold / 2 else "none"
            note = f"ranked below the listed candidates (score ≤ {floor:.3g})"
        else:
            level = "none"
        raw = raw_errors.get(name)
        if raw is None and c:
            raw = _number(c.raw_rel_l2)
        out: dict[str, Any] = {
            "name": name, "label": name.rsplit(".", 1)[-1] if in_list or depth > 1 else name or "(model)",
            "type": str(node.get("type") or ""), "own": own, "score": score, "level": level, "raw": raw,
            "raw_level": raw_verdicts.get(name, ""), "note": note, "chosen": bool(chosen) and name == chosen,
            "kind": "module", "children": [], "count": 0, "worst": None,
        }
        kids = list(node.get("children") or [])
        if count[0] + len(kids) > MAX_NODES:
            out["note"] = (out["note"] + "; " if out["note"] else "") + f"{len(kids)} children not shown"
            kids = []
        is_list = _layer_list(node)
        if is_list:
            out["count"] = len(kids)
            out["kind"] = "list"
        out["children"] = [build(k, depth + 1, is_list) for k in kids]
        if out["chosen"]:
            out["children"] += [_op_node(o, first_bad_op, threshold) for o in ops]
        if in_list and name in isolated:  # a layer: the worst own error measured inside it
            out["worst"] = isolated[name]
        levels = [k["level"] for k in out["children"]] + [k.get("inner", "none") for k in out["children"]]
        out["inner"] = "fail" if "fail" in levels else "warn" if "warn" in levels else \
            "ok" if "ok" in levels else "none"
        out["open"] = name in path_open or out["chosen"] or (is_list and depth <= 2)
        return out

    root = build(topology, 0, False)
    return {"nodes": [root], "chosen": chosen, "n_nodes": count[0], "threshold": threshold,
            "step_label": replay.step if replay else None}


def _op_node(op: OpRow, first_bad_op: str | None, threshold: float) -> dict[str, Any]:
    """An op the bisect replayed inside the chosen module, as a leaf of the tree."""
    score = _number(op.iso_score)
    name = op.name
    return {"name": name, "label": name.rsplit("/", 1)[-1], "type": "op", "own": _number(op.iso),
            "score": score,
            "level": _level(score, False, threshold) if score is not None else
            ("fail" if name == first_bad_op else "none"),
            "raw": _number(op.raw), "raw_level": "", "note": op.status,
            "chosen": name == first_bad_op, "kind": "op", "children": [], "count": 0, "worst": None,
            "inner": "none", "open": False}


def _isolated_curve(v: Verdict) -> dict[str, float]:
    """Layer name -> the worst own error measured in it (the verdict's isolated curve, which is
    keyed by layer index), named like the first bad layer's list (``model.layers.N``)."""
    layer = v.first_bad_layer or ""
    base = layer.rsplit(".", 1)[0] if "." in layer else "model.layers"
    for series in v.curves.values():
        for label, points in series.items():
            if "isolated" in label:
                return {f"{base}.{i}": f for i, x in points.items() if (f := _number(x)) is not None}
    return {}


def walk(nodes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Every node of the tree, depth first (for tests and counts)."""
    out: list[Mapping[str, Any]] = []
    for n in nodes:
        out.append(n)
        out.extend(walk(n["children"]))
    return out
