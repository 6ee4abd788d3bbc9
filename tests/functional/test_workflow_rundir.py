"""The run directory, driven through the CLI as a user would: llmflow never follows a symlink it
finds where it creates, deletes or locks; a run dir that cannot be one is a one-line error (exit
2); files it writes honour the umask; env-check never reads a dump's env.json from outside it."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import assert_bad_input, llmflow, write_workflow  # noqa: E402

OK = """
    name: ok
    stages:
      a: {uses: "{HELPERS}:EchoStage", with: {value: 1}}
      b: {uses: "{HELPERS}:FailStage", needs: [a], with: {unless_file: "{MARK}"}}
"""


def _workflow(tmp_path: Path) -> Path:
    return write_workflow(tmp_path, OK.replace("{MARK}", str(tmp_path / "b-may-pass")))


@pytest.fixture
def completed(tmp_path):
    """A workflow, its run dir after one run (stage b failed: .failed/b exists) and a victim
    directory of someone else's files."""
    wf = _workflow(tmp_path)
    rd = tmp_path / "run"
    assert llmflow("run", str(wf), "--run-dir", str(rd)).returncode == 1
    victim = tmp_path / "victim"
    (victim / "b").mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    (victim / "b" / "also.txt").write_text("keep me too")
    return wf, rd, victim


def _victim_intact(victim: Path) -> None:
    assert (victim / "precious.txt").read_text() == "keep me"
    assert (victim / "b" / "also.txt").read_text() == "keep me too"


@pytest.mark.parametrize("name", [".tmp", ".failed", "a", "b"])
@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_linked_dir_in_the_run_dir_is_refused(completed, name, command):
    wf, rd, victim = completed
    (rd / "b-may-pass").touch()
    target = rd / name
    if target.exists():
        os.rename(target, rd.parent / f"moved-{name}")
    target.symlink_to(victim, target_is_directory=True)
    proc = llmflow(command, str(wf), "--run-dir", str(rd))
    assert_bad_input(proc, str(target), "symbolic link")
    _victim_intact(victim)
    assert sorted(p.name for p in victim.iterdir()) == ["b", "precious.txt"]


def test_a_linked_lock_file_is_refused_not_truncated(completed):
    wf, rd, victim = completed
    (rd / ".lock").unlink()
    (rd / ".lock").symlink_to(victim / "precious.txt")
    assert_bad_input(llmflow("run", str(wf), "--run-dir", str(rd)), str(rd / ".lock"), "symbolic link")
    _victim_intact(victim)


@pytest.mark.parametrize(("name", "make"), [(".tmp", "file"), (".failed", "file"), ("summary.json", "dir")])
def test_a_run_dir_entry_of_the_wrong_kind_is_refused(completed, name, make):
    wf, rd, _ = completed
    path = rd / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.mkdir() if make == "dir" else path.write_text("not llmflow's")
    assert_bad_input(llmflow("run", str(wf), "--run-dir", str(rd)), str(path), "not a ")


def test_links_inside_tmp_are_removed_not_followed(completed):
    wf, rd, victim = completed
    (rd / ".tmp").mkdir(exist_ok=True)
    (rd / ".tmp" / "a-1234").symlink_to(victim, target_is_directory=True)
    (rd / ".tmp" / "loose").symlink_to(victim / "precious.txt")
    proc = llmflow("run", str(wf), "--run-dir", str(rd))
    assert proc.returncode == 1  # b still fails, as before
    assert list((rd / ".tmp").iterdir()) == []
    _victim_intact(victim)


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("file", "not a directory"),
        ("under-file", "Not a directory"),
        ("/proc/llmflow-run", "cannot create it"),
        ("/proc", "is not an llmflow run dir"),
    ],
)
def test_a_run_dir_that_cannot_be_one(tmp_path, where, says):
    wf = _workflow(tmp_path)
    (tmp_path / "file").write_text("a file")
    rd = {"file": tmp_path / "file", "under-file": tmp_path / "file" / "run"}.get(where, Path(where))
    last = assert_bad_input(llmflow("run", str(wf), "--run-dir", str(rd)), str(rd), says)
    assert last.startswith("FAILED: run dir ")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_an_unwritable_run_dir(tmp_path):
    wf = _workflow(tmp_path)
    rd = tmp_path / "ro"
    rd.mkdir()
    rd.chmod(0o555)
    try:
        assert_bad_input(llmflow("run", str(wf), "--run-dir", str(rd)), str(rd), "Permission denied")
    finally:
        rd.chmod(0o755)


@pytest.mark.parametrize(("umask", "mode"), [(0o077, 0o600), (0o022, 0o644)])
def test_written_files_honour_the_umask(tmp_path, umask, mode):
    wf = _workflow(tmp_path)
    (tmp_path / "b-may-pass").touch()
    rd = tmp_path / "run"
    proc = llmflow("run", str(wf), "--run-dir", str(rd), umask=umask)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for path in (rd / "summary.json", rd / "a" / ".llmflow-stage.json", rd / "b" / ".llmflow-stage.json"):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path


def _fake_dump(path: Path, env_json: Path | None) -> None:
    path.mkdir(parents=True)
    (path / "llmflow_dump.json").write_text(json.dumps({"format": "llmflow-dump", "version": 3,
                                                        "complete": True}))
    if env_json is not None:
        (path / "env.json").symlink_to(env_json)


def test_env_check_refuses_an_env_json_linked_out_of_the_dump(tmp_path):
    secret = tmp_path / "elsewhere" / "secrets.json"
    secret.parent.mkdir()
    secret.write_text(json.dumps({"versions": {"api": "s3cr3t-value"}}))
    inside = tmp_path / "golden" / "env-real.json"
    _fake_dump(tmp_path / "golden", None)
    inside.write_text(json.dumps({"versions": {"api": "public"}}))
    (tmp_path / "golden" / "env.json").symlink_to(inside)  # a link inside the dump is fine
    _fake_dump(tmp_path / "target", secret)
    wf = write_workflow(tmp_path, """
        name: envs
        stages:
          env: {uses: env-check, with: {golden: golden, target: target}}
    """)
    rd = tmp_path / "run"
    proc = llmflow("run", str(wf), "--run-dir", str(rd))
    assert_bad_input(proc, str(tmp_path / "target" / "env.json"), "outside the dump")
    leaked = [p for p in rd.rglob("*") if p.is_file() and "s3cr3t" in p.read_text(errors="replace")]
    assert leaked == []
    # the same dumps with the link gone compare fine
    (tmp_path / "target" / "env.json").unlink()
    (tmp_path / "target" / "env.json").write_text(json.dumps({"versions": {"api": "other"}}))
    proc = llmflow("run", str(wf), "--run-dir", str(rd))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((rd / "env" / "env_diff.json").read_text())
    items = [(i["key"], i["golden"], i["target"]) for i in report["items"]]
    assert items == [("versions.api", "public", "other")]
