"""The ``badcase`` stage: rank prompts by how far the target's output drifts from the golden's.

A thin adapter over ``llmflow.localize.badcase``: loads both models, scores every prompt (one at a
time, as the dump stages run it, with a progress bar), writes ``ranking.json`` and puts the top of
the ranking in summary.json (key ``badcase``). No dump is written; feed ``worst_prompt`` to a bisect workflow.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from llmflow.results.checks import BadcaseBlock, BadcaseRank
from llmflow.results.codec import to_json
from llmflow.stages.base import Stage, StageContext

_SIDE = {"model": ("string", None, "smollm2, tiny-llama[:k=v], a local HF directory or file.py:callable."),
         "device": ("string", "cpu", "cpu, cuda[:N] or npu[:N]."),
         "dtype": ("string", None, "float32, bfloat16 or float16."),
         "patch": (["string", "null"], None, "file.py:callable applied to the model (empty: none).")}


def _side_props() -> dict[str, Any]:
    props: dict[str, Any] = {}
    for side, dtype in (("golden", "float32"), ("target", "bfloat16")):
        for key, (typ, default, desc) in _SIDE.items():
            spec: dict[str, Any] = {"type": typ, "description": f"{side} side: {desc}"}
            if key == "dtype":
                spec["default"] = dtype
            elif key != "model":
                spec["default"] = default
            props[f"{side}_{key}"] = spec
    return props


class BadcaseStage(Stage):
    """Run many prompts on golden and target (no dump) and rank them by logits divergence."""

    type: ClassVar[str] = "badcase"
    version: ClassVar[str] = "3"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["golden_model", "target_model", "prompts"],
        "properties": {
            **_side_props(),
            "prompts": {"type": ["array", "string"], "items": {"type": "string"},
                        "description": "A list of prompts, or a JSONL file of {\"prompt\": ...} lines."},
            "max_new_tokens": {"type": "integer", "minimum": 1, "default": 20,
                               "description": "Tokens generated per prompt (greedy)."},
            "batch_size": {"type": "integer", "minimum": 1, "default": 8,
                           "description": "Not used: every prompt is scored alone, as the dump stages run "
                                          "it (padding and a batch change the kernels' rounding); accepted "
                                          "so recipes that set it still load."},
            "chat_template": {"type": "boolean", "default": True,
                              "description": "Wrap prompts in the tokenizer's chat template."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"ranking_file": "ranking.json: prompts ranked worst first",
                                         "worst_prompt": "the prompt with the largest logits divergence"}

    def resources(self, params: dict[str, Any]) -> set[str]:
        return {f"device:{params[k]}" for k in ("golden_device", "target_device")
                if params.get(k, "cpu") != "cpu"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from llmflow.localize.badcase import load_prompts, run_badcase  # (schema: no torch)
        from llmflow.models import load_model

        p = self.params(ctx)
        prompts = load_prompts(p["prompts"], ctx.workflow_dir)
        loaded = {side: load_model(p[f"{side}_model"], device=p[f"{side}_device"], dtype=p[f"{side}_dtype"],
                                   patch=p[f"{side}_patch"] or None, base_dir=ctx.workflow_dir)
                  for side in ("golden", "target")}
        task = ctx.task(f"{ctx.stage_id}: {len(prompts)} prompts", total=len(prompts))
        rows = run_badcase(loaded["golden"], loaded["target"], prompts, max_new_tokens=p["max_new_tokens"],
                           chat_template=p["chat_template"], advance=task.advance)
        path = ctx.out_dir / "ranking.json"
        path.write_text(json.dumps(ctx.redact(rows), indent=1), encoding="utf-8")
        keep = ("rank", "prompt", "first_mismatch_token", "max_kl", "max_kl_step")
        ctx.summary["badcase"] = to_json(BadcaseBlock(
            prompts=len(rows), worst_prompt=rows[0]["prompt"],
            ranking=[BadcaseRank(**{k: r[k] for k in keep}) for r in rows[:10]]))
        ctx.log(f"{ctx.stage_id}: worst prompt {rows[0]['prompt']!r} (max KL {rows[0]['max_kl']:.3g}, "
                f"first mismatch at token {rows[0]['first_mismatch_token']})")
        return {"ranking_file": str(path), "worst_prompt": rows[0]["prompt"]}
