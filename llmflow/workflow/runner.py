"""Run a workflow: stages in dependency order, concurrently up to ``workers``, cached when unchanged.

The main thread owns all bookkeeping (decisions, state files, renames, summary.json); worker
threads only call ``Stage.run``. A stage becomes ready when everything it needs is done or
cached; it starts when a worker is free and none of its exclusive resources is held. A failed
stage marks its dependents ``skipped``; other branches go on. See state.py for the on-disk layout.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import shutil
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmflow.errors import UserError
from llmflow.stages.base import Stage, StageContext
from llmflow.workflow import state as st
from llmflow.workflow.plan import (
    Selection,
    compute_plan,
    decide,
    default_run_dir,
    missing_upstream,
    prepare,
    previous_failures,
    select,
)
from llmflow.workflow.progress import Reporter
from llmflow.workflow.registry import stage_identity
from llmflow.workflow.result import RunResult, StageResult, now_iso
from llmflow.workflow.summary import SummaryWriter
from llmflow.workflow.validate import Checked, SetParams, resolve_with

log = logging.getLogger("llmflow.workflow")


@dataclass
class _Prepared:
    """A stage that must run: its instance, params, fingerprint and why."""

    stage: Stage
    params: dict[str, Any]
    fingerprint: str
    identity: str
    reason: str
    resources: set[str]


class _Run:
    def __init__(self, checked: Checked, sel: Selection, run_dir: Path, workers: int, reporter: Reporter):
        self.checked, self.sel, self.run_dir = checked, sel, run_dir
        self.wf = checked.workflow
        self.workers = max(1, workers)
        self.reporter = reporter
        self.results = {sid: StageResult(sid, self.wf.stages[sid].uses) for sid in checked.order}
        self.states: dict[str, dict[str, Any]] = {}  # sid -> state of its result in use
        self.prepared: dict[str, _Prepared] = {}
        self.running: dict[str, tuple[_Prepared, Path, float]] = {}
        self.done_q: queue.Queue = queue.Queue()
        self.failed_before = previous_failures(run_dir)
        self.summary = SummaryWriter(run_dir / "summary.json", self.wf, checked.params, self.results)

    # -- the loop -------------------------------------------------------------------------------
    def execute(self) -> None:
        missing_upstream(self.checked, self.sel, self.run_dir)
        for sid in self.checked.order:
            if sid not in self.sel.selected:
                state = st.read_state(self.run_dir / sid)
                if state is not None:
                    self._use_state(sid, state, "not selected, previous result")
        self.summary.write("running")
        while True:
            progressed = self._launch_ready()
            if not self.running:
                if progressed:
                    continue
                break
            self._wait_one()
        self.summary.write("failed" if any(r.status == "failed" for r in self.results.values()) else "passed")

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
            self._start(sid, prep)
            held |= prep.resources
            progressed = True
        return progressed

    def _prepare(self, sid: str) -> _Prepared | None:
        """Resolve params and decide; a cached stage is finished here (returns None)."""
        spec = self.wf.stages[sid]
        try:
            params = resolve_with(
                self.checked, sid, {d: self.states[d].get("outputs", {}) for d in spec.needs}
            )
            cls = self.checked.classes[sid]
            identity = stage_identity(spec.uses, cls, spec.base_dir)
            fp = st.fingerprint(identity, params, {d: self.states[d]["fingerprint"] for d in spec.needs})
            state = st.read_state(self.run_dir / sid)
            run, reason = decide(
                state,
                fp,
                identity,
                {d: self.states[d].get("run_id", "") for d in spec.needs},
                sid in self.sel.forced,
                sid in self.failed_before,
            )
            if not run:
                self._use_state(sid, state or {}, "")
                return None
            stage = cls()
            resources = set(stage.resources(params))
        except Exception as exc:  # a bad reference, a failing resources(): the stage's own failure
            self._fail(sid, exc)
            return None
        self.prepared[sid] = _Prepared(stage, params, fp, identity, reason, resources)
        return self.prepared[sid]

    def _use_state(self, sid: str, state: dict[str, Any], detail: str) -> None:
        self.states[sid] = state
        res = self.results[sid]
        res.outputs = state.get("outputs", {})
        res.summary = state.get("summary", {})
        res.cached = True
        self._finish(sid, "cached", detail=detail)

    def _start(self, sid: str, prep: _Prepared) -> None:
        tmp = st.new_tmp_dir(self.run_dir, sid)
        final = self.run_dir / sid
        ctx = StageContext(
            stage_id=sid,
            params=prep.params,
            out_dir=tmp,
            final_dir=final,
            run_dir=self.run_dir,
            workflow_dir=self.wf.directory,
            inputs={d: self.states[d].get("outputs", {}) for d in self.wf.stages[sid].needs},
            log=lambda msg, _sid=sid: self.reporter.log(_sid, _unprefixed(_sid, msg)),
            progress=lambda description="", total=None, _sid=sid: self.reporter.task(
                _sid, _unprefixed(_sid, description), total
            ),
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
            self.done_q.put((sid, ctx, outputs, None))
        except BaseException as exc:  # reported by the main thread, which decides what it means
            self.done_q.put((sid, ctx, None, exc))

    def _wait_one(self) -> None:
        sid, ctx, outputs, exc = self.done_q.get()
        prep, tmp, t0 = self.running.pop(sid)
        self.results[sid].duration_s = round(time.monotonic() - t0, 3)
        if exc is None:
            try:
                self._complete(sid, prep, tmp, ctx, outputs)
                return
            except Exception as err:  # bad outputs: the stage's fault
                exc = err
        st.discard(tmp, self.run_dir / ".failed" / sid)
        self._fail(sid, exc)

    def _complete(self, sid: str, prep: _Prepared, tmp: Path, ctx: StageContext, outputs: Any) -> None:
        if outputs is None:
            outputs = {}
        if not isinstance(outputs, dict):
            raise TypeError(f"run() returned {type(outputs).__name__}, expected a dict of outputs")
        final = self.run_dir / sid
        outputs = st.rewrite_paths(outputs, str(tmp), str(final))
        summary = st.rewrite_paths(ctx.summary, str(tmp), str(final))
        json.dumps([outputs, summary])  # fails here (stage failed) rather than in summary.json
        res = self.results[sid]
        state = {
            "stage": sid,
            "type": self.wf.stages[sid].uses,
            "identity": prep.identity,
            "fingerprint": prep.fingerprint,
            "run_id": secrets.token_hex(8),
            "params": prep.params,
            "upstream": {d: self.states[d]["fingerprint"] for d in self.wf.stages[sid].needs},
            "upstream_runs": {d: self.states[d].get("run_id", "") for d in self.wf.stages[sid].needs},
            "outputs": outputs,
            "summary": summary,
            "started": res.started,
            "finished": now_iso(),
            "duration_s": res.duration_s,
        }
        st.atomic_write_json(tmp / st.STATE_FILE, state)
        st.install(tmp, final)
        shutil.rmtree(self.run_dir / ".failed" / sid, ignore_errors=True)  # an older failure's leftovers
        self.states[sid] = state
        res.outputs, res.summary, res.finished = outputs, summary, state["finished"]
        self._finish(sid, "done", detail=f"{res.duration_s:.1f}s")

    def _fail(self, sid: str, exc: BaseException) -> None:
        res = self.results[sid]
        res.user_error = isinstance(exc, UserError)
        res.error = str(exc) if res.user_error else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, KeyboardInterrupt):
            res.error = "interrupted"
        res.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        log.debug("stage %s failed:\n%s", sid, res.traceback)
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
) -> RunResult:
    """Run (or with ``dry_run`` only plan) a workflow; see ``llmflow run --help`` for the options.

    Raises UserError (WorkflowError) for a workflow that does not validate, an unknown stage in
    ``only``/``from_stage`` or a run dir held by another run. Stage failures do not raise: they
    are in the result (``result.exit_code`` is 1, or 2 when a stage raised a UserError).
    """
    checked = prepare(path, set_params)
    sel = select(checked, only, from_stage, force)
    rdir = default_run_dir(checked, run_dir)
    reporter = reporter or Reporter()
    if dry_run:
        plan = compute_plan(checked, sel, rdir)
        return RunResult(checked.workflow.name, rdir, "planned", {}, {}, plan)
    with st.RunDirLock(rdir):
        removed = st.clean_tmp(rdir)
        if removed:
            log.info("removed %d leftover temporary dir(s) of an interrupted run", len(removed))
        run = _Run(checked, sel, rdir, workers, reporter)
        reporter.start({sid: checked.workflow.stages[sid].uses for sid in checked.order})
        try:
            run.execute()
        except KeyboardInterrupt:
            run.interrupt()
            raise
        finally:
            reporter.stop()
    status = "failed" if any(r.status == "failed" for r in run.results.values()) else "passed"
    return RunResult(checked.workflow.name, rdir, status, run.results, run.summary.data, [])
