"""SIGKILL a real `llmflow run` mid-stage: the rerun keeps finished stages and redoes the killed one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO, ran, write_workflow  # noqa: E402

WORKFLOW = """
    name: killme
    params:
      seconds: {type: number, default: 60}
    stages:
      first:
        uses: {HELPERS}:EchoStage
        with: {value: 1}
      slow:
        uses: {HELPERS}:SleepStage
        needs: [first]
        with: {marker: "%s", seconds: "${params.seconds}"}
"""


def _ctrl_c_as_in_a_terminal() -> None:
    """A job started in the background of a non-interactive shell inherits SIGINT ignored, and
    Python then leaves it ignored: give the child the default a terminal gives."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def llmflow(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "llmflow.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )


def test_sigkill_mid_stage_then_resume(tmp_path):
    marker = tmp_path / "slow-started"
    wf = write_workflow(tmp_path, WORKFLOW % marker)
    rd = tmp_path / "run"
    proc = llmflow("run", str(wf), "--run-dir", str(rd), cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the slow stage never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    # the killed stage left only a tmp dir; nothing marks it complete
    assert (rd / "first" / ".llmflow-stage.json").exists()
    assert not (rd / "slow").exists()
    leftovers = list((rd / ".tmp").iterdir())
    assert [p.name.split("-")[0] for p in leftovers] == ["slow"]
    assert (leftovers[0] / "started.txt").exists() and not (leftovers[0] / "finished.txt").exists()
    summary = json.loads((rd / "summary.json").read_text())  # atomic writes: never torn
    assert summary["stages"]["slow"]["status"] == "running"

    plan = llmflow("plan", str(wf), "--run-dir", str(rd), "--json", cwd=tmp_path)
    items = {i["stage"]: (i["action"], i["reason"]) for i in json.loads(plan.communicate(timeout=60)[0])}
    assert items == {"first": ("cached", "cached"), "slow": ("run", "new")}

    rerun = llmflow("run", str(wf), "--run-dir", str(rd), "--set", "seconds=0.1", cwd=tmp_path)
    out = rerun.communicate(timeout=60)[0]
    assert rerun.returncode == 0, out
    assert out.rstrip().splitlines()[-1] == "PASSED (1 cached, 1 done)"
    assert ran(rd) == ["first", "slow", "slow"]  # first ran once; slow again
    assert (rd / "slow" / "finished.txt").exists() and (rd / "slow" / ".llmflow-stage.json").exists()
    assert list((rd / ".tmp").iterdir()) == []


def test_sigint_exits_130_and_records_interruption(tmp_path):
    marker = tmp_path / "slow-started"
    wf = write_workflow(tmp_path, WORKFLOW % marker)
    rd = tmp_path / "run"
    proc = llmflow("run", str(wf), "--run-dir", str(rd), cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 130, out
    assert out.rstrip().splitlines()[-1] == "FAILED: interrupted" and "Traceback" not in out
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["stages"]["slow"]["error"] == "interrupted"
    plan = llmflow("plan", str(wf), "--run-dir", str(rd), "--json", cwd=tmp_path)
    items = {i["stage"]: i["reason"] for i in json.loads(plan.communicate(timeout=60)[0])}
    assert items == {"first": "cached", "slow": "previous run failed"}  # and the lock was released


def test_ctrl_c_that_lands_on_a_stage_thread_still_stops_the_run(tmp_path):
    """The kernel may hand a terminal's SIGINT to any thread of the process; Python runs the
    handler in the main thread only, so the runner must not sleep through it until the stage ends."""
    marker = tmp_path / "slow-started"
    wf = write_workflow(tmp_path, WORKFLOW % marker)
    script = tmp_path / "user_run.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys, threading, time
        from pathlib import Path
        from llmflow.workflow.runner import run_workflow

        def interrupt_the_stage_thread():
            while not Path({str(marker)!r}).exists():
                time.sleep(0.02)
            stage = next(t for t in threading.enumerate() if t.name == "stage-slow")
            signal.pthread_kill(stage.ident, signal.SIGINT)

        threading.Thread(target=interrupt_the_stage_thread, daemon=True).start()
        t0 = time.monotonic()
        try:
            run_workflow({str(wf)!r}, run_dir={str(tmp_path / "run")!r})
        except KeyboardInterrupt:
            print(f"interrupted after {{time.monotonic() - t0:.1f}} s")
            sys.exit(130)
        print("never interrupted")
    """), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)}, timeout=50,
                          preexec_fn=_ctrl_c_as_in_a_terminal)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    seconds = float(proc.stdout.split("interrupted after ")[1].split()[0])
    assert seconds < 20  # the stage sleeps 60 s; the run stops within a fraction of a second
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stages"]["slow"]["error"] == "interrupted"
