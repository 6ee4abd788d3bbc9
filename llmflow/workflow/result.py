"""What ``run_workflow`` returns: the run's status and each stage's."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def now_iso() -> str:
    """Local time, ISO 8601 with the UTC offset."""
    return datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")


@dataclass
class StageResult:
    """One stage of a run. ``status``: pending, running, done, cached, failed or skipped."""

    id: str
    type: str
    status: str = "pending"
    cached: bool = False
    outputs: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    user_error: bool = False  # the failure was a UserError (bad input): exit code 2
    traceback: str | None = None
    started: str | None = None
    finished: str | None = None
    duration_s: float | None = None

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
            "error": self.error,
        }


@dataclass
class RunResult:
    """``status``: passed, failed, or planned (``dry_run``, then ``plan`` is set)."""

    workflow: str
    run_dir: Path
    status: str
    stages: dict[str, StageResult]
    summary: dict[str, Any]
    plan: list[Any] = field(default_factory=list)

    @property
    def failed(self) -> list[StageResult]:
        return [r for r in self.stages.values() if r.status == "failed"]

    @property
    def exit_code(self) -> int:
        """0 passed, 2 a stage failed on bad input (UserError), 1 any other stage failure."""
        if not self.failed:
            return 0
        return 2 if any(r.user_error for r in self.failed) else 1

    @property
    def reason(self) -> str:
        """One line for the final PASSED/FAILED line."""
        counts: dict[str, int] = {}
        for r in self.stages.values():
            counts[r.status] = counts.get(r.status, 0) + 1
        tally = ", ".join(f"{n} {s}" for s, n in counts.items())
        if not self.failed:
            return tally
        first = self.failed[0]
        return f"stage {first.id!r} failed: {first.error} ({tally})"
