"""The ``seed`` stage: one place that fixes the seed and determinism switches for a workflow."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from llmflow.seeding import MAX_SEED, determinism_settings
from llmflow.stages.base import Stage, StageContext


class SeedStage(Stage):
    """Fix the random seed and determinism switches that later stages (dump) apply.

    It computes the settings and records them; it does not change the runner's own process, so
    stages running concurrently are unaffected. Stages apply ``settings`` in their own process
    with ``llmflow.seeding.apply_settings``.
    """

    type: ClassVar[str] = "seed"
    version: ClassVar[str] = "1"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "seed": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_SEED,
                "default": 1234,
                "description": "Seed for random, numpy and torch (CPU, CUDA, NPU).",
            },
            "deterministic": {
                "type": "boolean",
                "default": True,
                "description": "Deterministic algorithms and the CUBLAS/HCCL/LCCL/ATB switches.",
            },
        },
    }
    outputs: ClassVar[dict[str, str]] = {
        "settings": "dict: seed, deterministic, env (variables to set), torch (flags)",
        "settings_file": "the same dict as a JSON file",
    }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        p = self.params(ctx)
        settings = determinism_settings(p["seed"], p["deterministic"])
        path = ctx.out_dir / "seed_settings.json"
        path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        ctx.summary["seed"] = settings
        ctx.log(f"seed {settings['seed']}, deterministic={settings['deterministic']}")
        return {"settings": settings, "settings_file": str(path)}
