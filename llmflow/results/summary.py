"""``<run-dir>/summary.json``: the run at a glance, as ``llmflow.workflow.summary`` writes it.

The runner's keys (workflow, params, status, outcome, stages ...) come first, then each stage's
block (``ctx.summary``) under the key the stage chose. ``RunSummary`` types the runner's keys and
the blocks of the shipped stages under fixed keys (the check stages' in ``llmflow.results.checks``);
``schemas/summary.schema.json`` is generated from it (``llmflow.results.schemas``). Blocks under
keys a stage picks (a dump stage's under its stage id: ``DumpStageBlock``, a plugin stage's under
its own key) ``read_run_summary`` returns beside the typed part, as JSON.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmflow.errors import UserError
from llmflow.results.checks import BadcaseBlock, EnvDiffBlock, PrecheckBlock, WeightCompareBlock
from llmflow.results.codec import from_json
from llmflow.results.compare import CompareSummary, OutcomeStatus, doc
from llmflow.results.verdict import VerdictSummary

RunStatus = Literal["running", "passed", "failed", "inconclusive"]
StageStatus = Literal["pending", "running", "done", "cached", "failed", "skipped"]


@dataclass
class StageOutcome:
    """What a stage concluded (``ctx.set_outcome``); kept for cached stages."""

    status: OutcomeStatus
    headline: str
    next: str | None = doc("For an inconclusive outcome: what to run to get the missing evidence.",
                           default=None)


@dataclass
class StageSummary:
    """One stage of the run: its state, timing, outputs and conclusion."""

    type: str = doc("The stage's uses: value.")
    status: StageStatus
    cached: bool = doc("True when a previous run's result was reused.")
    started: str | None = doc("ISO 8601 with UTC offset; for a cached stage, when the run that made its "
                              "result started it.")
    finished: str | None = doc("ISO 8601 with UTC offset; for a cached stage, when its result was made.")
    duration_s: float | None = doc("Seconds it ran; for a cached stage, those of the run that made its "
                                   "result.")
    outputs: dict[str, Any] = doc("The outputs other stages reference.")
    outcome: StageOutcome | None
    error: str | None = doc("Why it failed or was skipped.")
    stale: str | None = doc("Why its result, used as it was because --only left the stage out, is not "
                            "what this run's params and inputs make (null: it is, or it ran).", default=None)


@dataclass
class RunOutcome:
    """The run's conclusion from the stages' outcomes: the most severe outcome no downstream
    outcome supersedes."""

    status: OutcomeStatus
    headline: str = doc("The last line's text.")
    stages: list[str] = doc("The stages whose outcome decided (execution order).")
    superseded: list[str] = doc("Stages whose outcome a downstream stage's outcome replaced.")


@dataclass
class SeedSettings:
    """The seed stage's determinism settings (``llmflow.seeding.determinism_settings``)."""

    seed: int
    deterministic: bool
    env: dict[str, str] = doc("Environment variables set for determinism.")
    torch: dict[str, bool] = doc("torch's determinism flags.")


@dataclass
class OverflowOrigin:
    """The first tensor holding Inf, NaN or a near-max value, in execution order."""

    step: int
    rank: int
    name: str
    kind: Literal["inf", "nan", "near-max", "near_max"]
    max_abs: float | None
    module_type: str | None = None
    module: str | None = None


@dataclass
class NanTraceEvent:
    """One tensor on the way of a NaN or Inf, in execution order."""

    step: int
    rank: int
    name: str
    kind: str


@dataclass
class OverflowSummary:
    """The overflow-scan stage: where Inf/NaN first appear."""

    first_origin: OverflowOrigin | None
    counts: dict[str, Any] = doc("Entries flagged per kind (nan, inf, near-max), entries_scanned, and the "
                                 "steps and ranks scanned (lists).")
    anomalies: int = doc("Flagged entries.")
    nan_trace: list[NanTraceEvent]


@dataclass
class ReportBlock:
    """The report stage's page."""

    html: str


@dataclass
class RunSummary:
    """The run at a glance: written atomically by ``llmflow run`` whenever a stage changes."""

    workflow: str = doc("The workflow's name.")
    workflow_file: str = doc("Absolute path of the workflow file.")
    run_dir: str = doc("Absolute path of the run directory.")
    params: dict[str, Any] = doc("Resolved workflow params (defaults and --set).")
    started: str = doc("When the run started (ISO 8601).")
    status: RunStatus = doc("running while stages run; then failed (a stage failed, or the conclusion is "
                            "fail), inconclusive, or passed (the conclusion is pass, or no stage set an "
                            "outcome).")
    outcome: RunOutcome | None = doc("null while running and when no stage set an outcome.")
    updated: str = doc("When this file was written (ISO 8601).")
    stages: dict[str, StageSummary] = doc("Stage id -> its state, in execution order.")
    seed: SeedSettings | None = doc("Seed stage: the determinism settings.", default=None)
    compare: CompareSummary | None = doc("Compare stage: compare_summary.json.", default=None)
    verdict: VerdictSummary | None = doc(
        "Bisect stage: the headline fields of its verdict (verdict.json): first bad token, layer, "
        "module and op, the diagnosis, evidence, cost, overflow and op level.", default=None)
    overflow: OverflowSummary | None = doc("Overflow-scan stage: first inf/nan.", default=None)
    precheck: PrecheckBlock | None = doc(
        "Precheck stage: status, totals, counts per API, the first failing call with its module, "
        "perturbed calls and repros.", default=None)
    weight_compare: WeightCompareBlock | None = doc(
        "Weight-compare stage: counts by status and the worst tensor.", default=None)
    env_diff: EnvDiffBlock | None = doc("Env-check stage: differences between environments.", default=None)
    badcase: BadcaseBlock | None = doc(
        "Badcase stage: the number of prompts, the worst and the top of the ranking.", default=None)
    report: ReportBlock | None = doc("Report stage: the HTML report.", default=None)


RUN_SUMMARY_KEYS = tuple(f.name for f in dataclasses.fields(RunSummary))


def run_summary_from_json(data: Any, *, where: str = "summary.json") -> tuple[RunSummary, dict[str, Any]]:
    """summary.json's content read as ``RunSummary``, and the blocks of stages it does not type
    (key -> JSON). A typed part that does not fit raises RecordError naming the field."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected an object, got {type(data).__name__}")
    typed = {k: v for k, v in data.items() if k in RUN_SUMMARY_KEYS}
    others = {k: v for k, v in data.items() if k not in RUN_SUMMARY_KEYS}
    return from_json(RunSummary, typed, where=where), others


def read_run_summary(path: str | Path) -> tuple[RunSummary, dict[str, Any]]:
    """``<run-dir>/summary.json`` read back (see ``run_summary_from_json``); a file that is not
    JSON or does not fit raises a one-line UserError naming the file and the field."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{p}: cannot read it as JSON ({getattr(exc, 'strerror', None) or exc})") from None
    return run_summary_from_json(data, where=str(p))
