"""The ``compare`` stage: every matched tensor of two dumps, msit's columns, verdicts, CSV/XLSX.

A thin adapter over ``llmflow.compare.run.compare_dumps`` (the same call ``llmflow compare``
makes). Outputs one CSV per level, one XLSX with a sheet per level, and ``compare_summary.json``,
whose content also goes into summary.json under ``compare``. Its outcome: fail when rows fail or
too little paired, inconclusive when a dump reports problems, pass otherwise.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from llmflow.compare.levels import LEVELS
from llmflow.stages.align import DUMP_PARAMS, DUMP_REQUIRED, dump_paths
from llmflow.stages.base import Stage, StageContext

_INTS = {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}, "default": None}


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
            "levels": {"type": ["array", "null"], "items": {"type": "string", "enum": list(LEVELS)},
                       "default": None, "description": "Levels to compare, one sheet each "
                       "(logits, layer, module, api, save; null: all present)."},
            "thresholds": {"type": ["object", "null"], "default": None,
                           "description": "Verdict limits overriding the defaults: {metric: {warn, fail}} "
                           "or {dtype: {metric: {warn, fail}}}."},
            "target_dtype": {"type": ["string", "null"], "default": None,
                             "description": "The dtype whose thresholds judge float rows (null: the model "
                             "dtype the dumps record, else each tensor's own)."},
            "algorithms": {"type": "array", "items": {"type": "string"}, "default": [],
                           "description": "Custom algorithms: file.py:func or llmflow.algorithms names."},
            "mapping": {"type": ["string", "null"], "default": None,
                        "description": "Op-mapping file or llmflow.mappings name (e.g. atb-llama); "
                        "empty: by name, or a registered mapping that fits the target dump."},
            "executor": {"type": "string", "enum": ["local", "dask"], "default": "local",
                         "description": ("local: this machine (a process pool where there are many small "
                                         "pairs); dask: an existing dask cluster.")},
            "scheduler_address": {"type": ["string", "null"], "default": None,
                                  "description": "The dask scheduler (tcp://host:8786) for executor dask."},
            "workers": {"type": ["integer", "null"], "minimum": 1, "default": None,
                        "description": ("Local workers (null: one per CPU core): processes for many small "
                                        "pairs, threads in one process otherwise.")},
            "rank": {"type": ["integer", "null"], "minimum": 0, "default": None,
                     "description": "Compare only this rank (null: all)."},
            "steps": {**_INTS, "description": "Golden steps to compare (null: all)."},
            "stats_only": {"type": "boolean", "default": False,
                           "description": "Compare statistics (max, min, mean, norm) only."},
            "xlsx": {"type": "boolean", "default": True, "description": "Also write compare.xlsx."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {
        "csv": "level -> compare_<level>.csv",
        "xlsx": "compare.xlsx: a sheet per level, coloured by verdict (null when xlsx is false)",
        "summary_file": "compare_summary.json (also in summary.json under 'compare')",
    }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from llmflow.compare.run import CompareOptions, compare_dumps  # (schema: no torch)

        p = self.params(ctx)
        golden, target = dump_paths(ctx)
        pairs = None
        if p["pairs_file"]:
            pairs = json.loads(ctx.resolve_path(p["pairs_file"]).read_text(encoding="utf-8"))
        opts = CompareOptions(
            pairs=pairs, levels=p["levels"], thresholds=p["thresholds"], algorithms=list(p["algorithms"]),
            mapping=p["mapping"] or None, executor=p["executor"], scheduler_address=p["scheduler_address"],
            workers=p["workers"], rank=p["rank"], steps=p["steps"], stats_only=bool(p["stats_only"]),
            target_dtype=p["target_dtype"] or None, base_dir=str(ctx.workflow_dir), xlsx=bool(p["xlsx"]),
            final_dir=str(ctx.final_dir))  # the summary's paths name the final stage directory
        result = compare_dumps(golden, target, ctx.out_dir, opts,
                               progress=lambda desc, total: ctx.task(f"{ctx.stage_id}: {desc}", total),
                               log=lambda msg: ctx.log(f"{ctx.stage_id}: {msg}"))
        summary = result["summary"]
        ctx.summary["compare"] = summary
        ctx.set_outcome(summary["outcome"]["status"], f"compare: {summary['outcome']['headline']}")
        return {"csv": result["csv"], "xlsx": result["xlsx"], "summary_file": result["summary_file"]}
