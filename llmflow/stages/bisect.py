"""The ``bisect`` stage: first bad token, layer, module and op of a target against a golden.

A thin adapter over ``llmflow.localize.bisect.run_bisect``: it reads the two dump stages'
outputs (dump dirs, generation files, model specs) and the align stage's pairs, runs the
narrowing, writes ``verdict.json`` and, when an op is named, ``first_bad_op.safetensors`` beside
it (the op's tensors on both sides, for the report's op panel), puts the headline fields in
summary.json (key ``verdict``) and sets the stage's outcome: fail (a fault named), pass, or
inconclusive.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from llmflow.atomic import atomic_write_json, atomic_write_with
from llmflow.compare.mappings import resolve_mapping
from llmflow.errors import UserError
from llmflow.localize.options import BisectInputs
from llmflow.options import from_params, required_params, stage_properties
from llmflow.results.codec import to_json
from llmflow.results.verdict import VerdictSummary
from llmflow.stages.base import Stage, StageContext

_SPEC = {"type": "object", "required": ["model"],
         "properties": {"model": {"type": "string"}, "device": {"type": "string"},
                        "dtype": {"type": "string"}, "patch": {"type": ["string", "null"]},
                        "base_dir": {"type": ["string", "null"]}}}


class BisectStage(Stage):
    """Narrow a divergence down to the first bad token, layer, module and op (isolation replay)."""

    type: ClassVar[str] = "bisect"
    version: ClassVar[str] = "7"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": [*required_params(BisectInputs), "golden_model_spec"],
        "properties": {
            **stage_properties(BisectInputs),
            # the files the stage reads the rest of BisectInputs from
            "golden_generation": {"type": ["string", "null"], "default": None,
                                  "description": "The golden dump stage's generation_file (null: the "
                                  "tokens of the golden dump's logits, no prompt: no golden re-run)."},
            "target_generation": {"type": ["string", "null"], "default": None,
                                  "description": "The target dump stage's generation_file (null: the "
                                  "tokens of the target dump's logits)."},
            "golden_model_spec": {**_SPEC, "description": "The golden dump stage's model_spec output, or "
                                  "{model: SPEC} for the golden model of dumps made elsewhere."},
            "target_model_spec": {"anyOf": [_SPEC, {"type": "null"}], "default": None,
                                  "description": "The target dump stage's model_spec output (its patch "
                                  "included): the model replayed module by module; null: none (isolate "
                                  "from the target dump)."},
            "pairs_file": {"type": ["string", "null"], "default": None,
                           "description": "The align stage's pairs_file (golden/target step pairs)."},
            "compare_summary": {"type": ["string", "null"], "default": None,
                                "description": "The compare stage's summary_file: its first failing row "
                                "before the texts part is a step replayed too when nothing stands out where "
                                "the logits point (null: no compare)."},
            "overflow_report": {"type": ["string", "null"], "default": None,
                                "description": "An overflow-scan stage's report_file on the target dump: "
                                "its origin is cited beside an overflow the replay finds, and where the "
                                "replay finds none (null: no scan)."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {
        "verdict_file": "verdict.json: the verdict and all its evidence",
        "op_tensors_file": "first_bad_op.safetensors beside it: the first bad op's golden and target tensors "
                           "(null when no op was named)"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from llmflow.localize.bisect import run_bisect  # (schema: no torch)

        p = self.params(ctx)
        gen = {side: _read_json(ctx.resolve_path(p[f"{side}_generation"]), f"{side}_generation")
               if p.get(f"{side}_generation") else {} for side in ("golden", "target")}
        pairs = None
        if p.get("pairs_file"):
            pairs = _read_json(ctx.resolve_path(p["pairs_file"]), "pairs_file")
        scan = None
        if p.get("overflow_report"):
            scan = _read_json(ctx.resolve_path(p["overflow_report"]), "overflow_report")
            if not isinstance(scan, dict) or "first_origin" not in scan:
                raise UserError(f"bisect: overflow_report: {p['overflow_report']} is not an overflow-scan "
                                "report (no first_origin)")
        first_fail = None
        if p.get("compare_summary"):
            first_fail = _first_failing_row(_read_json(ctx.resolve_path(p["compare_summary"]),
                                                       "compare_summary"))
        # a mapping file relative to the workflow, as the compare stage reads it
        mapping = str(resolve_mapping(p["mapping"], ctx.workflow_dir)) if p.get("mapping") else None
        inputs = from_params(
            BisectInputs, p, mapping=mapping,
            golden_dump=ctx.resolve_path(p["golden_dump"]), target_dump=ctx.resolve_path(p["target_dump"]),
            golden_spec=p["golden_model_spec"], target_spec=p.get("target_model_spec"),
            golden_ids=list(gen["golden"].get("output_ids") or []),
            target_ids=list(gen["target"].get("output_ids") or []),
            prompt_ids=list(gen["golden"].get("input_ids") or []), pairs=pairs, overflow_scan=scan,
            compare_first_fail=first_fail)

        def progress(description: str, total: float | None) -> Any:
            return ctx.task(f"{ctx.stage_id}: {description}", total)

        tensors: dict[str, Any] = {}
        result = run_bisect(inputs, log=ctx.log, progress=progress, op_tensors=tensors)
        op_file = None
        if result.first_bad_op_tensors is not None:
            from safetensors.torch import save_file

            kept = result.first_bad_op_tensors
            op_file = ctx.out_dir / kept.file
            metadata = {"op": kept.op, "step": str(kept.step), "golden_op": kept.golden_op or kept.op}
            atomic_write_with(op_file, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
        path = ctx.out_dir / "verdict.json"
        atomic_write_json(path, ctx.redact(to_json(result)), indent=1)
        ctx.summary["verdict"] = to_json(VerdictSummary.of(result))
        ctx.log(f"{ctx.stage_id}: {result.diagnosis}")
        ctx.set_outcome(result.status, result.headline,
                        result.inconclusive.next if result.inconclusive else "")
        return {"verdict_file": str(path), "op_tensors_file": str(op_file) if op_file else None}


def _first_failing_row(summary: Any) -> dict[str, Any] | None:
    """``{step, name}`` of the earliest failing row a compare summary holds (its levels' first
    failing rows leave out the rows after the texts part); ``{}`` where the compare passed (no
    row fails, nothing left unpaired or unread); None where it says neither (no compare summary,
    or one that is incomplete or inconclusive: its rows cover less than the dumps hold)."""
    levels = summary.get("levels") if isinstance(summary, dict) else None
    if not isinstance(levels, dict):
        return None
    rows = [s.get("first_fail") for s in levels.values() if isinstance(s, dict)]
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]
    if not rows:
        outcome = summary.get("outcome")
        return {} if isinstance(outcome, dict) and outcome.get("status") == "pass" else None
    first = min(rows, key=lambda r: (r["step"], r.get("order") or 0))
    return {"step": first["step"], "name": str(first.get("name"))}


def _read_json(path: Path, field: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"bisect: {field}: cannot read {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise UserError(f"bisect: {field}: {path} is not JSON ({exc.msg} at line {exc.lineno})") from exc
