"""The columns of a compare's tables, and its XLSX derived from the CSVs.

One CSV per level, with a fixed header (so rows can be streamed); the XLSX has a sheet per level
in which the cells that tripped are coloured, not whole rows: the metric beyond its limit (from
the row's ``tripped`` column), the shapes of a shape mismatch, the NaN/Inf counts, and the verdict.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmflow.compare.codes import Code
from llmflow.compare.metrics import COUNT_COLUMNS, METRIC_COLUMNS
from llmflow.compare.rows import ID_COLUMNS, LOGITS_COLUMNS, TAIL_COLUMNS
from llmflow.compare.statistics import SIDE_COLUMNS, STAT_COLUMNS
from llmflow.report.tables import read_csv_rows, write_xlsx

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


def cell_marks(row: dict[str, Any]) -> dict[str, str]:
    """The cells of one compare row to colour: ``{column: "fail" | "warn"}``."""
    marks: dict[str, str] = {}
    verdict = row.get("verdict")
    if verdict in ("fail", "warn"):
        marks["verdict"] = verdict
    for item in str(row.get("tripped") or "").split(","):
        metric, _, level = item.partition("=")
        if level in ("fail", "warn"):
            marks[metric] = level
    cells, level = _CODE_CELLS.get(str(row.get("code") or ""), ((), ""))
    for c in cells:
        if c.endswith(("_nan", "_inf")) and not row.get(c):
            continue  # only the counts that are not zero
        marks[c] = level
    return marks


def write_sheets(csvs: dict[str, str], columns: dict[str, list[str]], path: str | Path,
                 alg_names: Iterable[str] = ()) -> None:
    """compare.xlsx from the level CSVs (read back once, streamed)."""
    text = TEXT_COLUMNS + tuple(f"{a}_message" for a in alg_names)
    sheets = {lv: read_csv_rows(p, text, LABEL_COLUMNS) for lv, p in csvs.items()}
    write_xlsx(sheets or {"empty": []}, path, columns=columns, marks=cell_marks)
