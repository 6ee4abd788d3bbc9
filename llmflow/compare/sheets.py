"""The columns of a compare's tables, and its XLSX derived from the CSVs.

One CSV per level, with a fixed header (so rows can be streamed). The XLSX opens on a "summary"
sheet (the verdict and headline, per level the counts and the first failing row before the texts
part), then has a sheet per level in which conditional-format rules colour the cells that tripped,
not whole rows: the metric beyond its limit (from the row's ``tripped`` column), the shapes of a
shape mismatch, the NaN/Inf counts, and the verdict.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmflow.compare.codes import Code
from llmflow.compare.columns import COUNT_COLUMNS, METRIC_COLUMNS, SIDE_COLUMNS, STAT_COLUMNS
from llmflow.compare.rows import ID_COLUMNS, LOGITS_COLUMNS, TAIL_COLUMNS
from llmflow.report.tables import VERDICT_RULES, Rule, excel_text, read_csv_rows, write_xlsx
from llmflow.results.compare import CompareSummary

# columns read back as text whatever they hold; ``index`` is a label (an integer where it is one)
TEXT_COLUMNS = ("name", "target_name", "kind", "match", "module_type", "golden_dtype", "target_dtype",
                "golden_shape", "target_shape", "verdict", "code", "reason", "tripped", "golden_data_path",
                "target_data_path")
LABEL_COLUMNS = ("index",)

# the cells a problem code points at, and how they are coloured
_CODE_CELLS: dict[str, tuple[tuple[str, ...], str]] = {
    Code.SHAPE_MISMATCH.value: (("golden_shape", "target_shape"), "fail"),
    Code.DTYPE_MISMATCH.value: (("golden_dtype", "target_dtype"), "warn"),
    Code.NAN_INF.value: (("target_nan", "target_inf"), "fail"),
    Code.NAN_INF_SHARED.value: (("golden_nan", "golden_inf", "target_nan", "target_inf"), "warn"),
    Code.NO_FINITE.value: (("golden_nan", "golden_inf", "target_nan", "target_inf"), "fail"),
    Code.EMPTY_TENSOR.value: (("numel",), "warn"),
    Code.ROUTING_MISMATCH.value: (("reason",), "warn"),
    Code.LOAD_ERROR.value: (("reason",), "fail"),
    Code.STATS_MISSING.value: (("reason",), "fail"),
}


def level_columns(level: str, stats: bool, tensors: bool, alg_names: Iterable[str],
                  shards: bool = False) -> list[str]:
    """The fixed header of one level's CSV (``shards``: a tensor-parallel target's ranks joined)."""
    cols = list(ID_COLUMNS) + list(SIDE_COLUMNS)
    if tensors:
        cols += list(METRIC_COLUMNS)
    if stats:
        cols += list(STAT_COLUMNS)
    cols += list(COUNT_COLUMNS) + ["numel", "shape_mismatch", "dtype_mismatch"]
    if level == "logits":
        cols += LOGITS_COLUMNS
    for name in alg_names:
        cols += [name, f"{name}_message"]
    if shards:
        cols.append("shards")
    tail = list(TAIL_COLUMNS)
    tail.insert(tail.index("verdict") + 1, "diverged")  # true: a step after the texts part
    return cols + tail


def cell_rules(columns: Iterable[str]) -> list[Rule]:
    """The conditional formats of a level's sheet: the verdict of a fail/warn row, each metric
    that its row's ``tripped`` lists (``metric=fail,...``), and the cells a problem code points at
    (NaN/Inf counts only where not zero)."""
    rules = list(VERDICT_RULES)
    for metric in (c for c in columns if c in METRIC_COLUMNS or c in STAT_COLUMNS):
        for level in ("fail", "warn"):
            # commas on both sides: "max_relative_error" never matches inside another name
            item = excel_text(f",{metric}={level},")
            rules.append(Rule((metric,), level, f'ISNUMBER(SEARCH({item},","&{{tripped}}&","))'))
    for code, (cells, level) in _CODE_CELLS.items():
        counts = tuple(c for c in cells if c.endswith(("_nan", "_inf")))
        plain = tuple(c for c in cells if c not in counts)
        if plain:
            rules.append(Rule(plain, level, "{code}=" + excel_text(code)))
        if counts:
            rules.append(Rule(counts, level, "AND({code}=" + excel_text(code) + ",{self}<>0)"))
    return rules


SUMMARY_COLUMNS = ("level", "verdict", "rows", "pass", "warn", "fail", "unmatched", "diverged",
                   "first_fail_step", "first_fail_name", "first_fail_kind", "first_fail_index",
                   "first_fail_code", "first_fail_reason", "first_warn_step", "first_warn_name")
SUMMARY_RULES = (*VERDICT_RULES, Rule(("fail",), "fail", "{self}>0"), Rule(("warn",), "warn", "{self}>0"))


def summary_sheet(summary: CompareSummary) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
    """The summary sheet: one row per level (counts by verdict, rows after the texts part, the
    first failing and first warning row that is not among them) and the lines above it (verdict,
    headline, state, dumps, where the texts part)."""
    lines: list[tuple[str, Any]] = [
        ("verdict", summary.outcome.status), ("headline", summary.outcome.headline), ("state", summary.state),
        ("golden dump", summary.golden_dump), ("target dump", summary.target_dump),
    ]
    token = summary.divergence.first_differing_token if summary.divergence else None
    if token is not None:
        lines.append(("texts part at token", token))
        lines.append(("first failing row", "the first one before the texts part (later rows: diverged)"))
    rows = []
    for level, s in summary.levels.items():
        first, warn = s.first_fail, s.first_warn
        verdict = "fail" if s.counts.get("fail") else "warn" if s.counts.get("warn") else "pass"
        rows.append({"level": level, "verdict": verdict, "rows": s.rows,
                     **{k: s.counts.get(k, 0) for k in ("pass", "warn", "fail", "unmatched")},
                     "diverged": s.diverged,
                     **{f"first_fail_{k}": getattr(first, k) if first else None
                        for k in ("step", "name", "kind", "index", "code", "reason")},
                     "first_warn_step": warn.step if warn else None,
                     "first_warn_name": warn.name if warn else None})
    return rows, [(label, value) for label, value in lines if value is not None]


def write_sheets(csvs: dict[str, str], columns: dict[str, list[str]], path: str | Path,
                 alg_names: Iterable[str] = (), summary: CompareSummary | None = None) -> None:
    """compare.xlsx from the level CSVs (read back once, streamed), opening on the summary sheet
    when ``summary`` is given."""
    text = TEXT_COLUMNS + tuple(f"{a}_message" for a in alg_names)
    sheets: dict[str, Any] = {}
    all_columns: dict[str, list[str]] = dict(columns)
    notes: dict[str, list[tuple[str, Any]]] = {}
    if summary is not None:
        sheets["summary"], notes["summary"] = summary_sheet(summary)
        all_columns["summary"] = list(SUMMARY_COLUMNS)
    sheets.update({lv: read_csv_rows(p, text, LABEL_COLUMNS) for lv, p in csvs.items()})
    every = {c for cols in all_columns.values() for c in cols}
    rules = [*SUMMARY_RULES[2:], *cell_rules(every)] if summary is not None else cell_rules(every)
    write_xlsx(sheets or {"empty": []}, path, columns=all_columns, rules=rules, notes=notes,
               freeze_after={"summary": "level"})
