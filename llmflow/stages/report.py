"""The ``report`` stage: one self-contained HTML file from a verdict and compare tables.

A thin adapter over ``llmflow.report.html``: reads the bisect stage's ``verdict_file`` (optional)
and the compare stage's CSVs (``csv``: level -> path, optional) and writes ``report.html``.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path
from typing import Any, ClassVar

from llmflow.compare.sheets import LABEL_COLUMNS, TEXT_COLUMNS
from llmflow.errors import UserError
from llmflow.report.html import MAX_ROWS, write_report
from llmflow.report.tables import read_csv_rows
from llmflow.stages.base import Stage, StageContext


class ReportStage(Stage):
    """Write a self-contained HTML report: verdict, texts, per-layer charts, sortable tables."""

    type: ClassVar[str] = "report"
    version: ClassVar[str] = "1"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "title": {"type": "string", "default": "llmflow report", "description": "The page title."},
            "verdict_file": {"type": ["string", "null"], "default": None,
                             "description": "The bisect stage's verdict_file (verdict, texts, charts)."},
            "csv": {"type": ["object", "string", "null"], "default": None,
                    "description": "Compare tables: the compare stage's csv output (level -> path) "
                    "or one path."},
            "max_rows": {"type": "integer", "minimum": 1, "default": MAX_ROWS,
                         "description": "Rows per table in the page (the CSV keeps them all)."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"html": "report.html, self-contained (no network)"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        p = {name: spec.get("default") for name, spec in self.params_schema["properties"].items()}
        p.update(ctx.params)
        verdict = None
        if p["verdict_file"]:
            path = ctx.resolve_path(p["verdict_file"])
            try:
                verdict = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise UserError(f"{ctx.stage_id}: verdict_file: cannot read {path}: {exc}") from exc
        csvs = p["csv"] or {}
        if isinstance(csvs, str):
            csvs = {Path(csvs).stem: csvs}
        tables: dict[str, list[dict[str, Any]]] = {}
        task = ctx.task(f"{ctx.stage_id}: tables", total=len(csvs))
        for level, csv_path in csvs.items():
            tables[f"compare: {level}"] = _read_csv(ctx.resolve_path(csv_path), p["max_rows"], ctx.stage_id)
            task.advance()
        meta = {"run": str(ctx.run_dir)}
        out = write_report(ctx.out_dir / "report.html", title=p["title"], verdict=verdict, tables=tables,
                           meta=meta, max_rows=p["max_rows"])
        ctx.summary["report"] = {"html": str(out)}
        ctx.log(f"{ctx.stage_id}: wrote {out.name} ({out.stat().st_size / 1e3:.0f} kB)")
        return {"html": str(out)}


def _read_csv(path: Path, max_rows: int, stage_id: str) -> list[dict[str, Any]]:
    """The first ``max_rows`` rows of a CSV (read back by the one CSV rule, ``read_csv_rows``),
    plus a truncation marker row."""
    try:
        it = read_csv_rows(path, TEXT_COLUMNS, LABEL_COLUMNS)
        rows = list(islice(it, max_rows))
        if next(it, None) is not None:
            first = next(iter(rows[0])) if rows else "note"
            rows.append({first: f"... more rows in {path.name}"})
    except OSError as exc:
        raise UserError(f"{stage_id}: csv: cannot read {path}: {exc.strerror or exc}") from exc
    return rows
