"""Progress reporters, the example plugin stage, shipped workflows, ${env.X} at run time."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

from llmflow.workflow import run_workflow, validate_workflow
from llmflow.workflow.marks import WorkflowError
from llmflow.workflow.progress import PlainReporter, RichReporter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO, write_workflow  # noqa: E402


def test_plain_reporter_lines_and_quarter_progress():
    buf = io.StringIO()
    rep = PlainReporter(buf)
    rep.status("a", "running", "new")
    task = rep.task("a", "hashing", 8)
    for _ in range(8):
        task.advance()
    rep.log("a", "hello")
    lines = [line.split("] ", 1)[1] for line in buf.getvalue().splitlines()]
    assert lines == [
        "a: running (new)",
        "a: hashing: 2/8",
        "a: hashing: 4/8",
        "a: hashing: 6/8",
        "a: hashing: 8/8",
        "a: hello",
    ]


def test_rich_reporter_renders_stages_and_bars(tmp_path):
    buf = io.StringIO()
    rep = RichReporter(Console(file=buf, force_terminal=True, width=100))
    wf = write_workflow(
        tmp_path,
        """
        name: r
        stages:
          a: {uses: "{HELPERS}:EchoStage", with: {value: 1, count: 4}}
    """,
    )
    assert run_workflow(wf, run_dir=tmp_path / "run", reporter=rep).status == "passed"
    text = buf.getvalue()
    assert "a: echo" in text and "4/4" in text and "done" in text


def test_example_plugin_workflow(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "x.py").write_text("print(1)\n")
    (data / "sub" / "y.py").write_text("")
    res = run_workflow(
        REPO / "plugins" / "example_stage_workflow.yaml",
        run_dir=tmp_path / "run",
        set_params={"dir": str(data), "pattern": "**/*.py"},
    )
    assert res.status == "passed"
    out = res.stages["sums"].outputs
    assert out["files"] == 2 and out["bytes"] == 9
    manifest = json.loads(Path(out["manifest_file"]).read_text())
    assert (
        manifest["sub/y.py"]["sha256"] == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
    assert res.summary["checksum"]["files"] == 2
    res = run_workflow(
        REPO / "plugins" / "example_stage_workflow.yaml",
        run_dir=tmp_path / "run2",
        set_params={"dir": str(tmp_path / "nope")},
    )
    assert res.exit_code == 2 and "no such directory" in res.stages["sums"].error


SHIPPED = sorted((REPO / "workflows").rglob("*.yaml")) + sorted((REPO / "plugins").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_workflows_validate(path):
    assert [str(e) for e in validate_workflow(path)] == []


def test_hello_runs(tmp_path):
    res = run_workflow(REPO / "workflows" / "hello.yaml", run_dir=tmp_path / "run", set_params=["seed=7"])
    assert res.status == "passed"
    assert res.stages["reseed"].outputs["settings"]["seed"] == 7


def test_env_references_at_run_time(tmp_path, monkeypatch):
    wf = write_workflow(
        tmp_path,
        """
        name: e
        stages:
          a: {uses: "{HELPERS}:EchoStage", with: {value: "${env.ENGINE_TEST_X:-dflt}/${env.ENGINE_TEST_Y}"}}
    """,
    )
    monkeypatch.setenv("ENGINE_TEST_Y", "y")
    monkeypatch.delenv("ENGINE_TEST_X", raising=False)
    assert run_workflow(wf, run_dir=tmp_path / "r").stages["a"].outputs["value"] == "dflt/y"
    monkeypatch.delenv("ENGINE_TEST_Y")
    assert validate_workflow(wf) == []  # unset env is a run-time matter
    with pytest.raises(WorkflowError, match=r"wf.yaml:3:\d+: \$\{env.ENGINE_TEST_Y\}: environment variable "
                                            "'ENGINE_TEST_Y' is not set"):
        run_workflow(wf, run_dir=tmp_path / "r")  # (before any stage runs)


def test_an_unset_env_reference_of_a_later_stage_stops_the_run_before_the_first(tmp_path, monkeypatch):
    """Found before stage a runs (a golden dump of hours), not when stage b starts after it."""
    wf = write_workflow(
        tmp_path,
        """
        name: e
        stages:
          a: {uses: "{HELPERS}:EchoStage", with: {value: 1}}
          b: {uses: "{HELPERS}:EchoStage", needs: [a], with: {value: "${env.ENGINE_TEST_Z}"}}
    """,
    )
    monkeypatch.delenv("ENGINE_TEST_Z", raising=False)
    with pytest.raises(WorkflowError, match="'ENGINE_TEST_Z' is not set"):
        run_workflow(wf, run_dir=tmp_path / "r")
    assert not (tmp_path / "r" / "a").exists()
    # a run of stage a alone (--only a) needs no variable of b's
    assert run_workflow(wf, run_dir=tmp_path / "r", only=["a"]).stages["a"].status == "done"


def test_escape_and_path_outputs(tmp_path):
    wf = write_workflow(
        tmp_path,
        """
        name: esc
        stages:
          a: {uses: "{HELPERS}:EchoStage", with: {value: "$${params.not_a_ref} and $$ alone"}}
    """,
    )
    res = run_workflow(wf, run_dir=tmp_path / "r")
    assert res.stages["a"].outputs["value"] == "${params.not_a_ref} and $$ alone"


def test_rewrite_paths_and_fingerprint_stability():
    from llmflow.workflow.state import fingerprint, rewrite_paths

    out = rewrite_paths(
        {"a": Path("/r/.tmp/x-1/f"), "b": ["/r/.tmp/x-1", "/r/.tmp/x-10/g", 3]}, "/r/.tmp/x-1", "/r/x"
    )
    assert out == {"a": "/r/x/f", "b": ["/r/x", "/r/.tmp/x-10/g", 3]}
    fp = fingerprint("echo@1", {"b": 1, "a": [1, 2]}, {"up": "f0"})
    assert fp == fingerprint("echo@1", {"a": [1, 2], "b": 1}, {"up": "f0"})  # key order does not matter
    assert fp != fingerprint("echo@2", {"a": [1, 2], "b": 1}, {"up": "f0"})
    assert fp != fingerprint("echo@1", {"a": [1, 2], "b": 1}, {"up": "f1"})
