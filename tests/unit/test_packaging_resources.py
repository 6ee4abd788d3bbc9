"""The shipped workflows by name, from any directory: llmflow.resources and the CLI commands that take
a WORKFLOW (run, plan, validate), plus `llmflow workflows`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

from llmflow.errors import UserError
from llmflow.resources import (
    is_bare_name,
    plugins_dir,
    resolve_workflow,
    schemas_dir,
    shipped_root,
    shipped_workflows,
    workflows_dir,
)

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
    return subprocess.run([sys.executable, "-m", "llmflow.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_in_a_checkout_the_shipped_folders_are_the_top_level_ones():
    assert shipped_root() == REPO
    assert workflows_dir() == REPO / "workflows"
    assert (workflows_dir() / "recipes" / "bisect_base.yaml").is_file()
    assert (plugins_dir() / "example_faults.py").is_file()
    assert (schemas_dir() / "workflow.schema.json").is_file()


def test_shipped_workflows_are_every_top_level_yaml_with_its_description():
    found = shipped_workflows()
    assert [w.name for w in found] == sorted(p.stem for p in (REPO / "workflows").glob("*.yaml"))
    assert {"llama2_bisect", "hello", "compare_dumps"} <= {w.name for w in found}
    assert "bisect_base" not in {w.name for w in found}  # a recipe is extended, not run
    hello = next(w for w in found if w.name == "hello")
    assert hello.path == REPO / "workflows" / "hello.yaml" and "smoke test" in hello.description


@pytest.mark.parametrize(("arg", "bare"), [("llama2_bisect", True), ("hello", True), ("hello.yaml", False),
                                           ("workflows/hello", False), ("./hello", False),
                                           ("my.flow.yml", False)])
def test_bare_names(arg, bare):
    assert is_bare_name(arg) is bare


def test_resolution_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_workflow("llama2_bisect") == str(REPO / "workflows" / "llama2_bisect.yaml")
    assert resolve_workflow("workflows/llama2_bisect.yaml") == str(REPO / "workflows" / "llama2_bisect.yaml")
    assert resolve_workflow("workflows/recipes/bisect_base.yaml") == str(
        REPO / "workflows" / "recipes" / "bisect_base.yaml")
    # a local file wins over the shipped one of the same name, bare or not
    (tmp_path / "hello").write_text("name: mine\n")
    (tmp_path / "workflows").mkdir()
    (tmp_path / "workflows" / "hello.yaml").write_text("name: mine\n")
    assert resolve_workflow("hello") == "hello"
    assert resolve_workflow("workflows/hello.yaml") == "workflows/hello.yaml"
    # anything else is left for the loader to report as a missing file
    for arg in ("nope.yaml", "workflows/nope.yaml", "../workflows/hello.yaml", str(tmp_path / "x.yaml")):
        assert resolve_workflow(arg) == arg


def test_an_unknown_bare_name_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"'llama_bisect': no such file here.*shipped: .*llama2_bisect"):
        resolve_workflow("llama_bisect")


def test_run_plan_validate_take_a_bare_name_from_any_directory(tmp_path):
    done = _cli("validate", "llama2_bisect", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("PASSED")
    done = _cli("plan", "workflows/llama2_bisect.yaml", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [i["stage"] for i in json.loads(done.stdout)][:3] == ["seed", "dump-golden", "dump-npu"]
    done = _cli("run", "hello", "--set", "seed=7", "--progress", "plain", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("PASSED")
    summary = json.loads((tmp_path / "runs" / "hello" / "summary.json").read_text())
    assert summary["status"] == "passed"


def test_an_unknown_name_is_one_line_and_exit_2(tmp_path):
    for command in ("run", "plan", "validate"):
        done = _cli(command, "no_such_flow", cwd=tmp_path)
        assert done.returncode == 2, done.stdout + done.stderr
        errors = done.stderr.strip().splitlines()
        assert len(errors) == 1 and "no_such_flow" in errors[0] and "llama2_bisect" in errors[0], errors
        assert done.stdout.strip().splitlines()[-1].startswith("FAILED")
    assert not (tmp_path / "runs").exists()


def test_workflows_command_lists_names_and_descriptions(tmp_path):
    done = _cli("workflows", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for w in shipped_workflows():
        assert w.name in done.stdout
    assert done.stdout.strip().splitlines()[-1] == f"PASSED ({len(shipped_workflows())} shipped workflow(s))"
    listed = json.loads(_cli("workflows", "--json", cwd=tmp_path).stdout)
    assert {w["name"]: Path(w["path"]) for w in listed} == {w.name: w.path for w in shipped_workflows()}
    assert _cli("workflows", "--path", cwd=tmp_path).stdout.strip() == str(REPO / "workflows")
