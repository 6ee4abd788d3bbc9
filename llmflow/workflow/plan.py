"""Which stages a run executes, and why: ``plan_stage`` is the one decision, made by the runner
as each stage's inputs are ready and by ``llmflow plan`` for all of them ahead of a run.

A stage is cached when its directory holds a state file whose fingerprint (stage type + version,
resolved parameters, the content of code files they name, the files' sizes and times of the
inputs outside the run dir they name (dumps, checkpoints), the content keys of the needed stages'
results) matches, whose needed stages' results are the ones it read and whose files are still as
it left them (sizes and mtimes). A needed stage's result is the one it read when its content key
(a hash of its outputs, of every byte of the files in its folder and of the content keys of the
results it read: state.py ``content_key``) is the recorded one: a needed stage that ran again
(``--force``, a parameter that changes nothing it writes) and made the very same result leaves
the stages reading it cached. A state written before content keys were recorded compares run ids
instead: any rerun of a needed stage re-runs it.
Otherwise it runs, for the first reason that applies: forced, new, previous run failed, upstream
changed, stage type or version changed, code changed (the content of a file it names), input
changed, parameters changed (naming them; a ``file.py:name`` naming another function of the same
file is one), outputs changed on disk. ``llmflow plan`` cannot know what a needed stage that runs
first will make: it says "upstream changed", and the run may then find the stage cached.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmflow.errors import UserError
from llmflow.plugins import forget_edited, suggest
from llmflow.redaction import REDACTED
from llmflow.stages.base import fill_defaults
from llmflow.workflow import dag
from llmflow.workflow.loader import load_workflow
from llmflow.workflow.marks import ValidationError, WorkflowError
from llmflow.workflow.registry import (
    INPUT_PREFIX,
    is_file_ref,
    listing_hash,
    referenced_code,
    referenced_inputs,
    stage_identity,
)
from llmflow.workflow.rundir import SUMMARY_FILE, check_run_dir, read_json
from llmflow.workflow.state import (
    StageState,
    fingerprint,
    outputs_changed,
    portable,
    read_state,
    upstream_unchanged,
)
from llmflow.workflow.validate import Checked, SetParams, check, known_params, resolve_with, unset_env


@dataclass
class PlanItem:
    """One stage in execution order. ``action``: run, cached or skip (not selected by --only)."""

    stage: str
    type: str
    action: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"stage": self.stage, "type": self.type, "action": self.action, "reason": self.reason}


@dataclass
class Selection:
    """Stages this run considers (``--only``) and those it re-runs regardless (``--force``/``--from``)."""

    selected: set[str]
    forced: set[str]


def select(checked: Checked, only: Iterable[str] | None, from_stage: str | None, force: bool) -> Selection:
    """Apply --only/--from/--force; unknown stage names are UserErrors with a suggestion."""
    stages = checked.workflow.stages
    only = list(only or [])
    for name in [*only, *([from_stage] if from_stage else [])]:
        if name not in stages:
            raise UserError(f"unknown stage {name!r}{suggest(name, stages)}")
    selected = set(only) if only else set(stages)
    forced = set(selected) if force else set()
    if from_stage:
        forced |= dag.downstream(checked.needs, [from_stage]) & selected
    return Selection(selected, forced)


@dataclass
class StageKey:
    """What a stage's cache entry must match: resolved ``params`` and what is derived from them."""

    params: dict[str, Any]
    identity: str
    code: dict[str, str]
    fingerprint: str
    upstream: dict[str, str]  # needed stage -> its fingerprint
    upstream_runs: dict[str, str]  # needed stage -> the run id of its result in use
    typed: dict[str, str] = field(default_factory=dict)  # ``input:`` key -> its path as the user wrote it
    upstream_content: dict[str, str] = field(default_factory=dict)  # needed stage -> its content key


def stage_key(checked: Checked, sid: str, states: dict[str, StageState], run_dir: Path) -> StageKey:
    """The key of stage ``sid`` given the states of the stages it needs (raises WorkflowError on
    parameters that do not resolve or validate)."""
    spec = checked.workflow.stages[sid]
    params = resolve_with(checked, sid, {d: states[d].outputs for d in spec.needs})
    identity = stage_identity(spec.uses, checked.classes[sid], spec.base_dir)
    dirs = [checked.workflow.directory, spec.base_dir]
    writes_to = getattr(checked.classes[sid], "writes_to", ())
    typed: dict[str, str] = {}
    inputs = referenced_inputs(params, dirs, run_dir, writes_to, checked.order, typed, cwd=Path.cwd(),
                               schema=getattr(checked.classes[sid], "params_schema", None),
                               any_word=is_file_ref(spec.uses))
    code = {**referenced_code(params, [*dirs, Path.cwd()]), **inputs}
    upstream = {d: states[d].fingerprint for d in spec.needs}
    contents = {d: states[d].content or "" for d in spec.needs if states[d].content}
    # what it reads of a needed stage is that stage's result, not how it was made: its content key
    # (a rerun that made the same result changes nothing here); without one (a state of an older
    # llmflow), its fingerprint, as before
    read = {d: contents.get(d) or upstream[d] for d in spec.needs}
    fp = fingerprint(identity, portable(params, run_dir), read, code)
    runs = {d: states[d].run_id or "" for d in spec.needs}
    return StageKey(params, identity, code, fp, upstream, runs, typed, contents)


@dataclass
class Decision:
    """What a run does with one stage. ``action``: run, cached, or skip (not selected by --only);
    ``state``: its completed result on disk, if any (in use when cached or skipped); ``key``: the
    key it runs under (None when skipped, or when a stage it needs runs first in a plan)."""

    action: str
    reason: str
    state: StageState | None
    key: StageKey | None


def plan_stage(checked: Checked, sel: Selection, sid: str, states: dict[str, StageState], run_dir: Path,
               failed_before: set[str], upstream_runs: bool = False) -> Decision:
    """The decision for stage ``sid``, given the states in use of the stages it needs (``states``)
    or, with ``upstream_runs``, knowing that one of them runs first (its outputs are not known
    yet, so neither is this stage's key)."""
    state = read_state(run_dir / sid)
    if sid not in sel.selected:
        stale = None if upstream_runs else stale_reason(checked, sid, states, run_dir, state)
        said = "not selected (--only)" + (f"; its result is stale: {stale}" if stale else "")
        return Decision("skip", said, state, None)
    key = None if upstream_runs else stage_key(checked, sid, states, run_dir)
    run, reason = decide(state, key, run_dir / sid, sid in sel.forced, sid in failed_before)
    return Decision("run" if run else "cached", reason, state, key)


def stale_reason(checked: Checked, sid: str, states: dict[str, StageState], run_dir: Path,
                 state: StageState | None) -> str | None:
    """Why the completed result of a stage left out by ``--only`` would be redone by a full run
    (its parameters, code or inputs changed since), or None: it is current, there is none, or a
    stage it needs has no result in use to say."""
    if state is None or any(dep not in states for dep in checked.workflow.stages[sid].needs):
        return None
    run, why = decide(state, stage_key(checked, sid, states, run_dir), run_dir / sid, False, False)
    return why if run else None


def decide(
    state: StageState | None,
    key: StageKey | None,
    stage_dir: Path,
    forced: bool,
    previously_failed: bool,
) -> tuple[bool, str]:
    """(run?, reason) for one stage; ``key`` None: a stage it needs runs first."""
    if forced:
        return True, "forced"
    if state is None:
        return True, "previous run failed" if previously_failed else "new"
    if key is None or not upstream_unchanged(state, key.upstream_runs, key.upstream_content):
        return True, "upstream changed"
    if state.fingerprint != key.fingerprint:
        if previously_failed:
            return True, "previous run failed"
        if state.identity != key.identity:
            return True, "stage type or version changed"
        return True, fingerprint_change(state, key, stage_dir.parent)
    changed = outputs_changed(stage_dir, state) or written_changed(state)
    if changed:
        return True, f"outputs changed on disk ({changed})"
    return False, "cached"


def fingerprint_change(state: StageState, key: StageKey, run_dir: Path) -> str:
    """Why a stage of the same type and version has another fingerprint: a code file or input
    whose content changed (the same file, the same path), else the parameters that changed, else
    a code file or input that came or went with the parameters unchanged."""
    old = state.code or {}
    # a code ref is ``file.py:name``: compared by file, so naming another function of the same
    # file (``--set target_patch=f.py:scale_b``) is a parameter change, not a code change
    old_files, new_files = _by_file(old), _by_file(key.code)
    for path in sorted(old_files.keys() & new_files.keys()):
        if old_files[path] != new_files[path]:
            return f"code changed: {path}"
    for ref in sorted(old.keys() & key.code.keys()):
        if ref.startswith(INPUT_PREFIX) and old[ref] != key.code[ref]:
            return f"input changed: {key.typed.get(ref, ref[len(INPUT_PREFIX):])}"
    names = changed_params(state.params, key.params, run_dir)
    if names:
        return "parameters changed: " + ", ".join(names)
    if state.code is not None and old != key.code:  # (a file it names appeared or went)
        changed = sorted(r for r in {*old, *key.code} if old.get(r) != key.code.get(r))
        if changed[0].startswith(INPUT_PREFIX):
            return f"input changed: {key.typed.get(changed[0], changed[0][len(INPUT_PREFIX):])}"
        return f"code changed: {changed[0].rpartition(':')[0]}"
    return "parameters changed"


def _by_file(code: dict[str, str]) -> dict[str, str]:
    """``file.py:name`` -> hash, as file -> hash (``input:`` entries left out)."""
    return {ref.rpartition(":")[0]: h for ref, h in code.items() if not ref.startswith(INPUT_PREFIX)}


def changed_params(old: dict[str, Any], new: dict[str, Any], run_dir: Path) -> list[str]:
    """Names of the parameters whose value in ``new`` is not the one recorded in ``old`` (paths
    in the run dir compared relative to it). A recorded value holding a redacted secret cannot be
    compared and is left out: a changed secret leaves "parameters changed" unnamed."""
    def text(value: Any) -> str:
        return json.dumps(value, sort_keys=True, default=str)

    before, after = portable(old, run_dir)[0], portable(new, run_dir)[0]
    return sorted(name for name in {*before, *after} if text(before.get(name)) != text(after.get(name))
                  and REDACTED not in text(before.get(name)))


def written_changed(state: StageState) -> str | None:
    """Why what a completed stage wrote outside the run dir (a dump in the user's ``dump_dir``)
    no longer matches what it left there (one folder named), or None."""
    for path, recorded in state.written.items():
        where = Path(path)
        if not where.exists():
            return f"{path} is gone"
        if listing_hash(where) != recorded:
            return f"{path} was modified"
    return None


def previous_failures(run_dir: Path) -> set[str]:
    """Stages the last run (its summary.json) recorded as failed."""
    summary = read_json(run_dir / SUMMARY_FILE)
    stages = summary.get("stages", {}) if isinstance(summary, dict) else {}
    return {sid for sid, st in stages.items() if isinstance(st, dict) and st.get("status") == "failed"}


def missing_upstream(checked: Checked, sel: Selection, run_dir: Path) -> None:
    """``--only``: every stage a selected one needs must be selected or have a completed result;
    and no selected stage names an unset environment variable (``unset_env``)."""
    unset = unset_env(checked.workflow, [sid for sid in checked.order if sid in sel.selected])
    if unset:
        raise WorkflowError(unset)
    for sid in checked.order:
        if sid not in sel.selected:
            continue
        for dep in checked.workflow.stages[sid].needs:
            if dep not in sel.selected and read_state(run_dir / dep) is None:
                raise UserError(
                    f"--only {sid}: stage {dep!r} (needed by {sid!r}) has no completed result "
                    f"in {run_dir}; run it first or add --only {dep}"
                )


def check_devices(checked: Checked, sel: Selection, run_dir: Path) -> None:
    """Every device that a stage about to run names in its parameters known before the run (a
    dump's ``device: npu:0``, read through the stage's ``resources``) is available here: a target
    on an NPU this machine lacks fails now, not after the golden dump ahead of it (hours at 70B).
    Stages the plan reuses are not asked; nothing is planned where no stage names a device."""
    named: list[tuple[str, str]] = []  # (stage, device)
    for sid in checked.order:
        cls = checked.classes.get(sid)
        if sid not in sel.selected or cls is None:
            continue
        try:
            held = cls().resources(fill_defaults(cls.params_schema, known_params(checked, sid)))
        except Exception:  # (the stage reports a bad parameter when it runs)
            continue
        named += [(sid, r.partition(":")[2]) for r in sorted(held) if r.startswith("device:")]
    if not named:
        return
    from llmflow.models import resolve_device  # (imports torch: only where a device is named)

    to_run = {i.stage for i in compute_plan(checked, sel, run_dir) if i.action == "run"}
    errors, seen = [], set()
    for sid, device in named:
        if sid not in to_run or device in seen:
            continue
        seen.add(device)
        try:
            resolve_device(device)
        except UserError as exc:
            where = checked.workflow.mark("stages", sid, "with")
            errors.append(ValidationError(f"stage {sid!r}: {exc}", where))
    if errors:
        raise WorkflowError(errors)


def compute_plan(checked: Checked, sel: Selection, run_dir: Path) -> list[PlanItem]:
    """Simulate a run without executing anything."""
    missing_upstream(checked, sel, run_dir)
    failed = previous_failures(run_dir)
    in_use: dict[str, StageState] = {}  # sid -> the state of a result that will be reused
    will_run: set[str] = set()
    items = []
    for sid in checked.order:
        spec = checked.workflow.stages[sid]
        decision = plan_stage(checked, sel, sid, in_use, run_dir, failed,
                              upstream_runs=any(d in will_run for d in spec.needs))
        if decision.action == "run":
            will_run.add(sid)
        elif decision.state is not None:
            in_use[sid] = decision.state
        items.append(PlanItem(sid, spec.uses, decision.action, decision.reason))
    return items


def prepare(path: str | Path, set_params: SetParams, trust_plugins: bool = True) -> Checked:
    """Load and check a workflow for running: raises WorkflowError listing every problem.
    ``trust_plugins=False`` reads ``file.py:Class`` stages without importing them."""
    forget_edited()  # (plugins edited since an earlier run in this process are imported afresh)
    checked = check(load_workflow(path), set_params, runtime=True, trust_plugins=trust_plugins)
    if checked.errors:
        raise WorkflowError(checked.errors)
    return checked


def default_run_dir(checked: Checked, run_dir: str | Path | None) -> Path:
    """``run_dir`` or ``runs/<workflow name>`` under the current directory; absolute."""
    return Path(run_dir or Path("runs") / checked.workflow.name).expanduser().resolve()


def plan_workflow(
    path: str | Path,
    set_params: SetParams = None,
    run_dir: str | Path | None = None,
    only: Iterable[str] | None = None,
    from_stage: str | None = None,
    force: bool = False,
    trust_plugins: bool = False,
) -> list[PlanItem]:
    """What ``run_workflow`` with the same arguments would do, stage by stage, in order. Nothing
    is executed: ``file.py:Class`` stages are read, not imported, unless ``trust_plugins``."""
    checked = prepare(path, set_params, trust_plugins)
    rdir = default_run_dir(checked, run_dir)
    if rdir.exists():
        check_run_dir(rdir, checked.order)
    return compute_plan(checked, select(checked, only, from_stage, force), rdir)
