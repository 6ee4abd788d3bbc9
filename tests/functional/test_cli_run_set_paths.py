"""A relative path given with ``--set`` to a shipped workflow run by name, as a user types it in
the folder holding the files: it names the file in the current directory (the shipped workflow
lies inside the package, where such a path never points), and one that is not there is reported
there; a path relative to the workflow file, as the README's ``--set target_patch=../plugins/...``
is, still works."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_helpers import as_dump  # noqa: E402
from workflow_helpers import REPO, assert_bad_input, llmflow  # noqa: E402

from llmflow.workflow.validate import path_from_current_dir  # noqa: E402

TINY = "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"


def test_compare_dumps_by_name_reads_dumps_named_relative_to_the_current_directory(tmp_path):
    as_dump(tmp_path, "gpu_dump")
    as_dump(tmp_path, "npu_dump", noise=1e-3)
    proc = llmflow("run", "compare_dumps", "--set", "golden_dump=gpu_dump", "--set", "target_dump=./npu_dump",
                   "--run-dir", "cmp", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED")
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["params"]["golden_dump"] == str(tmp_path / "gpu_dump")
    assert summary["params"]["target_dump"] == str(tmp_path / "npu_dump")
    assert summary["stages"]["compare"]["status"] == "done"


def test_a_missing_dump_is_bad_input_naming_it(tmp_path):
    proc = llmflow("run", "compare_dumps", "--set", "golden_dump=gpu_dump", "--set", "target_dump=npu_dump",
                   "--run-dir", "cmp", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED: ") and "gpu_dump" in last and "Traceback" not in proc.stderr


def test_a_missing_dump_is_named_where_the_user_meant_it(tmp_path):
    """Not found in the current directory nor beside the shipped workflow: the message names the
    current directory's path, the one the user typed, not one inside the package."""
    as_dump(tmp_path, "npu_dump")
    proc = llmflow("run", "compare_dumps", "--set", "golden_dump=nope", "--set", "target_dump=npu_dump",
                   "--run-dir", "cmp", cwd=tmp_path)
    last = assert_bad_input(proc, f"{tmp_path / 'nope'}: no such dump")
    assert "workflows" not in last, last
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["params"]["golden_dump"] == str(tmp_path / "nope")


def test_a_missing_path_in_a_subfolder_is_named_where_the_user_meant_it(tmp_path):
    (tmp_path / "dumps").mkdir()
    as_dump(tmp_path / "dumps", "npu_dump")
    proc = llmflow("run", "compare_dumps", "--set", "golden_dump=dumps/gpu_dump",
                   "--set", "target_dump=dumps/npu_dump", "--run-dir", "cmp", cwd=tmp_path)
    assert_bad_input(proc, f"{tmp_path / 'dumps' / 'gpu_dump'}: no such dump")


def test_badcase_reads_the_prompts_file_the_workflow_header_shows(tmp_path):
    """``--set prompts=my_prompts.jsonl`` (badcase_bisect.yaml's header) ranks that file's prompts."""
    (tmp_path / "my_prompts.jsonl").write_text('{"prompt": "first of mine"}\n{"prompt": "second of mine"}\n')
    proc = llmflow("run", "badcase_bisect", "--only", "badcase", "--run-dir", "run",
                   "--set", f"golden_model={TINY}", "--set", f"target_model={TINY}",
                   "--set", "badcase_tokens=2", "--set", "prompts=my_prompts.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranking = json.loads((tmp_path / "run" / "badcase" / "ranking.json").read_text())
    assert sorted(row["prompt"] for row in ranking) == ["first of mine", "second of mine"]


def test_a_patch_relative_to_the_users_workflow_file_still_loads(tmp_path):
    """The workflow in a folder of its own, its patch beside it named from there (``../``)."""
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "mark.py").write_text(
        "def halve_lm_head(model):\n    model.lm_head.weight.data.mul_(0.5)\n")
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "dump.yaml").write_text(json.dumps({
        "name": "patched-dump",
        "params": {"patch": {"type": "string", "format": "path", "default": ""}},
        "stages": {"dump": {"uses": "dump", "with": {"model": TINY, "prompt": "hi", "max_new_tokens": 1,
                                                     "patch": "${params.patch}"}}},
    }))
    work = tmp_path / "deep" / "work"  # where ../patches names nothing
    work.mkdir(parents=True)
    proc = llmflow("run", "../../flows/dump.yaml", "--run-dir", "run",
                   "--set", "patch=../patches/mark.py:halve_lm_head", cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["params"]["patch"] == "../patches/mark.py:halve_lm_head"  # kept as typed


@pytest.mark.parametrize("value", ["smollm2", "tiny-llama:layers=2", "atb-llama", "", "/abs/path",
                                   "atb-lama", "smolm2"])
def test_names_and_absolute_paths_are_kept_as_typed(tmp_path, monkeypatch, value):
    """A name, or a typo of one (the stage's message suggests the name), is no path."""
    monkeypatch.chdir(tmp_path)
    assert path_from_current_dir(value, tmp_path / "flows") == value


def test_a_file_reference_in_the_current_directory_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "faults.py").write_text("def f(model):\n    pass\n")
    assert path_from_current_dir("faults.py:f", tmp_path / "flows") == f"{tmp_path}/faults.py:f"


def test_a_path_only_the_workflow_directory_holds_is_kept_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "faults.py").write_text("def f(model):\n    pass\n")
    assert path_from_current_dir("faults.py:f", tmp_path / "flows") == "faults.py:f"


@pytest.mark.parametrize("value", ["nope", "other.py:f", "dumps/gpu_dump", "llama2"])
def test_a_path_found_nowhere_is_read_from_the_current_directory(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    assert path_from_current_dir(value, tmp_path / "flows") == f"{tmp_path}/{value}"


def test_a_missing_patch_is_bad_input_before_the_golden_dump_runs(tmp_path):
    """A ``file.py:callable`` param is checked before the run: a target patch that names no file
    fails before the golden dump (hours on a real model) runs; other paths may be a stage's output
    (a dump_dir), so their stages say what is missing."""
    proc = llmflow("run", "llama2_bisect", "--set", f"golden_model={TINY}", "--set", f"target_model={TINY}",
                   "--set", "target_patch=nofile.py:f", "--run-dir", "run", cwd=tmp_path)
    assert_bad_input(proc, f"param target_patch: no such file {tmp_path / 'nofile.py'}")
    assert not (tmp_path / "run").exists()
    # validate checks a recipe where its files need not be (they are where it runs)
    proc = llmflow("validate", "llama2_bisect", "--set", "target_patch=nofile.py:f", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(("source", "ref", "says"), [
    ("def scale_layer_2(model):\n    pass\n", "scale_layer2",
     "port.py defines no 'scale_layer2' (did you mean 'scale_layer_2'?)"),
    ("def a(model):\n    pass\n", "nothing_like_it",
     "port.py defines no 'nothing_like_it' (its functions: a)"),
    ("def a(model:\n", "a", "port.py does not parse: line 1"),
])
def test_a_patch_file_without_the_callable_is_bad_input_before_the_golden_dump_runs(tmp_path, source, ref,
                                                                                    says):
    """The file is read, not run: a misspelt callable or a file that does not parse fails before hours
    of golden dump, naming the nearest name or the file's functions."""
    (tmp_path / "port.py").write_text(source)
    proc = llmflow("run", "llama2_bisect", "--set", f"golden_model={TINY}", "--set", f"target_model={TINY}",
                   "--set", f"target_patch=port.py:{ref}", "--run-dir", "run", cwd=tmp_path)
    assert_bad_input(proc, f"param target_patch: {tmp_path / 'port.py'}:{ref}: {says}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("source", [
    "def __getattr__(name):\n    return lambda model: None\n",  # (as plugins/example_faults.py makes them)
    "from os.path import *\n",
    "globals()['made'] = lambda model: None\n",
    "if True:\n    made = lambda model: None\n",
    "from functools import partial as made\n",
    "try:\n    from functools import partial as made\nexcept ImportError:\n    pass\n",
    "try:\n    from os.path import *\nexcept ImportError:\n    pass\n",
])
def test_a_callable_made_at_import_is_left_to_the_import(tmp_path, source):
    from llmflow.plugins import file_ref_problem

    (tmp_path / "port.py").write_text(source)
    assert file_ref_problem(tmp_path / "port.py", "made") is None


def test_only_says_which_results_it_keeps_are_stale(tmp_path):
    """``--only bisect`` after a parameter the dumps depend on changed: the dumps' previous results
    are used as they are, and the run and the plan say they are stale and how to redo them."""
    sets = ["--set", f"golden_model={TINY}", "--set", f"target_model={TINY}", "--run-dir", "run"]
    first = llmflow("run", "llama2_bisect", *sets, "--set", "max_new_tokens=3", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    only = ["--set", "max_new_tokens=2", "--only", "bisect"]
    again = llmflow("run", "llama2_bisect", *sets, *only, cwd=tmp_path)
    stale = [ln for ln in again.stdout.splitlines() if "STALE (parameters changed: max_new_tokens)" in ln]
    assert {ln.split("] ")[-1].split(":")[0] for ln in stale} == {"dump-golden", "dump-npu"}, again.stdout
    assert all("run without --only to redo it" in ln for ln in stale)
    # the machine-readable record and the last line say so too: its params are not its results'
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["params"]["max_new_tokens"] == 2
    assert {sid for sid, st in summary["stages"].items() if st["stale"]} == {"dump-golden", "dump-npu"}
    assert summary["stages"]["dump-golden"]["stale"] == "parameters changed: max_new_tokens"
    last = again.stdout.strip().splitlines()[-1]
    assert last.startswith("PASSED (stale results used (--only: run without it to redo them): dump-golden, "
                           "dump-npu; "), last
    plan = llmflow("plan", "llama2_bisect", *sets, *only, cwd=tmp_path)
    assert "its result is stale" in plan.stdout, plan.stdout


def test_a_workflow_extending_the_shipped_recipe_from_elsewhere_plans(tmp_path):
    """The recipes README's way: my.yaml in a folder of the user's, extending llama2_bisect, whose
    target_model default names ../plugins/demo_bug.py beside the recipe: planned from that folder
    and from another alike."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my.yaml").write_text(f"name: my-bisect\nextends: {REPO / 'workflows' / 'llama2_bisect.yaml'}\n"
                                  "params:\n  max_new_tokens: {default: 4}\n", encoding="utf-8")
    for cwd in (mine, tmp_path):
        proc = llmflow("plan", str(mine / "my.yaml"), "--run-dir", str(tmp_path / "run"), cwd=cwd)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.strip().splitlines()[-1].startswith("PASSED"), proc.stdout
