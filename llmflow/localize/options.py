"""``BisectInputs``: what the bisect needs and the options it takes, declared once.

Each field carries its help text and, when the ``bisect`` stage takes it as a parameter as is, its
JSON-schema type: the stage's parameter schema is generated from these declarations
(``llmflow.options``). The values the stage derives itself (the token ids from the generation
files, the model specs from the dump stages, the pairs from the align stage's file) are declared
here without a schema; the stage describes the files it reads them from. This module imports
nothing heavy, so the stage's schema costs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmflow.options import REQUIRED, option
from llmflow.structure import DEFAULT_RATIO_THRESHOLD


@dataclass
class BisectInputs:
    """What the bisect needs: the two dumps, what each side generated, and how to reload each
    side's model (a dump stage's ``model_spec``: model, device, dtype, patch, base_dir); each
    field's meaning is in its declaration below."""

    golden_dump: str | Path = option(
        REQUIRED, "The golden dump directory; module mode with inputs and outputs at replay_step "
        "(tensor_part 2) so modules can be replayed.", schema={"type": "string"})
    target_dump: str | Path = option(
        REQUIRED, "The target dump directory (logits of every step; layer outputs at replay_step for "
        "the raw curve).", schema={"type": "string"})
    golden_spec: dict[str, Any] = option(
        REQUIRED, "How to load the golden model: a dump stage's model_spec (model, device, dtype, "
        "patch, base_dir).")
    target_spec: dict[str, Any] | None = option(
        None, "How to load the target model (its patch included): the model replayed module by "
        "module; None: none (isolation from the target's dump).")
    golden_ids: list[int] = option([], "The token ids the golden side generated (empty: the greedy "
                                       "tokens of the golden dump's logits).")
    target_ids: list[int] = option([], "The token ids the target side generated (empty: the greedy "
                                       "tokens of the target dump's logits).")
    prompt_ids: list[int] = option([], "The prompt's token ids (empty: no golden re-run, no cost "
                                       "estimate).")
    pairs: list[dict[str, int]] | None = option(
        None, "Golden/target step pairs from the align stage (None: equal step numbers).")
    replay_step: int | None = option(
        None, "The step to replay (0 = prefill, t > 0 a decode step, replayed with the golden KV "
        "cache); null: the first step whose logits fail, else the first differing token, else the "
        "prefill.", schema={"type": ["integer", "null"], "minimum": 0})
    ratio_threshold: float = option(
        DEFAULT_RATIO_THRESHOLD, "A module (or op) is anomalous when its own error is this many times "
        "the typical own error of its type in the other layers.",
        schema={"type": "number", "exclusiveMinimum": 1})
    thresholds: dict[str, Any] | None = option(
        None, "Compare thresholds for the logits verdict (null: the target dtype's defaults).",
        schema={"type": ["object", "null"]})
    op_level: bool = option(
        True, "Replay the chosen module op by op on both sides (loads the golden model).",
        schema={"type": "boolean"})
    estimate_cost: bool = option(
        True, "Measure what a full API-level dump of both sides would write.",
        schema={"type": "boolean"})
    isolate: str = option(
        "auto", "How a module's own error is isolated: target_model (the target model reloaded here, "
        "each module replayed on the golden inputs), target_dump (the golden module run on the inputs "
        "the target dump recorded, against the output it recorded, rank by rank for a tensor-parallel "
        "dump: no target model loaded, no op level), auto (target_dump when the target dump has more "
        "than one rank or no target model is given, else target_model).",
        schema={"type": "string", "enum": ["auto", "target_model", "target_dump"]})
    mapping: str | None = option(
        None, "The compare's op-mapping file (YAML/JSON path, or an llmflow.mappings name) for isolate: "
        "target_dump: its shards rules say how a tensor-parallel target's module outputs join (over "
        "their shapes), its name rules which golden module a target module the golden model lacks is "
        "(a port that renamed its modules); the verdict names the golden's modules; null: names and "
        "shapes only.", schema={"type": ["string", "null"]})
    top_k: int = option(15, "Candidates listed in the verdict, worst first.")
    golden_weights: str = option(
        "auto", "How the bisect holds the golden model's weights: whole (all loaded at once), streamed "
        "(each decoder layer's weights read from the golden's safetensors checkpoint while that layer "
        "runs, then dropped: the golden costs its embeddings, final norm and lm_head plus one layer; "
        "needs smollm2 or a Hugging Face directory, and no golden patch), auto (streamed where the "
        "golden can be, else whole).", schema={"type": "string", "enum": ["auto", "whole", "streamed"]})
    layers: str | None = option(
        None, "The module path of the decoder-layer list (e.g. transformer.h) when it cannot be found "
        "from the model's structure; null: found.", schema={"type": ["string", "null"]})

    overflow_scan: dict[str, Any] | None = option(
        None, "An overflow-scan of the target dump (llmflow.checks.overflow.scan's result), cited "
        "beside an overflow the replay finds and where the replay finds none.")
    compare_first_fail: dict[str, Any] | None = option(
        None, "The compare's first failing row before the texts part (``step``, ``name``): a step the "
        "bisect replays too when nothing stands out where the logits point (a fault whose error stays "
        "inside the logits thresholds shows first in the compare's rows); {}: the compare fails no "
        "row, so a module standing out only a little is rounding (conclude.below_notice); None: no "
        "compare.")
    own_error_steps: int = option(
        8, "Steps from the prefill at which the chosen module is replayed alone for its own error per "
        "step (one golden re-run through the last of them; capped at the generated tokens; 0: none).",
        schema={"type": "integer", "minimum": 0})

    def __post_init__(self) -> None:
        # an empty string means none (a workflow's empty default)
        self.layers = self.layers or None
        self.mapping = self.mapping or None
