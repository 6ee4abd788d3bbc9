"""The ``report`` stage: one self-contained HTML file from a verdict, compare tables and the run.

A thin adapter over ``llmflow.report.html``: reads the bisect stage's ``verdict_file``, streams
the compare stage's CSVs (``csv``: level -> path), reads each dump's ``env.json`` and
``topology.json`` (``golden_dump``, ``target_dump``) and the run's parameters
(``<run-dir>/summary.json``), and writes ``report.html``.
Every input is optional. Links to the CSV/XLSX files are relative to the stage's final directory,
so the run directory can be moved or zipped whole and the links still work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from llmflow.checks.env_diff import load_env
from llmflow.errors import UserError
from llmflow.report.html import MAX_ROWS, summarize_levels, write_report
from llmflow.report.tables import read_csv_rows
from llmflow.stages.base import Stage, StageContext

_PATH = {"type": ["string", "null"], "default": None}


class ReportStage(Stage):
    """Write a self-contained HTML report: verdict, run, texts, charts, heat map, linked tables."""

    type: ClassVar[str] = "report"
    version: ClassVar[str] = "2"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "title": {"type": "string", "default": "llmflow report", "description": "The page title."},
            "verdict_file": {**_PATH,
                             "description": "The bisect stage's verdict_file (verdict, texts, charts)."},
            "csv": {"type": ["object", "string", "null"], "default": None,
                    "description": "Compare tables: the compare stage's csv output (level -> path) "
                    "or one path."},
            "xlsx": {**_PATH, "description": "The compare stage's xlsx output, linked from the page."},
            "golden_dump": {**_PATH, "description": "The golden dump directory (or its env.json): the "
                            "prompt, model, device, dtype and versions shown for the golden side."},
            "target_dump": {**_PATH, "description": "The target dump directory (or its env.json)."},
            "max_rows": {"type": "integer", "minimum": 1, "default": MAX_ROWS,
                         "description": "Rows per table in the page (the CSV keeps them all)."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"html": "report.html, self-contained (no network)"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        p = self.params(ctx)
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
        files: list[tuple[str, str]] = []
        task = ctx.task(f"{ctx.stage_id}: tables", total=len(csvs))
        paths = {level: ctx.resolve_path(csv_path) for level, csv_path in csvs.items()}
        hrefs = {level: _href(path, ctx.final_dir) for level, path in paths.items()}
        files += [(path.name, hrefs[level]) for level, path in paths.items()]

        def rows_of(path: Path) -> Iterator[dict[str, Any]]:
            yield from _csv_rows(path, ctx.stage_id)
            task.advance()

        levels = summarize_levels({level: rows_of(path) for level, path in paths.items()}, p["max_rows"],
                                  hrefs)
        if p["xlsx"]:
            xlsx = ctx.resolve_path(p["xlsx"])
            files.append((xlsx.name, _href(xlsx, ctx.final_dir)))
        run = {"env": {side: _env(ctx, p[f"{side}_dump"]) for side in ("golden", "target")
                       if p[f"{side}_dump"]}, **_run_record(ctx.run_dir)}
        out = write_report(ctx.out_dir / "report.html", title=p["title"], verdict=verdict, compare=levels,
                           files=files, run=run, meta={"run": str(ctx.run_dir)}, max_rows=p["max_rows"],
                           topology=_topology(ctx, [p["target_dump"], p["golden_dump"]]))
        ctx.summary["report"] = {"html": str(out)}
        ctx.log(f"{ctx.stage_id}: wrote {out.name} ({out.stat().st_size / 1e3:.0f} kB)")
        return {"html": str(out)}


def _href(path: Path, page_dir: Path) -> str:
    """``path`` relative to the page's final directory, as a URL path (forward slashes)."""
    rel = os.path.relpath(path.resolve(), page_dir.resolve())
    return Path(rel).as_posix()


def _csv_rows(path: Path, stage_id: str) -> Iterator[dict[str, Any]]:
    """The CSV's rows, streamed (a 7B compare has ~100k rows a level) and read back by the one
    CSV rule, ``read_csv_rows``."""
    from llmflow.compare.sheets import LABEL_COLUMNS, TEXT_COLUMNS  # (schema: no torch)

    try:
        yield from read_csv_rows(path, TEXT_COLUMNS, LABEL_COLUMNS)
    except OSError as exc:
        raise UserError(f"{stage_id}: csv: cannot read {path}: {exc.strerror or exc}") from exc


def _env(ctx: StageContext, source: str) -> dict[str, Any] | None:
    """A dump's env.json; None (and a log line) when the dump recorded none."""
    try:
        return load_env(ctx.resolve_path(source))
    except (UserError, OSError, ValueError) as exc:
        ctx.log(f"{ctx.stage_id}: no environment shown: {exc}")
        return None


def _topology(ctx: StageContext, dumps: list[str | None]) -> dict[str, Any] | None:
    """The module tree from the first of ``dumps`` that recorded one (``topology.json`` beside
    its env.json); None when neither did (other formats)."""
    for source in dumps:
        if not source:
            continue
        path = ctx.resolve_path(source)
        path = path / "topology.json" if path.is_dir() else path.with_name("topology.json")
        try:
            tree = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            ctx.log(f"{ctx.stage_id}: no module tree shown: {path}: {exc}")
            continue
        if isinstance(tree, dict):
            return tree
    return None


def _run_record(run_dir: Path) -> dict[str, Any]:
    """The workflow's name and parameters from ``<run-dir>/summary.json`` (written by the runner
    before any stage runs); nothing when the stage runs outside a workflow."""
    try:
        head = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(head, dict):
        return {}
    return {"workflow": head.get("workflow"), "params": head.get("params") or {}}
