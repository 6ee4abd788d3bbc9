"""The ``compare`` stage: every matched tensor of two dumps, msit's columns, verdicts, CSV/XLSX.

A thin adapter over ``llmflow.compare.run.compare_dumps`` (the same call ``llmflow compare``
makes). Outputs one CSV per level, one XLSX with a sheet per level, and ``compare_summary.json``,
whose content also goes into summary.json under ``compare``. Its outcome: fail when rows fail or
too little paired, inconclusive when a dump reports problems, pass otherwise.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from llmflow.compare.options import CompareOptions, check_values
from llmflow.options import from_params, stage_properties
from llmflow.stages.align import DUMP_PARAMS, DUMP_REQUIRED, dump_paths
from llmflow.stages.base import Stage, StageContext


class CompareStage(Stage):
    """Compare two dumps tensor by tensor: msit's metrics, pass/warn/fail per row, CSV and XLSX."""

    type: ClassVar[str] = "compare"
    version: ClassVar[str] = "2"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "allOf": DUMP_REQUIRED,
        "properties": {
            **DUMP_PARAMS,
            "pairs_file": {"type": ["string", "null"], "default": None,
                           "description": "The align stage's pairs.json (null: pair equal step numbers)."},
            **stage_properties(CompareOptions),
        },
    }
    outputs: ClassVar[dict[str, str]] = {
        "csv": "level -> compare_<level>.csv",
        "xlsx": "compare.xlsx: a sheet per level, coloured by verdict (null when xlsx is false)",
        "summary_file": "compare_summary.json (also in summary.json under 'compare')",
    }

    @classmethod
    def check_values(cls, params: dict[str, Any]) -> None:
        """Thresholds, target dtype, levels, kl and jump ratio, as the compare itself checks them."""
        check_values(from_params(CompareOptions, params))

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from llmflow.compare.run import compare_dumps  # (schema: no torch)
        from llmflow.results.codec import to_json

        p = self.params(ctx)
        golden, target = dump_paths(ctx)
        pairs = None
        if p["pairs_file"]:
            pairs = json.loads(ctx.resolve_path(p["pairs_file"]).read_text(encoding="utf-8"))
        # the summary's paths name the final stage directory
        opts = from_params(CompareOptions, p, pairs=pairs, base_dir=str(ctx.workflow_dir),
                           final_dir=str(ctx.final_dir))
        result = compare_dumps(golden, target, ctx.out_dir, opts,
                               progress=lambda desc, total: ctx.task(f"{ctx.stage_id}: {desc}", total),
                               log=lambda msg: ctx.log(f"{ctx.stage_id}: {msg}"))
        summary = result["summary"]
        ctx.summary["compare"] = to_json(summary)
        ctx.set_outcome(summary.outcome.status, f"compare: {summary.outcome.headline}", summary.outcome.next)
        return {"csv": result["csv"], "xlsx": result["xlsx"], "summary_file": result["summary_file"]}
