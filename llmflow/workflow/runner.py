"""Run a workflow: stages in dependency order, concurrently up to ``workers``, cached when unchanged.

The main thread owns all bookkeeping (decisions, state files, renames, summary.json); worker
threads only call ``Stage.run``. A stage becomes ready when everything it needs is done or
cached; it starts when a worker is free and none of its exclusive resources is held. A failed
stage marks its dependents ``skipped``; other branches go on. A stage's outcome
(``ctx.set_outcome``) is kept in its state file, so a cached stage still contributes it to the
run's conclusion (conclusion.py). See rundir.py and state.py for the on-disk layout.
"""

from __future__ import annotations

import errno
import json
import logging
import queue
import secrets
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmflow import interrupts
from llmflow.atomic import atomic_write_json
from llmflow.errors import UserError, one_line
from llmflow.stages.base import ChildCrashed, Stage, StageContext
from llmflow.workflow import rundir
from llmflow.workflow import state as st
from llmflow.workflow.conclusion import Conclusion, conclude, outcome_record
from llmflow.workflow.plan import (
    Selection,
    StageKey,
    check_devices,
    compute_plan,
    default_run_dir,
    missing_upstream,
    plan_stage,
    prepare,
    previous_failures,
    select,
    stale_reason,
)
from llmflow.workflow.progress import Reporter
from llmflow.workflow.registry import written_outside
from llmflow.workflow.result import RunResult, StageResult, now_iso, run_status
from llmflow.workflow.summary import SummaryWriter
from llmflow.workflow.validate import Checked, SetParams

log = logging.getLogger("llmflow.workflow")


@dataclass
class _Prepared:
    """A stage that must run: its instance, key (params, fingerprint, ...) and why."""

    stage: Stage
    key: StageKey
    reason: str
    resources: set[str]


class _Run:
    def __init__(self, checked: Checked, sel: Selection, run_dir: Path, workers: int, reporter: Reporter):
        self.checked, self.sel, self.run_dir = checked, sel, run_dir
        self.wf = checked.workflow
        self.workers = max(1, workers)
        self.reporter = reporter
        self.results = {sid: StageResult(sid, self.wf.stages[sid].uses) for sid in checked.order}
        self.states: dict[str, st.StageState] = {}  # sid -> state of its result in use
        self.prepared: dict[str, _Prepared] = {}
        self.running: dict[str, tuple[_Prepared, Path, float]] = {}
        self.done_q: queue.Queue = queue.Queue()
        self.failed_before = previous_failures(run_dir)
        self.summary = SummaryWriter(run_dir / rundir.SUMMARY_FILE, self.wf, checked.params, self.results,
                                     checked.redact)
        self.conclusion: Conclusion | None = None

    # -- the loop -------------------------------------------------------------------------------
    def execute(self) -> None:
        missing_upstream(self.checked, self.sel, self.run_dir)
        for sid in self.checked.order:
            if sid not in self.sel.selected:  # left out by --only: its previous result, if any, is used
                state = st.read_state(self.run_dir / sid)
                if state is not None:
                    stale = stale_reason(self.checked, sid, self.states, self.run_dir, state)
                    self.results[sid].stale = stale or None
                    self._use_state(sid, state, "not selected, previous result" + (
                        f"; STALE ({stale}): run without --only to redo it" if stale else ""))
        self.summary.write("running")
        while True:
            progressed = self._launch_ready()
            if not self.running:
                if progressed:
                    continue
                break
            self._wait_one()
        outcomes = {
            sid: r.outcome for sid, r in self.results.items() if r.outcome and r.status in ("done", "cached")
        }
        self.conclusion = conclude(self.checked.order, self.checked.needs, outcomes, self.states)
        self.summary.write(run_status(self.results, self.conclusion), self.conclusion)

    def _launch_ready(self) -> bool:
        progressed = False
        held = {r for p, _, _ in self.running.values() for r in p.resources}
        for sid in self.checked.order:
            res = self.results[sid]
            if res.status != "pending" or sid not in self.sel.selected or sid in self.running:
                continue
            needs = self.wf.stages[sid].needs
            bad = [d for d in needs if self.results[d].status in ("failed", "skipped")]
            if bad:
                self._finish(sid, "skipped", error=f"needs {bad[0]!r}, which {self.results[bad[0]].status}")
                progressed = True
                continue
            if not all(self.results[d].status in ("done", "cached") for d in needs):
                continue
            if sid not in self.prepared:
                prep = self._prepare(sid)
                progressed = True
                if prep is None:
                    continue
            prep = self.prepared[sid]
            if len(self.running) >= self.workers or prep.resources & held:
                continue
            try:
                self._start(sid, prep)
            except OSError as exc:  # no room for its temporary folder: the stage's failure
                self._fail(sid, exc)
                progressed = True
                continue
            held |= prep.resources
            progressed = True
        return progressed

    def _prepare(self, sid: str) -> _Prepared | None:
        """Resolve params and decide; a cached stage is finished here (returns None)."""
        try:
            decision = plan_stage(self.checked, self.sel, sid, self.states, self.run_dir, self.failed_before)
            if decision.action == "cached" and decision.state is not None:
                self._use_state(sid, decision.state, "")
                return None
            assert decision.key is not None  # (selected, its inputs known: it has a key)
            stage = self.checked.classes[sid]()
            resources = set(stage.resources(decision.key.params))
        except (Exception, SystemExit) as exc:  # a bad reference, a failing resources(): its own failure
            self._fail(sid, exc)
            return None
        self.prepared[sid] = _Prepared(stage, decision.key, decision.reason, resources)
        return self.prepared[sid]

    def _use_state(self, sid: str, state: st.StageState, detail: str) -> None:
        self.states[sid] = state
        res = self.results[sid]
        res.outputs, res.summary, res.outcome = state.outputs, state.summary, state.outcome
        res.cached = True
        # when the result in use was made (not when this run looked at it): a reader of
        # summary.json sees how old it is
        res.started, res.finished, res.duration_s = state.started, state.finished, state.duration_s
        self._finish(sid, "cached", detail=detail)

    def _start(self, sid: str, prep: _Prepared) -> None:
        tmp = rundir.new_tmp_dir(self.run_dir, sid)
        final = self.run_dir / sid
        ctx = StageContext(
            stage_id=sid,
            params=prep.key.params,
            out_dir=tmp,
            final_dir=final,
            run_dir=self.run_dir,
            workflow_dir=self.wf.directory,
            inputs={d: self.states[d].outputs for d in self.wf.stages[sid].needs},
            failed_dir=self.run_dir / rundir.FAILED_DIR / sid,
            log=lambda msg, _sid=sid: self.reporter.log(_sid, _unprefixed(_sid, msg)),
            progress=lambda description="", total=None, _sid=sid: self.reporter.task(
                _sid, _unprefixed(_sid, description), total
            ),
            redact=self.checked.redact,
        )
        res = self.results[sid]
        res.status, res.started = "running", now_iso()
        self.running[sid] = (prep, tmp, time.monotonic())
        self.reporter.status(sid, "running", prep.reason)
        self.summary.write("running")
        threading.Thread(
            target=self._work, args=(sid, prep.stage, ctx), name=f"stage-{sid}", daemon=True
        ).start()

    def _work(self, sid: str, stage: Stage, ctx: StageContext) -> None:
        try:
            outputs = stage.run(ctx)
            # hashed here, beside the stage's work, not on the main thread the other stages wait on
            files = st.files_digest(ctx.out_dir)
            self.done_q.put((sid, ctx, outputs, None, files))
        except BaseException as exc:  # reported by the main thread, which decides what it means
            self.done_q.put((sid, ctx, None, exc, None))

    def _wait_one(self) -> None:
        # (a stage runs in a thread of its own: the wait must let Ctrl-C through, see interrupts.py)
        sid, ctx, outputs, exc, files = interrupts.wait(lambda t: self.done_q.get(timeout=t), queue.Empty)
        prep, tmp, t0 = self.running.pop(sid)
        self.results[sid].duration_s = round(time.monotonic() - t0, 3)
        if exc is None:
            try:
                self._complete(sid, prep, tmp, ctx, outputs, files)
                return
            except Exception as err:  # bad outputs: the stage's fault
                exc = err
        if _disk_full(exc):  # its partial output would keep the disk full: dropped, not kept
            rundir.remove_tmp(tmp)
        else:
            rundir.discard(tmp, self.run_dir, sid)
        self._fail(sid, exc)

    def _complete(self, sid: str, prep: _Prepared, tmp: Path, ctx: StageContext, outputs: Any,
                  files: str | None) -> None:
        if outputs is None:
            outputs = {}
        if not isinstance(outputs, dict):
            raise TypeError(f"run() returned {type(outputs).__name__}, expected a dict of outputs")
        declared = getattr(self.checked.classes[sid], "outputs", None) or {}
        lacking = [name for name in declared if name not in outputs]
        if lacking:  # (the stage's fault, not left to the stage that reads it: nothing is kept)
            raise ValueError(f"run() returned no {lacking[0]!r} of the outputs it declares "
                             f"({', '.join(declared)}): return each, None where it has no value")
        final = self.run_dir / sid
        outputs = st.rewrite_paths(outputs, str(tmp), str(final))
        summary = st.rewrite_paths(ctx.summary, str(tmp), str(final))
        json.dumps([outputs, summary])  # fails here (stage failed) rather than in summary.json
        res = self.results[sid]
        key = prep.key
        read = {d: key.upstream_content.get(d) or f"run:{run}" for d, run in key.upstream_runs.items()}
        state = st.StageState(
            stage=sid, type=self.wf.stages[sid].uses, identity=key.identity, fingerprint=key.fingerprint,
            code=key.code, run_id=secrets.token_hex(8), params=key.params, upstream=key.upstream,
            upstream_runs=key.upstream_runs, outputs=outputs, summary=summary,
            outcome=outcome_record(ctx.outcome), started=res.started, finished=now_iso(),
            duration_s=res.duration_s, content=st.content_key(outputs, files, read, self.run_dir),
            upstream_content=key.upstream_content,
            written=written_outside(key.params, getattr(self.checked.classes[sid], "writes_to", ()),
                                    self.wf.directory, self.run_dir))
        # stored redacted (secret values, URL credentials); the fingerprint, a hash of the real
        # parameters, still changes with them. This run's later stages get the real outputs.
        record = self.checked.redact(state.to_json(self.run_dir, tmp))
        atomic_write_json(tmp / st.STATE_FILE, record, indent=2, durable=True)
        rundir.install(tmp, final)
        rundir.remove_failed(self.run_dir, sid)
        self.states[sid] = state
        res.outputs, res.summary, res.finished = outputs, summary, state.finished
        res.outcome = state.outcome
        self._finish(sid, "done", detail=f"{res.duration_s:.1f}s")

    def _fail(self, sid: str, exc: BaseException) -> None:
        res = self.results[sid]
        res.user_error = isinstance(exc, UserError)
        res.error = str(exc) if res.user_error else f"{type(exc).__name__}: {exc}"
        res.traceback = exc.details if isinstance(exc, ChildCrashed) else \
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        log.debug("stage %s failed:\n%s", sid, res.traceback)
        if isinstance(exc, KeyboardInterrupt):
            res.error = "interrupted"
        elif _disk_full(exc):  # not a bug of the stage: no traceback, what to do instead
            res.error = f"{exc}; the disk holding {self.run_dir} is full (its partial output was removed)"
            res.traceback = None
        elif isinstance(exc, SystemExit):  # the stage's own failure, said in one line
            res.error = f"the stage called sys.exit({exc.code!r}) instead of returning its outputs or raising"
            res.traceback = None
        res.error = one_line(res.error)
        self._finish(sid, "failed", detail=res.error)

    def _finish(self, sid: str, status: str, detail: str = "", error: str | None = None) -> None:
        res = self.results[sid]
        res.status = status
        res.error = error if error is not None else res.error
        res.finished = res.finished or now_iso()
        self.reporter.status(sid, status, detail or (error or ""))
        self.summary.write("running")

    def interrupt(self) -> None:
        """Ctrl-C: running stages are recorded as failed; their tmp dirs go on the next run."""
        for sid in list(self.running):
            self._fail(sid, KeyboardInterrupt())
        self.summary.write("failed")


def _disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a write that found no room: ENOSPC, a quota, or a
    file size limit (EFBIG)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _unprefixed(sid: str, message: object) -> str:
    """The reporter names the stage itself; drop a ``"<stage>: "`` the stage added too."""
    text = str(message)
    return text[len(sid) + 2 :] if text.startswith(f"{sid}: ") else text


def run_workflow(
    path: str | Path,
    set_params: SetParams = None,
    run_dir: str | Path | None = None,
    only: Iterable[str] | None = None,
    from_stage: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    workers: int = 1,
    reporter: Reporter | None = None,
    adopt_run_dir: bool = False,
) -> RunResult:
    """Run (or with ``dry_run`` only plan) a workflow; see ``llmflow run --help`` for the options.

    Raises UserError (WorkflowError) for a workflow that does not validate, an unknown stage in
    ``only``/``from_stage``, a run dir that cannot be one (a file, unwritable, a link inside
    where llmflow writes, a folder of someone else's files unless ``adopt_run_dir``) or one held
    by another run. Stage failures do not raise: they are in
    the result (``result.exit_code`` is 1, or 2 when a stage raised a UserError); so is what the
    stages concluded (``result.conclusion``: exit code 1 fail, 3 inconclusive, 0 pass).
    """
    checked = prepare(path, set_params, trust_plugins=not dry_run)  # a dry run executes nothing
    sel = select(checked, only, from_stage, force)
    rdir = default_run_dir(checked, run_dir)
    reporter = reporter or Reporter()
    if dry_run:
        if rdir.exists():
            rundir.check_run_dir(rdir, checked.order)
        plan = compute_plan(checked, sel, rdir)
        return RunResult(checked.workflow.name, rdir, "planned", {}, {}, plan)
    if rdir.exists():
        rundir.check_run_dir(rdir, checked.order)
    check_devices(checked, sel, rdir)  # (before the run dir is made: a run that cannot start leaves none)
    rundir.open_run_dir(rdir, checked.order, adopt=adopt_run_dir)
    with rundir.RunDirLock(rdir):
        removed = rundir.clean_tmp(rdir)
        if removed:
            log.info("removed %d leftover temporary dir(s) of an interrupted run", len(removed))
        run = _Run(checked, sel, rdir, workers, reporter)
        reporter.start({sid: checked.workflow.stages[sid].uses for sid in checked.order})
        try:
            run.execute()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (interrupts.Terminated)
            interrupts.stop_children()  # a dump worker must not outlive the run
            run.interrupt()
            raise
        finally:
            reporter.stop()
    status = run_status(run.results, run.conclusion)
    return RunResult(checked.workflow.name, rdir, status, run.results, run.summary.data, [], run.conclusion)
