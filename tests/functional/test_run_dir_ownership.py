"""Which folders ``llmflow run --run-dir`` takes as its own, driven through the CLI as a user would:
a folder of the user's files that happens to hold a stage folder copied out of an old run is not
a run dir (refused, exit 2, nothing touched); a run dir of an earlier llmflow (no mark) still is;
and inside a run dir llmflow empties ``.tmp`` of its own tmp dirs only."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import assert_bad_input, llmflow, write_workflow  # noqa: E402

ECHO = """
    name: echo
    stages:
      a: {uses: "{HELPERS}:EchoStage", with: {value: 1}}
      b: {uses: "{HELPERS}:EchoStage", needs: [a], with: {value: 2}}
"""


def _hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path (folders by name)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def old_run(tmp_path: Path) -> tuple[Path, Path]:
    """The workflow and a completed run dir of it (stages a and b)."""
    wf = write_workflow(tmp_path / "wf", ECHO)
    ref = tmp_path / "ref"
    proc = llmflow("run", str(wf), "--run-dir", str(ref))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return wf, ref


def _users_folder(home: Path, ref: Path, copied_as: str) -> None:
    """A folder of the user's: their own summary.json, .tmp and .failed files, and stage a's
    folder copied out of an old run as ``copied_as``."""
    (home / ".tmp").mkdir(parents=True)
    (home / ".failed" / "a").mkdir(parents=True)
    (home / "summary.json").write_text('{"my": "results"}')
    (home / ".tmp" / "userfile").write_text("u")
    (home / ".failed" / "a" / "keep.txt").write_text("v")
    shutil.copytree(ref / "a", home / copied_as)


@pytest.mark.parametrize("copied_as", ["golden_from_january", "a"])
def test_a_folder_holding_a_copied_stage_folder_is_not_taken_over(old_run, tmp_path, copied_as):
    wf, ref = old_run
    home = tmp_path / "home"
    _users_folder(home, ref, copied_as)
    before = _hashes(home)
    proc = llmflow("run", str(wf), "--run-dir", str(home))
    assert_bad_input(proc, str(home), "is not an llmflow run dir", "--adopt-run-dir")
    assert _hashes(home) == before
    assert not (home / ".llmflow-run-dir").exists()


def test_a_stage_folder_named_for_another_stage_is_no_proof(old_run, tmp_path):
    """Even beside llmflow's own summary.json: the copy names stage a, its folder does not."""
    wf, ref = old_run
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy2(ref / "summary.json", home / "summary.json")
    shutil.copytree(ref / "a", home / "golden_from_january")
    before = _hashes(home)
    assert_bad_input(llmflow("run", str(wf), "--run-dir", str(home)), "is not an llmflow run dir")
    assert _hashes(home) == before


def test_a_run_dir_of_an_earlier_llmflow_is_still_one(old_run):
    """No mark, an interrupted stage's tmp dir left in .tmp: recognised, cached, the tmp dir gone."""
    wf, ref = old_run
    (ref / ".llmflow-run-dir").unlink()
    (ref / ".tmp" / "b-0123abcd").mkdir(parents=True)
    (ref / ".tmp" / "b-0123abcd" / "partial.bin").write_text("x")
    proc = llmflow("run", str(wf), "--run-dir", str(ref))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("PASSED (2 cached)"), proc.stdout
    assert (ref / ".llmflow-run-dir").is_file()
    assert os.listdir(ref / ".tmp") == []


def test_an_unmarked_folder_with_foreign_files_in_tmp_is_not_an_earlier_run_dir(old_run):
    wf, ref = old_run
    (ref / ".llmflow-run-dir").unlink()
    (ref / ".tmp" / "userfile").write_text("u")
    assert_bad_input(llmflow("run", str(wf), "--run-dir", str(ref)), "is not an llmflow run dir")
    assert (ref / ".tmp" / "userfile").read_text() == "u"
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["status"] == "passed"


def test_a_users_file_in_tmp_of_a_run_dir_stays(old_run):
    """llmflow's leftover tmp dirs go; a file it did not write (not named like them) stays."""
    wf, ref = old_run
    (ref / ".tmp" / "a-deadbeef").mkdir()
    (ref / ".tmp" / "notes.txt").write_text("mine")
    (ref / ".tmp" / "mine").mkdir()
    (ref / ".tmp" / "mine" / "keep.txt").write_text("mine too")
    proc = llmflow("run", str(wf), "--run-dir", str(ref), "--force")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(ref / ".tmp")) == ["mine", "notes.txt"]
    assert (ref / ".tmp" / "notes.txt").read_text() == "mine"
    assert (ref / ".tmp" / "mine" / "keep.txt").read_text() == "mine too"
