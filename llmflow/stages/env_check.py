"""The ``env-check`` stage: diff the environments of two dumps (or of a dump and this process).

A thin adapter over ``llmflow.checks.env_diff``. ``live`` on either side captures this process's
environment with ``llmflow.dump.env.collect_env`` (the very function dumps record env.json with,
so both sides have the same fields). Writes ``env_diff.json`` and puts the counts and the
differences, numerics-relevant first, in summary.json (key ``env_diff``).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from llmflow.checks.env_diff import diff_envs, env_summary, load_env
from llmflow.results.codec import to_json
from llmflow.stages.base import Stage, StageContext


def live_env() -> dict[str, Any]:
    """This process's environment, in the env.json shape (no model: model_config stays empty)."""
    from llmflow.dump.env import collect_env

    return collect_env()


class EnvCheckStage(Stage):
    """Diff two recorded environments (dump env.json or live) and flag numerics-relevant differences."""

    type: ClassVar[str] = "env-check"
    version: ClassVar[str] = "1"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["golden", "target"],
        "properties": {
            "golden": {"type": "string", "description": "Golden dump directory, an env.json file, or "
                       "'live' (this process)."},
            "target": {"type": "string",
                       "description": "Target dump directory, an env.json file, or 'live'."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"report_file": "env_diff.json: every difference, classified"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        envs = {}
        for side in ("golden", "target"):
            value = str(ctx.params[side])
            envs[side] = live_env() if value == "live" else load_env(ctx.resolve_path(value))
        items = diff_envs(envs["golden"], envs["target"])
        summary = env_summary(items)
        path = ctx.out_dir / "env_diff.json"
        report = {**to_json(summary), "items": items, "truncated": False, "golden": ctx.params["golden"],
                  "target": ctx.params["target"]}
        path.write_text(json.dumps(ctx.redact(report), indent=1, default=str), encoding="utf-8")
        ctx.summary["env_diff"] = to_json(summary)
        ctx.log(f"{ctx.stage_id}: {summary.differences} differences, "
                f"{summary.numerics_relevant} numerics-relevant")
        for it in items[:5]:
            if it["numerics_relevant"]:
                ctx.log(f"  {it['key']}: {it['golden']!r} -> {it['target']!r} ({it['reason']})")
        return {"report_file": str(path)}
