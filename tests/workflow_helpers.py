"""Test stages and helpers for the workflow engine tests (area prefix ``engine``).

Workflows in tests reference these stages by absolute file ref: ``f"{HELPERS}:EchoStage"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, ClassVar

from llmflow.errors import UserError
from llmflow.stages.base import Stage, StageContext

HELPERS = str(Path(__file__).resolve())
REPO = Path(__file__).resolve().parents[1]


def write_workflow(directory: Path, text: str, name: str = "wf.yaml") -> Path:
    """Write a workflow (dedented; ``{HELPERS}`` replaced by this file's path)."""
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n").replace("{HELPERS}", HELPERS), encoding="utf-8")
    return path


def llmflow(*args: str, cwd: Path | None = None, umask: int | None = None, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m llmflow.cli ARGS`` as a user runs it (this checkout first on the path; ``env``
    added to the environment)."""
    # (imported here: workflows load this file as a stage file, where tests/ is not on the path)
    from path_helpers import checkout_path

    env = {**os.environ, **(env or {}), "PYTHONPATH": checkout_path(REPO)}
    return subprocess.run([sys.executable, "-m", "llmflow.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def assert_bad_input(proc: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, no traceback, and a last line ``FAILED: ...`` naming each of ``names``; returns it."""
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert last.startswith("FAILED: ") and len(last) < 600, last
    for name in names:
        assert name in last, (name, last)
    return last


def _log_event(ctx: StageContext, event: str) -> None:
    """Append ``<stage> <event> <time>`` to ``<run-dir>/events.log`` (shows what ran, and when)."""
    with open(ctx.run_dir / "events.log", "a", encoding="utf-8") as fh:
        fh.write(f"{ctx.stage_id} {event} {time.time():.4f}\n")


def events(run_dir: Path) -> list[tuple[str, str, float]]:
    path = Path(run_dir) / "events.log"
    if not path.exists():
        return []
    return [(s, e, float(t)) for s, e, t in (line.split() for line in path.read_text().splitlines())]


def ran(run_dir: Path) -> list[str]:
    """Stages that started, in order."""
    return [s for s, e, _ in events(run_dir) if e == "start"]


class EchoStage(Stage):
    """Return ``value`` as an output and write it to a file."""

    type: ClassVar[str] = "echo"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "value": {"description": "anything"},
            "count": {"type": "integer", "default": 1},
            "resource": {"type": "string", "description": "an exclusive resource to hold"},
            "sleep": {"type": "number", "default": 0},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"value": "the value", "file": "value.json", "nested": "a dict"}

    def resources(self, params: dict[str, Any]) -> set[str]:
        return {params["resource"]} if params.get("resource") else set()

    def run(self, ctx: StageContext) -> dict[str, Any]:
        _log_event(ctx, "start")
        time.sleep(ctx.params.get("sleep", 0))
        path = ctx.out_dir / "value.json"
        path.write_text(json.dumps(ctx.params.get("value")))
        task = ctx.task("echo", total=ctx.params["count"])
        task.advance(ctx.params["count"])
        ctx.log(f"echo {ctx.params.get('value')!r}")
        ctx.summary[f"echo_{ctx.stage_id}"] = {"value": ctx.params.get("value")}
        _log_event(ctx, "end")
        return {
            "value": ctx.params.get("value"),
            "file": str(path),
            "nested": {"dir": str(ctx.out_dir), "items": [1, 2, 3]},
        }


class FailStage(Stage):
    """Fail: with a UserError when ``user`` is true, else with a RuntimeError."""

    type: ClassVar[str] = "fail"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "user": {"type": "boolean", "default": False},
            "unless_file": {"type": "string", "description": "succeed when this file exists"},
        },
    }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        _log_event(ctx, "start")
        (ctx.out_dir / "partial.txt").write_text("partial")
        if ctx.params.get("unless_file") and os.path.exists(ctx.params["unless_file"]):
            return {"ok": True}
        if ctx.params["user"]:
            raise UserError("fail: device 'npu9' is not available")
        raise RuntimeError("boom")


class SleepStage(Stage):
    """Write a marker (``<marker>`` outside, ``started.txt`` inside), sleep, write ``finished.txt``."""

    type: ClassVar[str] = "sleep"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["marker"],
        "properties": {"marker": {"type": "string"}, "seconds": {"type": "number", "default": 30}},
    }
    outputs: ClassVar[dict[str, str]] = {"finished": "finished.txt"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        _log_event(ctx, "start")
        (ctx.out_dir / "started.txt").write_text("started")
        Path(ctx.params["marker"]).write_text(str(ctx.out_dir))
        time.sleep(ctx.params["seconds"])
        (ctx.out_dir / "finished.txt").write_text("finished")
        _log_event(ctx, "end")
        return {"finished": str(ctx.out_dir / "finished.txt")}


class NotAStage:
    """Referenced by a test: not a Stage subclass."""


class OutcomeStage(Stage):
    """Conclude ``status`` with ``headline`` (a judging stage, like compare or bisect); ``status``
    empty sets no outcome. Writes ``verdict.txt`` so it has a file in its dir."""

    type: ClassVar[str] = "outcome"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "status": {"type": "string", "default": "pass"},
            "headline": {"type": "string", "default": "all good"},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"verdict_file": "verdict.txt"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        _log_event(ctx, "start")
        path = ctx.out_dir / "verdict.txt"
        path.write_text(f"{ctx.params['status']}: {ctx.params['headline']}\n")
        if ctx.params["status"]:
            ctx.set_outcome(ctx.params["status"], ctx.params["headline"])
        return {"verdict_file": str(path)}


class ExitStage(Stage):
    """Call ``sys.exit(code)`` inside run(), as a careless plugin might."""

    type: ClassVar[str] = "exit"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"code": {"type": "integer", "default": 0}},
    }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        import sys

        sys.exit(ctx.params["code"])
