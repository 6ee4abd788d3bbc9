"""The llmflow command: exit codes, PASSED/FAILED lines, tracebacks only with --log-level debug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

import llmflow.workflow
from llmflow.cli import TOOLS, main
from llmflow.workflow.rundir import RunDirLock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import HELPERS, REPO, write_workflow  # noqa: E402

OK = """
    name: ok
    params:
      v: {type: integer, default: 1}
    stages:
      a: {uses: "{HELPERS}:EchoStage", with: {value: "${params.v}"}}
      b: {uses: seed, needs: [a], with: {seed: "${stages.a.outputs.value}"}}
"""


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_run_plan_and_cached_rerun(tmp_path, capsys):
    wf = str(write_workflow(tmp_path, OK))
    rd = str(tmp_path / "run")
    rc, out, _ = cli(capsys, "run", wf, "--run-dir", rd, "--progress", "plain")
    assert rc == 0 and out.splitlines()[-1] == "PASSED (2 done)"
    assert "a: echo 1" in out and "b: running (new)" in out
    rc, out, _ = cli(capsys, "plan", wf, "--run-dir", rd, "--set", "v=2")
    assert rc == 0 and "parameters changed" in out and "upstream changed" in out
    assert out.splitlines()[-1] == "PASSED (2 to run, 0 cached)"
    rc, out, _ = cli(capsys, "plan", wf, "--run-dir", rd, "--set", "v=2", "--json")
    assert json.loads(out) == [
        {"stage": "a", "type": f"{HELPERS}:EchoStage", "action": "run",
         "reason": "parameters changed: value"},
        {"stage": "b", "type": "seed", "action": "run", "reason": "upstream changed"},
    ]
    rc, out, _ = cli(capsys, "run", wf, "--run-dir", rd, "--progress", "rich")
    assert rc == 0 and out.splitlines()[-1] == "PASSED (2 cached)"
    rc, out, _ = cli(capsys, "run", wf, "--run-dir", rd, "--dry-run", "--force")
    assert rc == 0 and "forced" in out and out.splitlines()[-1] == "PASSED (dry run, 2 stage(s) would run)"


def test_default_run_dir_is_runs_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_workflow(tmp_path, OK)
    assert cli(capsys, "run", "wf.yaml")[0] == 0
    assert (tmp_path / "runs" / "ok" / "summary.json").exists()


def test_stage_failure_exit_1_with_traceback(tmp_path, capsys):
    wf = str(write_workflow(tmp_path, 'name: f\nstages:\n  x: {uses: "{HELPERS}:FailStage"}\n'))
    rc, out, err = cli(capsys, "run", wf, "--run-dir", str(tmp_path / "r"))
    assert rc == 1
    assert out.splitlines()[-1] == "FAILED: stage 'x' failed: RuntimeError: boom (1 failed)"
    assert "Traceback" in err and "RuntimeError: boom" in err


def test_user_error_in_stage_exit_2_traceback_only_in_debug(tmp_path, capsys):
    wf = str(
        write_workflow(tmp_path, 'name: f\nstages:\n  x: {uses: "{HELPERS}:FailStage", with: {user: true}}\n')
    )
    rc, out, err = cli(capsys, "run", wf, "--run-dir", str(tmp_path / "r"))
    assert rc == 2 and "Traceback" not in out + err
    assert out.splitlines()[-1] == "FAILED: stage 'x' failed: fail: device 'npu9' is not available (1 failed)"
    rc, out, err = cli(capsys, "--log-level", "debug", "run", wf, "--run-dir", str(tmp_path / "r"))
    assert rc == 2 and "Traceback" in err


def test_invalid_workflow_in_run_exit_2_lists_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_workflow(tmp_path, "name: f\nstages:\n  x: {uses: sede}\n  y: {uses: seed, needs: [z]}\n")
    rc, out, err = cli(capsys, "run", "wf.yaml")
    assert rc == 2 and "Traceback" not in err
    assert err.splitlines() == [
        "wf.yaml:3:13: stage 'x': unknown stage type 'sede' (did you mean 'seed'?)",
        "wf.yaml:4:27: stage 'y' needs unknown stage 'z' (known: x, y)",
    ]
    assert out.splitlines()[-1] == ("FAILED: 2 problem(s) in the workflow, first: wf.yaml:3:13: stage 'x': "
                                    "unknown stage type 'sede' (did you mean 'seed'?)")


def test_lock_held_exit_2(tmp_path, capsys):
    wf = str(write_workflow(tmp_path, OK))
    rd = tmp_path / "run"
    with RunDirLock(rd):
        rc, out, err = cli(capsys, "run", wf, "--run-dir", str(rd))
    assert rc == 2
    assert err.strip() == f"error: run dir {rd} is in use by another llmflow run (pid {os.getpid()})"


def test_keyboard_interrupt_exit_130(tmp_path, capsys, monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(llmflow.workflow, "run_workflow", interrupted)
    rc, out, err = cli(capsys, "run", str(write_workflow(tmp_path, OK)))
    assert rc == 130 and out.strip() == "FAILED: interrupted" and "Traceback" not in err


def test_stages_lists_types_and_errors(capsys):
    rc, out, _ = cli(capsys, "stages", "seed", f"{HELPERS}:NotAStage", "--json")
    info = json.loads(out)
    assert rc == 0
    assert info["seed"]["params"][0] == {
        "name": "seed",
        "type": "integer",
        "default": 1234,
        "required": False,
        "description": "Seed for random, numpy and torch (CPU, CUDA, NPU).",
    }
    assert "not a llmflow.stages.base.Stage subclass" in info[f"{HELPERS}:NotAStage"]["error"]
    rc, out, _ = cli(capsys, "stages")
    assert rc == 0 and "seed  Fix the random seed" in out


def test_schema_command_writes_and_checks(tmp_path, capsys, monkeypatch):
    from llmflow.workflow import schema as schema_mod

    monkeypatch.setattr(schema_mod, "generate", lambda: '{"x": 1}\n')
    out_file = tmp_path / "s.json"
    assert cli(capsys, "schema", "-o", str(out_file))[0] == 0
    assert out_file.read_text() == '{"x": 1}\n'
    assert cli(capsys, "schema", "-o", str(out_file), "--check")[0] == 0
    out_file.write_text("{}")
    rc, out, _ = cli(capsys, "schema", "-o", str(out_file), "--check")
    assert rc == 1 and "out of date" in out


def test_python_dash_m_entry_point(tmp_path):
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "llmflow.cli", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 0
    for name in ("run", "validate", "plan", "stages", "schema"):
        assert name in proc.stdout
    if (REPO / "llmflow" / "cli" / "compare.py").exists():
        assert "compare" in proc.stdout
    assert set(TOOLS) == {"run", "workflows", "validate", "plan", "stages", "schema", "compare", "inspect",
                          "precheck"}
    assert "inspect" in proc.stdout


@pytest.mark.parametrize("tool", ["run", "validate", "plan", "stages", "schema"])
def test_every_tool_has_the_contract(tool):
    import importlib

    mod = importlib.import_module(TOOLS[tool])
    assert mod.__doc__ and callable(mod.configure) and callable(mod.execute)


@pytest.mark.parametrize(("args", "last"), [
    (["compare", "golden", "target"],  # msit's paths given without -gp/-mp
     "FAILED: llmflow compare: the following arguments are required: -gp/--golden-path, -mp/--my-path"),
    (["compare", "-gp", "g", "-mp", "t", "--prefill-offset", "one"],
     "FAILED: llmflow compare: argument --prefill-offset: invalid int value: 'one'"),
    (["run", "hello", "--set"], "FAILED: llmflow run: argument --set: expected one argument"),
    (["bisect"], "FAILED: llmflow: argument COMMAND: invalid choice: 'bisect' (choose from "),
    ([], "FAILED: no command given"),
])
def test_a_usage_error_ends_with_a_failed_line_and_exit_2(tmp_path, args, last):
    proc = subprocess.run([sys.executable, "-m", "llmflow", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)}, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith(last)  # (the choices as this Python lists them)
    assert "Traceback" not in proc.stderr
    if args:  # argparse's own words stay on stderr, after the usage
        prog, _, message = last.removeprefix("FAILED: ").partition(": ")
        assert proc.stderr.startswith("usage: ") and f"{prog}: error: {message}" in proc.stderr
