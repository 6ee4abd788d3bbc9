"""The ``align`` stage: pair the step (token) folders of a golden and a target dump.

A thin adapter over ``llmflow.compare.align``; writes ``pairs.json`` (a list of
``{"golden_step", "target_step"}``) for the compare and bisect stages.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from llmflow.errors import UserError
from llmflow.stages.base import Stage, StageContext

_PATH = {"type": "string", "minLength": 1}


def dump_paths(ctx: StageContext) -> tuple[str, str]:
    """The golden and target dump paths of a stage taking ``golden_dump``/``golden`` and
    ``target_dump``/``target`` (resolved against the workflow directory)."""
    p = ctx.params
    golden, target = p.get("golden_dump") or p.get("golden"), p.get("target_dump") or p.get("target")
    if not golden or not target:
        raise UserError(f"{ctx.stage_id}: needs golden_dump and target_dump")
    return str(ctx.resolve_path(golden)), str(ctx.resolve_path(target))


DUMP_PARAMS: dict[str, Any] = {
    "golden_dump": {**_PATH, "description": "The golden dump (any format llmflow reads)."},
    "target_dump": {**_PATH, "description": "The target dump."},
    "golden": {**_PATH, "description": "Alias of golden_dump."},
    "target": {**_PATH, "description": "Alias of target_dump."},
}
DUMP_REQUIRED: list[dict[str, Any]] = [
    {"anyOf": [{"required": ["golden_dump"]}, {"required": ["golden"]}]},
    {"anyOf": [{"required": ["target_dump"]}, {"required": ["target"]}]},
]


class AlignStage(Stage):
    """Pair the step folders of two dumps (same index, or ATB's prefill offset); list missing steps."""

    type: ClassVar[str] = "align"
    version: ClassVar[str] = "1"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "allOf": DUMP_REQUIRED,
        "properties": {
            **DUMP_PARAMS,
            "prefill_offset": {"type": "integer", "minimum": 0, "default": 0,
                               "description": "Target folders that hold the prefill AND the first "
                               "decode step (ATB: 1): golden n <-> target max(n - offset, 0)."},
            "warmup": {"type": "integer", "minimum": 0, "default": 0,
                       "description": "Warm-up steps at the start of the target dump (its first step "
                                      "folders, or the msprobe step numbers before the prompt's), skipped."},
            "steps": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0},
                      "default": None, "description": "Golden steps to pair (null: all)."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {
        "pairs_file": "pairs.json: [{golden_step, target_step}]",
        "pairs": "the same list",
        "missing": "steps without a partner: [{side, golden_step?, target_step}]",
        "golden_dump": "the golden dump path",
        "target_dump": "the target dump path",
    }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from llmflow.compare.align import align_dumps  # (schema: no torch)
        from llmflow.formats import open_dump

        p = self.params(ctx)
        golden_path, target_path = dump_paths(ctx)
        result = align_dumps(open_dump(golden_path), open_dump(target_path),
                             prefill_offset=int(p["prefill_offset"]), warmup=int(p["warmup"]),
                             steps=p["steps"])
        pairs_file = ctx.out_dir / "pairs.json"
        pairs_file.write_text(json.dumps(result["pairs"], indent=1), encoding="utf-8")
        ctx.log(f"{ctx.stage_id}: {len(result['pairs'])} step pairs"
                + (f", {len(result['missing'])} steps without a partner" if result["missing"] else ""))
        if not result["pairs"]:
            raise UserError(f"{ctx.stage_id}: no step of {golden_path} pairs with a step of {target_path} "
                            f"(prefill_offset={p['prefill_offset']}, warmup={p['warmup']})")
        return {"pairs_file": str(pairs_file), "pairs": result["pairs"], "missing": result["missing"],
                "golden_dump": golden_path, "target_dump": target_path}
