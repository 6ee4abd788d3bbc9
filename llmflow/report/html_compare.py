"""The compare stage's rows as the report shows them: what was compared, what was not and why.

In a bisect the golden side dumps module inputs (kept for replay) and the target only outputs, so
most rows of a module-level compare are ``unmatched golden`` by design. The page shows the rows
that WERE compared as a table and the others in one collapsed line, counted per reason and match
kind. Rows are streamed once (a 7B compare has ~100k rows a level): only the first ``max_rows`` of
each kind are kept and parsed; the rest are counted.

The ``layer`` level also yields the heat map: decoder-layer output error per (step, layer index),
which shows at a glance at which token and layer the drift starts and how it spreads.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmflow.report.html_svg import heat_map
from llmflow.structure import layer_index

# the heat map's metric: the first of these the rows hold (column, label, value -> error)
HEAT_METRICS = (("relative_euclidean_distance", "relative L2 error", lambda v: v),
                ("cosine_similarity", "1 - cosine similarity", lambda v: 1.0 - v))


def layer_number(name: Any) -> int | None:
    """``model.layers.12`` -> 12 (structure's one rule for a layer); None outside the layers."""
    return layer_index(str(name)) if name else None


def parse_cell(value: Any) -> Any:
    """A CSV string back to a number, None for empty; other values as they are."""
    if not isinstance(value, str):
        return value
    if value == "":
        return None
    try:
        num = float(value)
    except ValueError:
        return value
    return int(num) if value.strip().lstrip("-").isdigit() else num


def parse_row(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: parse_cell(v) for k, v in row.items()}


def why_not_compared(match: str, kind: str, reason: str) -> str:
    """Why a row has no metrics, in the words of someone reading the page."""
    if match == "unmatched golden":
        if kind == "input":
            return "golden inputs kept for replay (the target dumps outputs only)"
        return "only in the golden dump"
    if match == "unmatched target":
        return "only in the target dump"
    return reason or match or "not compared"


def is_compared(row: Mapping[str, Any]) -> bool:
    return row.get("verdict") != "unmatched" and not str(row.get("match") or "").startswith("unmatched")


@dataclass
class LevelRows:
    """One compare level, summarised for the page."""

    level: str
    href: str | None = None  # the level's CSV, relative to the page
    compared: list[dict[str, Any]] = field(default_factory=list)  # the first max_rows, parsed
    not_compared: list[dict[str, Any]] = field(default_factory=list)
    n_compared: int = 0
    n_not_compared: int = 0
    verdicts: Counter = field(default_factory=Counter)  # of the compared rows
    matches: Counter = field(default_factory=Counter)  # match kind of the compared rows
    reasons: Counter = field(default_factory=Counter)  # (why, match, kind) of the others
    grid: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # layer level only

    def shown_names(self) -> Counter:
        """Compared rows in the page per tensor name (what a candidate's link can show)."""
        return Counter(str(r.get("name")) for r in self.compared)

    def why_counts(self) -> list[tuple[str, int]]:
        """Rows not compared per reason, most first."""
        merged: Counter = Counter()
        for (why, _match, _kind), n in self.reasons.items():
            merged[why] += n
        return merged.most_common()

    def reason_rows(self) -> list[dict[str, Any]]:
        return [{"why": why, "match": match, "kind": kind, "rows": n}
                for (why, match, kind), n in self.reasons.most_common()]


def summarize_level(level: str, rows: Iterable[Mapping[str, Any]], *, max_rows: int,
                    href: str | None = None) -> LevelRows:
    """Stream ``rows`` (CSV dicts of strings, or parsed dicts) into a ``LevelRows``."""
    out = LevelRows(level=level, href=href)
    for row in rows:
        if is_compared(row):
            out.n_compared += 1
            out.verdicts[str(row.get("verdict") or "")] += 1
            out.matches[str(row.get("match") or "")] += 1
            if len(out.compared) < max_rows:
                out.compared.append(parse_row(row))
            if level == "layer":
                _grid_cell(out.grid, row)
        else:
            out.n_not_compared += 1
            match, kind = str(row.get("match") or ""), str(row.get("kind") or "")
            out.reasons[(why_not_compared(match, kind, str(row.get("reason") or "")), match, kind)] += 1
            if len(out.not_compared) < max_rows:
                out.not_compared.append(parse_row(row))
    return out


def _grid_cell(grid: dict[tuple[int, int], dict[str, Any]], row: Mapping[str, Any]) -> None:
    step, layer = parse_cell(row.get("step")), layer_number(row.get("name"))
    if not isinstance(step, int) or layer is None:
        return
    cell = {"verdict": row.get("verdict")}
    for col, _label, _f in HEAT_METRICS:
        v = parse_cell(row.get(col))
        cell[col] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    grid.setdefault((step, layer), cell)


def _token_label(step: int, tokens: list[Any]) -> str:
    tok = repr(str(tokens[step])) if step < len(tokens) else ""
    tok = tok if len(tok) <= 16 else tok[:14] + "…"
    return f"{step}{' prefill' if step == 0 else ''} → {tok}" if tok else f"step {step}"


def layer_heat_map(layer_rows: LevelRows | None, verdict: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The heat map's geometry when the layer rows span two steps or more; else None.

    Rows are labelled with the token the golden generated at that step; the verdict's first bad
    token and layer are marked, and the first failing cell (earliest step, then lowest layer)
    is outlined.
    """
    if layer_rows is None or len({s for s, _ in layer_rows.grid}) < 2:
        return None
    v = verdict or {}
    candidates = ((metric, {k: to_error(c[col]) for k, c in layer_rows.grid.items()
                            if c.get(col) is not None and math.isfinite(c[col])})
                  for col, metric, to_error in HEAT_METRICS)
    metric, values = next(((m, vals) for m, vals in candidates if vals), ("", {}))
    if not values:
        return None
    verdicts = {k: str(c.get("verdict") or "") for k, c in layer_rows.grid.items()}
    fails = sorted(k for k, verdict_ in verdicts.items() if verdict_ == "fail")
    tokens = ((v.get("texts") or {}).get("golden") or {}).get("tokens") or []
    bad_token, mismatch = v.get("first_bad_token"), v.get("first_mismatch_token")
    chart = heat_map(values, row_labels={s: _token_label(s, tokens) for s, _ in values}, metric=metric,
                     verdicts=verdicts, mark_row=bad_token if isinstance(bad_token, int) else None,
                     mark_col=layer_number(v.get("first_bad_layer")), first_fail=fails[0] if fails else None,
                     split_after=mismatch if isinstance(mismatch, int) else None)
    if chart is not None:
        chart["n_fail"] = len(fails)
    return chart
