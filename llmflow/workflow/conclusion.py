"""What a run concludes about the target, from the outcomes its stages set (``ctx.set_outcome``).

A stage's outcome is superseded by the outcome of any stage that (transitively) needs it: the
bisect, which reads the compare's rows, is the authority over the compare's failed rows. Of the
outcomes left, the most severe decides (fail, then inconclusive, then pass); among equals the
first stage in execution order gives the headline.

An outcome recorded by a stage reused from an earlier run whose inputs have been re-run since
(``--only`` re-ran something it needs, directly or not) and made something else is stale: it
neither counts nor supersedes. (A needed stage that ran again and made the same result, the same
content key, leaves it standing, as it leaves the stage cached: state.py ``upstream_unchanged``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmflow.stages.base import OUTCOMES
from llmflow.workflow import dag
from llmflow.workflow.state import StageState, upstream_unchanged


@dataclass
class Conclusion:
    """``status`` in OUTCOMES; ``stages``: the stages whose outcome has that status and was not
    superseded, first one's headline in ``headline``."""

    status: str
    headline: str
    stages: list[str]
    superseded: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "headline": self.headline,
            "stages": self.stages,
            "superseded": self.superseded,
        }


def outcome_record(outcome: Any) -> dict[str, str] | None:
    """A stage's ``ctx.outcome`` as stored in its state file and summary.json."""
    if outcome is None:
        return None
    record = {"status": outcome.status, "headline": outcome.headline}
    if outcome.next:
        record["next"] = outcome.next
    return record


def _valid(record: Any) -> bool:
    return isinstance(record, dict) and record.get("status") in OUTCOMES


def conclude(
    order: list[str],
    needs: dict[str, list[str]],
    outcomes: dict[str, dict[str, str]],
    states: dict[str, StageState],
) -> Conclusion | None:
    """The run's conclusion, or None when no stage set an outcome.

    ``order``: stage ids in execution order; ``needs``: the DAG; ``outcomes``: stage id ->
    ``{"status", "headline"}`` for every done or cached stage that set one; ``states``: stage id
    -> the state in use (for run ids and content keys, to tell stale outcomes)."""
    stale = _stale(order, needs, states)
    live = {sid: rec for sid, rec in outcomes.items() if _valid(rec) and sid not in stale}
    if not live:
        return None
    superseded = [
        sid for sid in order if sid in live and any(o in live for o in dag.downstream(needs, [sid]) - {sid})
    ]
    standing = [sid for sid in order if sid in live and sid not in superseded]
    worst = max(OUTCOMES.index(live[sid]["status"]) for sid in standing)
    deciding = [sid for sid in standing if OUTCOMES.index(live[sid]["status"]) == worst]
    first = deciding[0]
    headline = str(live[first].get("headline") or f"stage {first!r} concluded {OUTCOMES[worst]}")
    if len(deciding) > 1:
        headline += f" (also {OUTCOMES[worst]}: {', '.join(deciding[1:])})"
    return Conclusion(OUTCOMES[worst], headline, deciding, superseded)


def _stale(order: list[str], needs: dict[str, list[str]], states: dict[str, StageState]) -> set[str]:
    """Stages whose result was computed from inputs that are no longer the ones in use: a needed
    stage's result is not the one it read (``upstream_unchanged``), or a needed stage is stale
    itself."""
    stale: set[str] = set()
    for sid in order:
        deps = needs.get(sid, [])
        if not deps:
            continue
        if sid not in states or any(d in stale or d not in states for d in deps):
            stale.add(sid)
            continue
        runs = {d: states[d].run_id or "" for d in deps}
        contents = {d: states[d].content or "" for d in deps if states[d].content}
        if not upstream_unchanged(states[sid], runs, contents):
            stale.add(sid)
    return stale
