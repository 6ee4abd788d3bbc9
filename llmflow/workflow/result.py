"""What ``run_workflow`` returns: the run's status and each stage's."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmflow.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INCONCLUSIVE, EXIT_PASSED, one_line
from llmflow.workflow.conclusion import Conclusion

#: run status (summary.json ``status``, ``RunResult.status``) of each conclusion
RUN_STATUS = {"pass": "passed", "inconclusive": "inconclusive", "fail": "failed"}


def now_iso() -> str:
    """Local time, ISO 8601 with the UTC offset."""
    return datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")


@dataclass
class StageResult:
    """One stage of a run. ``status``: pending, running, done, cached, failed or skipped.
    ``outcome``: what a done or cached stage concluded (``{"status", "headline"}``), or None."""

    id: str
    type: str
    status: str = "pending"
    cached: bool = False
    outputs: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, str] | None = None
    error: str | None = None
    user_error: bool = False  # the failure was a UserError (bad input): exit code 2
    traceback: str | None = None
    started: str | None = None
    finished: str | None = None
    duration_s: float | None = None
    stale: str | None = None  # why a result left out by --only is not what this run's params make

    def to_json(self) -> dict[str, Any]:
        """The stage's entry in summary.json."""
        return {
            "type": self.type,
            "status": self.status,
            "cached": self.cached,
            "started": self.started,
            "finished": self.finished,
            "duration_s": self.duration_s,
            "outputs": self.outputs,
            "outcome": self.outcome,
            "error": self.error,
            "stale": self.stale,
        }


@dataclass
class RunResult:
    """``status``: passed, failed, inconclusive, or planned (``dry_run``, then ``plan`` is set).
    ``conclusion``: what the stages' outcomes add up to (None when no stage set one)."""

    workflow: str
    run_dir: Path
    status: str
    stages: dict[str, StageResult]
    summary: dict[str, Any]
    plan: list[Any] = field(default_factory=list)
    conclusion: Conclusion | None = None

    @property
    def failed(self) -> list[StageResult]:
        return [r for r in self.stages.values() if r.status == "failed"]

    @property
    def verdict(self) -> str:
        """The last line's word as an outcome status: a failed stage is "fail" whatever the
        outcomes say; otherwise the conclusion's status, "pass" when there is none."""
        if self.failed:
            return "fail"
        return self.conclusion.status if self.conclusion else "pass"

    @property
    def exit_code(self) -> int:
        """2 a stage failed on bad input (UserError), 1 any other stage failure; otherwise from
        the conclusion: 1 fail, 3 inconclusive, 0 pass (or no outcome at all)."""
        if self.failed:
            return EXIT_BAD_INPUT if any(r.user_error for r in self.failed) else EXIT_FAILED
        return {"fail": EXIT_FAILED, "inconclusive": EXIT_INCONCLUSIVE}.get(self.verdict, EXIT_PASSED)

    @property
    def reason(self) -> str:
        """One line for the final PASSED/FAILED/INCONCLUSIVE line."""
        counts: dict[str, int] = {}
        for r in self.stages.values():
            counts[r.status] = counts.get(r.status, 0) + 1
        tally = ", ".join(f"{n} {s}" for s, n in counts.items())
        if self.failed:
            first = self.failed[0]
            return one_line(f"stage {first.id!r} failed: {first.error} ({tally})")
        stale = [r.id for r in self.stages.values() if r.stale]
        # (a result --only left out, made from other params or inputs: said first, where a long
        # headline cut short cannot lose it)
        aside = (f"stale results used (--only: run without it to redo them): {', '.join(stale)}; "
                 if stale else "")
        if self.conclusion is not None:
            return one_line(aside + self.conclusion.headline)
        return aside + tally


def run_status(stages: dict[str, StageResult], conclusion: Conclusion | None) -> str:
    """summary.json's ``status`` of a finished run."""
    if any(r.status == "failed" for r in stages.values()):
        return "failed"
    return RUN_STATUS[conclusion.status] if conclusion else "passed"
