"""The ``overflow-scan`` stage: find the first Inf/NaN (or near-max value) in one dump.

A thin adapter over ``llmflow.checks.overflow``: scans the dump in execution order per step and
rank, names the origin (the first module or API whose inputs are finite and outputs are not),
traces a NaN back to its first producer, writes ``overflow.json`` and ``overflow.csv`` and puts the
origin and counts in summary.json (key ``overflow``). Needs no golden. Its outcome: fail when any
entry holds Inf or NaN; inconclusive when none does but the dump cannot be trusted whole (a data
file cut short, a writer that never closed: what could not be read may hold one) or nothing was
scanned; pass otherwise (near-max values are named in the headline, not a fault).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from llmflow.checks.overflow import CSV_COLUMNS, DEFAULT_NEAR_MAX_FRACTION, overflow_summary, scan
from llmflow.stages.base import Stage, StageContext

_INTS = {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}, "default": None}


class OverflowScanStage(Stage):
    """Scan one dump for Inf, NaN and near-max values; name where they first appear."""

    type: ClassVar[str] = "overflow-scan"
    version: ClassVar[str] = "2"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["dump"],
        "properties": {
            "dump": {"type": "string", "description": "The dump directory (any format llmflow reads)."},
            "near_max_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                                  "default": DEFAULT_NEAR_MAX_FRACTION,
                                  "description": "Warn when max|x| reaches this fraction of the dtype's "
                                  "largest finite value (fp16 65504)."},
            "steps": {**_INTS, "description": "Steps to scan (null: all)."},
            "ranks": {**_INTS, "description": "Ranks to scan (null: all)."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"report_file": "overflow.json: origin, NaN trace, every anomaly",
                                         "csv": "overflow.csv: every flagged entry in execution order"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from llmflow.formats import open_dump  # (schema: no torch)
        from llmflow.report.tables import write_csv

        p = self.params(ctx)
        reader = open_dump(ctx.resolve_path(p["dump"]))
        task = ctx.task(f"{ctx.stage_id}: scanning", total=len(reader.entries()))
        result = scan(reader, near_max_fraction=float(p["near_max_fraction"]), steps=p["steps"],
                      ranks=p["ranks"], on_entry=task.advance)
        report = ctx.out_dir / "overflow.json"
        report.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
        csv_path = ctx.out_dir / "overflow.csv"
        write_csv(result["rows"], csv_path, columns=list(CSV_COLUMNS))
        ctx.summary["overflow"] = overflow_summary(result)
        first = result["first_origin"]
        where = (f"first {first['kind']} at {first['name']} (step {first['step']}, rank {first['rank']})"
                 if first else "no Inf, NaN or near-max value")
        if first and first.get("held_input") is not None:  # (checks/overflow.analyse_step)
            where += (f", whose input {first['held_input']} held Inf/NaN on entry: a tensor of the module's "
                      "own, such as a weight that overflowed when cast to a lower dtype")
        ctx.log(f"{ctx.stage_id}: {result['anomalies']} flagged entries; {where}")
        c = result["counts"]
        problems = reader.problems()
        if c["nan"] or c["inf"]:  # (found in what could be read: a fault, damaged dump or not)
            ctx.set_outcome("fail", f"overflow: {c['nan']} entries with NaN, {c['inf']} with Inf; {where}")
        elif problems:  # what could not be read may hold the Inf or NaN
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            ctx.set_outcome("inconclusive", f"overflow: no Inf or NaN in {c['entries_scanned']} entries, but "
                            f"the dump cannot be trusted whole: {problems[0]}{more}",
                            "dump the model again (or copy the dump whole), then scan that dump")
        elif not c["entries_scanned"]:
            ctx.set_outcome("inconclusive", "overflow: no tensor entries to scan"
                            + (" in the steps and ranks asked for" if p["steps"] or p["ranks"] else ""),
                            f"llmflow inspect {p['dump']} lists the dump's steps, ranks and levels")
        else:
            near = f"; {c['near-max']} near the dtype's largest value" if c["near-max"] else ""
            ctx.set_outcome("pass", f"overflow: no Inf or NaN in {c['entries_scanned']} entries{near}")
        return {"report_file": str(report), "csv": str(csv_path)}
