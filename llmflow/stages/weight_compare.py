"""The ``weight-compare`` stage: compare two checkpoints (or a dump's weights) tensor by tensor.

A thin adapter over ``llmflow.checks.weights``: opens both sides (a float checkpoint, a
msModelSlim-quantized one dequantized on the fly, or a dump taken with ``dump_weight``), compares
every tensor, each also against its siblings (the same role in the other layers), writes
``weights.csv`` and ``weights.xlsx`` worst first and puts the counts and the worst tensor in
summary.json (key ``weight_compare``). Missing keys, shape mismatches, unsupported and
sparse-compressed schemes are rows with a reason, never dropped. Its outcome: fail when any tensor
fails (a metric beyond its limit, far beyond its siblings, missing, mismatched, unsupported), pass
otherwise.
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmflow.results.codec import to_json
from llmflow.stages.base import Stage, StageContext
from llmflow.structure import DEFAULT_RATIO_THRESHOLD

COLUMNS = ["name", "status", "verdict", "quant_type", "scheme", "golden_dtype", "target_dtype",
           "golden_shape", "target_shape", "numel", "cosine_similarity", "relative_euclidean_distance",
           "l2_distance", "max_absolute_error", "mean_absolute_error", "max_relative_error",
           "mean_relative_error", "rmse", "kl_divergence", "scale_error", "sibling_median", "sibling_score",
           "code", "target_name", "reason"]


class WeightCompareStage(Stage):
    """Compare weights: float vs quantized checkpoint, checkpoint vs checkpoint, or dump vs checkpoint."""

    type: ClassVar[str] = "weight-compare"
    version: ClassVar[str] = "3"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["golden", "target"],
        "properties": {
            "golden": {"type": "string", "description": "Golden weights: a safetensors file, a checkpoint "
                       "directory (sharded or not), or a dump taken with dump_weight."},
            "target": {"type": "string", "description": "Target weights, the same kinds (may be quantized)."},
            "quant_config": {"type": ["string", "null"], "default": None,
                             "description": "msModelSlim quant_model_description*.json of the target "
                             "(default: found next to the target weights)."},
            "thresholds": {"type": ["object", "null"], "default": None,
                           "description": "Verdict thresholds overriding the defaults (see compare)."},
            "name_map": {"type": ["object", "null"], "additionalProperties": {"type": "string"},
                         "default": None, "description": "Target name prefix -> golden name prefix."},
            "sibling_ratio": {"type": ["number", "null"], "minimum": 0, "default": DEFAULT_RATIO_THRESHOLD,
                              "description": "A tensor whose relative distance is this many times the "
                              "median of the same role in the other layers fails (the bisect's ratio); "
                              "0 or null: each tensor judged alone."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"csv": "weights.csv: one row per tensor, worst first",
                                         "xlsx": "weights.xlsx: the same, coloured by verdict"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from llmflow.checks.weights import compare_sources, open_weights, weight_summary  # (schema: no torch)
        from llmflow.report.tables import write_csv, write_xlsx

        p = self.params(ctx)
        golden = open_weights(ctx.resolve_path(p["golden"]))
        qc = ctx.resolve_path(p["quant_config"]) if p["quant_config"] else None
        target = open_weights(ctx.resolve_path(p["target"]), quant_config=qc)
        task = ctx.task(f"{ctx.stage_id}: tensors", total=len(golden.keys()))
        rows, companions = compare_sources(golden, target, name_map=p["name_map"], thresholds=p["thresholds"],
                                           on_tensor=lambda _name: task.advance(),
                                           sibling_ratio=p["sibling_ratio"])
        columns = COLUMNS + list(dict.fromkeys(k for r in rows for k in r if k not in COLUMNS))
        csv_path, xlsx_path = ctx.out_dir / "weights.csv", ctx.out_dir / "weights.xlsx"
        write_csv(rows, csv_path, columns=columns)
        write_xlsx({"weights": [{c: r.get(c) for c in columns} for r in rows]}, xlsx_path)
        summary = weight_summary(rows, companions)
        ctx.summary["weight_compare"] = to_json(summary)
        worst = summary.worst
        ctx.log(f"{ctx.stage_id}: {summary.counts}" + (
            f"; worst {worst.name} ({worst.verdict})" if worst else ""))
        failed = [r for r in rows if r.get("verdict") == "fail"]
        if failed:
            ctx.set_outcome("fail", f"weights: {len(failed)} of {len(rows)} tensors fail; first: "
                                    f"{failed[0]['name']} ({failed[0].get('reason') or failed[0]['status']})")
        else:
            ctx.set_outcome("pass", f"weights: {len(rows)} tensors, none fails")
        return {"csv": str(csv_path), "xlsx": str(xlsx_path)}
