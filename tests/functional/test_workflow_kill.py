"""SIGKILL a real `llmflow run` mid-stage: the rerun keeps finished stages and redoes the killed one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def llmflow(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "llmflow.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
