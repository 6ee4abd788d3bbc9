"""The ``precheck`` stage: replay every op of one API dump on the CPU and judge its output.

A thin adapter over ``llmflow.checks.precheck_files.run_precheck`` (no golden needed): writes
precheck.csv/.xlsx/.json (and repro folders with ``repro: true``) and puts the status, the first
failing call and the counts in summary.json (key ``precheck``). Its outcome: fail when a call
fails, inconclusive when too few calls could be checked, pass otherwise.
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmflow.checks.precheck_options import (
    DEFAULT_FAIL_RATIO,
    DEFAULT_MIN_CHECKED,
    DEFAULT_PERTURB_RATIO,
    PrecheckOptions,
)
from llmflow.results.checks import MissingRepro, PrecheckBlock, PrecheckCall, PrecheckRepro
from llmflow.results.codec import to_json
from llmflow.stages.base import Stage, StageContext


class PrecheckStage(Stage):
    """Check every API call of a dump against a float64 CPU reference and a same-dtype benchmark."""

    type: ClassVar[str] = "precheck"
    version: ClassVar[str] = "1"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["dump"],
        "properties": {
            "dump": {"type": "string", "description": "An llmflow API dump with tensors, an msprobe L1/mix "
                                                     "tensor dump or an ATB tensor dump with its model "
                                                     "json."},
            "repro": {"type": "boolean", "default": False,
                      "description": "Write a repro folder (inputs + standalone script) per failing call."},
            "repro_calls": {"type": "array", "items": {"type": "string"}, "default": [],
                            "description": "Calls (name or record) that get a repro folder whatever their "
                                           "status; 'all': every call that replays."},
            "perturb": {"type": "boolean", "default": False,
                        "description": "Flag calls whose output moves far more than their inputs."},
            "references": {"type": "object", "additionalProperties": {"type": "string"}, "default": {},
                           "description": "API name -> file.py:func, the CPU reference of a custom op."},
            "fail_ratio": {"type": "number", "exclusiveMinimum": 1, "default": DEFAULT_FAIL_RATIO,
                           "description": "Fail a call whose error is this many times the benchmark's."},
            "perturb_ratio": {"type": "number", "exclusiveMinimum": 1, "default": DEFAULT_PERTURB_RATIO,
                              "description": "Flag a call whose output moves this many times its inputs."},
            "min_checked": {"type": "number", "minimum": 0, "maximum": 1, "default": DEFAULT_MIN_CHECKED,
                            "description": "Inconclusive below this share of calls checked."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"csv": "precheck.csv: every call, worst first",
                                         "xlsx": "precheck.xlsx", "report_file": "precheck.json"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from llmflow.checks.precheck_files import run_precheck
        from llmflow.checks.references import load_references

        p = self.params(ctx)
        options = PrecheckOptions(fail_ratio=float(p["fail_ratio"]), perturb=bool(p["perturb"]),
                                  perturb_ratio=float(p["perturb_ratio"]),
                                  min_checked=float(p["min_checked"]),
                                  references=load_references(p["references"], ctx.workflow_dir))
        result = run_precheck(ctx.resolve_path(p["dump"]), ctx.out_dir, options, repro=bool(p["repro"]),
                              repro_calls=list(p["repro_calls"]),
                              progress=lambda description, total: ctx.task(f"{ctx.stage_id}: {description}",
                                                                           total=total))
        first = result["first_fail"]
        ctx.summary["precheck"] = to_json(PrecheckBlock(
            status=result["status"], totals=result["totals"], counts=result["counts"],
            first_fail=None if first is None else PrecheckCall(**{k: first[k] for k in (
                "name", "module", "api", "step", "rank", "ratio", "reason")}),
            perturbed=result["perturbed"], repros=[PrecheckRepro(**r) for r in result["repros"]],
            repros_missing=[MissingRepro(**m) for m in result["repros_missing"]]))
        ctx.log(result["headline"])
        ctx.set_outcome(result["status"], result["headline"], result.get("next", ""))
        return {"csv": result["files"]["csv"], "xlsx": result["files"]["xlsx"],
                "report_file": result["files"]["json"]}
