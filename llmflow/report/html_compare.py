"""The compare stage's rows as the report shows them: what was compared, what was not and why.

In a bisect the golden side dumps module inputs (kept for replay) and the target only outputs, so
most rows of a module-level compare are ``unmatched golden`` by design. The page shows the rows
that WERE compared as a table, most severe first (fail, warn, pass; lowest cosine first; rows
after the texts part, ``diverged``, last), and the others in one line counted per reason, never
listed row by row. A decoder layer's output is a row of both the layer and the module level: the
module table leaves out the names the layer table shows. Rows are streamed once (a 7B compare has
~100k rows a level): only the ``max_rows`` most severe are kept and parsed; the rest are counted.

The ``layer`` level also yields the heat map: decoder-layer output error per (step, layer index),
which shows at a glance at which token and layer the drift starts and how it spreads.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmflow.report.html_svg import heat_map
from llmflow.report.tables import parse_cell
from llmflow.results.verdict import Verdict
from llmflow.structure import layer_index

# the heat map's metric: the first of these the rows hold (column, label, value -> error)
HEAT_METRICS = (("relative_euclidean_distance", "relative L2 error", lambda v: v),
                ("cosine_similarity", "1 - cosine similarity", lambda v: 1.0 - v))


def layer_number(name: Any) -> int | None:
    """``model.layers.12`` -> 12 (structure's one rule for a layer); None outside the layers."""
    return layer_index(str(name)) if name else None


# the columns that name a tensor: text whatever they hold (the rows' anchors are these names)
NAME_COLUMNS = ("name", "target_name")


def parse_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row's cells through ``parse_cell``; a name stays the text it is (a module named ``+1`` or
    ``7`` is not a number)."""
    return {k: parse_cell(v, "text" if k in NAME_COLUMNS else "auto") for k, v in row.items()}


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


def is_diverged(row: Mapping[str, Any]) -> bool:
    """Whether the compare marked the row diverged (a bool, or the CSV's text of one)."""
    return str(row.get("diverged")).lower() in ("true", "1")


_VERDICT_RANK = {"fail": 0, "warn": 1}


def severity(row: Mapping[str, Any]) -> tuple[int, int, float]:
    """Sort key, most severe first: rows before the texts part, then fail, warn, pass, then the
    lowest cosine similarity (a row without one after those with one)."""
    cos = parse_cell(row.get("cosine_similarity"))
    cos = float(cos) if isinstance(cos, (int, float)) and math.isfinite(cos) else 2.0
    return (int(is_diverged(row)), _VERDICT_RANK.get(str(row.get("verdict") or ""), 2), cos)


@dataclass
class LevelRows:
    """One compare level, summarised for the page."""

    level: str
    href: str | None = None  # the level's CSV, relative to the page
    compared: list[dict[str, Any]] = field(default_factory=list)  # the max_rows most severe, parsed, in order
    n_compared: int = 0  # every compared row of the level, those another level's table shows too
    n_not_compared: int = 0
    n_diverged: int = 0  # compared rows of steps after the texts part, in this level's table
    first_diverged_step: int | None = None
    names: set[str] = field(default_factory=set)  # the name of every compared row in this level's table
    elsewhere: int = 0  # compared rows left out of the table because another level's table shows them
    verdicts: Counter = field(default_factory=Counter)  # of every compared row
    matches: Counter = field(default_factory=Counter)  # match kind of every compared row
    reasons: Counter = field(default_factory=Counter)  # (why, match, kind) of the others
    grid: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # layer level only
    # (name, step) -> (relative L2 error, verdict) of each compared module output: the module
    # tree's raw errors and a module's error per step
    outputs: dict[tuple[str, int], tuple[float, str]] = field(default_factory=dict)

    @property
    def n_rows(self) -> int:
        """Every row of the level, compared or not (the compare summary's ``rows``)."""
        return self.n_compared + self.n_not_compared

    @property
    def n_in_table(self) -> int:
        """The compared rows this level's own table holds (the others are another level's)."""
        return self.n_compared - self.elsewhere

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
                    href: str | None = None, shown_elsewhere: Collection[str] = ()) -> LevelRows:
    """Stream ``rows`` (CSV dicts of strings, or parsed dicts) into a ``LevelRows``. Compared rows
    whose name is in ``shown_elsewhere`` (the layer table's names, for the module level) are
    counted with their verdicts but not kept for this level's table."""
    out = LevelRows(level=level, href=href)
    kept: list[tuple[tuple[float, ...], dict[str, Any]]] = []  # a max-heap by severity (negated keys)
    for seq, row in enumerate(rows):
        if not is_compared(row):
            out.n_not_compared += 1
            match, kind = str(row.get("match") or ""), str(row.get("kind") or "")
            out.reasons[(why_not_compared(match, kind, str(row.get("reason") or "")), match, kind)] += 1
            continue
        name = str(row.get("name"))
        _output_error(out.outputs, name, row)
        # counted whichever table shows it, so the level's counts are the compare summary's
        out.n_compared += 1
        out.verdicts[str(row.get("verdict") or "")] += 1
        out.matches[str(row.get("match") or "")] += 1
        if name in shown_elsewhere:
            out.elsewhere += 1
            continue
        out.names.add(name)
        if is_diverged(row):
            out.n_diverged += 1
            step = parse_cell(row.get("step"))
            if isinstance(step, int) and (out.first_diverged_step is None or step < out.first_diverged_step):
                out.first_diverged_step = step
        key = tuple(-x for x in (*severity(row), seq))
        if len(kept) < max_rows:
            heapq.heappush(kept, (key, row))
        elif key > kept[0][0]:
            heapq.heapreplace(kept, (key, row))
        if level == "layer":
            _grid_cell(out.grid, row)
    out.compared = [parse_row(r) for _, r in sorted(kept, key=lambda kr: kr[0], reverse=True)]
    return out


def _output_error(outputs: dict[tuple[str, int], tuple[float, str]], name: str,
                  row: Mapping[str, Any]) -> None:
    if str(row.get("kind") or "output") != "output" or str(row.get("index") or "0") != "0":
        return
    step, err = parse_cell(row.get("step")), parse_cell(row.get("relative_euclidean_distance"))
    if isinstance(step, int) and isinstance(err, (int, float)) and not isinstance(err, bool):
        outputs.setdefault((name, step), (float(err), str(row.get("verdict") or "")))


def _grid_cell(grid: dict[tuple[int, int], dict[str, Any]], row: Mapping[str, Any]) -> None:
    step, layer = parse_cell(row.get("step")), layer_number(row.get("name"))
    if not isinstance(step, int) or layer is None:
        return
    cell = {"verdict": row.get("verdict"), "diverged": is_diverged(row)}
    for col, _label, _f in HEAT_METRICS:
        v = parse_cell(row.get(col))
        cell[col] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    grid.setdefault((step, layer), cell)


def _token_label(step: int, tokens: list[Any]) -> str:
    tok = repr(str(tokens[step])) if step < len(tokens) else ""
    tok = tok if len(tok) <= 16 else tok[:14] + "…"
    return f"{step}{' prefill' if step == 0 else ''} → {tok}" if tok else f"step {step}"


def layer_heat_map(layer_rows: LevelRows | None, verdict: Verdict | None) -> dict[str, Any] | None:
    """The heat map's geometry when the layer rows span two steps or more; else None.

    Rows are labelled with the token the golden generated at that step; the verdict's first bad
    token and layer are marked, and the first failing cell (earliest step, then lowest layer)
    is outlined.
    """
    if layer_rows is None or len({s for s, _ in layer_rows.grid}) < 2:
        return None
    candidates = ((metric, {k: to_error(c[col]) for k, c in layer_rows.grid.items()
                            if c.get(col) is not None and math.isfinite(c[col])})
                  for col, metric, to_error in HEAT_METRICS)
    metric, values = next(((m, vals) for m, vals in candidates if vals), ("", {}))
    if not values:
        return None
    verdicts = {k: str(c.get("verdict") or "") for k, c in layer_rows.grid.items()}
    tokens = verdict.texts.golden.tokens if verdict is not None and verdict.texts is not None else []
    bad_token = verdict.first_bad_token if verdict is not None else None
    mismatch = verdict.first_mismatch_token if verdict is not None else None
    bad_layer = verdict.first_bad_layer if verdict is not None else None
    if not isinstance(mismatch, int) and layer_rows.first_diverged_step is not None:
        mismatch = layer_rows.first_diverged_step - 1  # the compare's own record of the texts part
    # cells after the texts part ran on different inputs: never the first failing cell
    fails = sorted(k for k, verdict_ in verdicts.items() if verdict_ == "fail"
                   and not (isinstance(mismatch, int) and k[0] > mismatch)
                   and not layer_rows.grid[k].get("diverged"))
    chart = heat_map(values, row_labels={s: _token_label(s, tokens) for s, _ in values}, metric=metric,
                     verdicts=verdicts, mark_row=bad_token if isinstance(bad_token, int) else None,
                     mark_col=layer_number(bad_layer), first_fail=fails[0] if fails else None,
                     split_after=mismatch if isinstance(mismatch, int) else None)
    if chart is not None:
        chart["n_fail"] = len(fails)
    return chart
