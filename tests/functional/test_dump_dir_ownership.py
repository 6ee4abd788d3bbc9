"""The dump stage's ``dump_dir`` is a folder of its own, driven through the CLI as a user would:
a new or empty folder, or the dump this stage wrote there before (a rerun), may be (re)written;
a folder holding the user's files or a dump a script or another run wrote is refused (exit 2,
one line naming the folder and what is in the way) and left byte for byte as it was. A dump
script (``register_hook``) still replaces its own earlier dump in its ``dump_path`` (as msit
does) but never a file at a dump's names that no llmflow dump wrote."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO, assert_bad_input, llmflow  # noqa: E402

from llmflow.formats.llmflow_dump import LlmflowDumpReader  # noqa: E402

TINY = "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64,seed=1"
# a user's dump script: the tiny model, hooked msit's way into the dump_path it is given
SCRIPT = textwrap.dedent(f"""
    import sys, torch
    from llmflow import DumpConfig, register_hook
    from llmflow.models import load_model
    loaded = load_model("{TINY}")
    register_hook(loaded.model, DumpConfig(dump_path=sys.argv[1]))
    loaded.model.generate(torch.tensor([[256, 104, 105]]), max_new_tokens=2, do_sample=False,
                          pad_token_id=0)
""")


def hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path (folders as "dir")."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def workflow(tmp_path: Path) -> Path:
    """A dump stage writing to ``--set out=...``, and an overflow scan of its dump."""
    wf = tmp_path / "dumpout.yaml"
    wf.write_text(json.dumps({"name": "dumpout", "params": {"out": {"type": "string", "format": "path"}},
                              "stages": {
        "dump": {"uses": "dump", "with": {"model": TINY, "prompt": "hi", "max_new_tokens": 2,
                                          "mode": "module", "token_range": "all",
                                          "dump_dir": "${params.out}"}},
        "overflow": {"uses": "overflow-scan", "needs": ["dump"],
                     "with": {"dump": "${stages.dump.outputs.dump_dir}"}},
    }}))
    return wf


def run(tmp_path: Path, out: Path, run_dir: str, *more: str) -> subprocess.CompletedProcess:
    return llmflow("run", str(workflow(tmp_path)), "--run-dir", str(tmp_path / run_dir),
                   "--set", f"out={out}", *more, cwd=tmp_path, timeout=300)


def script(tmp_path: Path, dump_path: Path, rank: int = 0, world: int = 1) -> subprocess.CompletedProcess:
    """Run the user's dump script as rank ``rank`` of ``world``."""
    path = tmp_path / "dump_script.py"
    path.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO), "RANK": str(rank), "WORLD_SIZE": str(world)}
    return subprocess.run([sys.executable, str(path), str(dump_path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)


def test_a_dump_dir_holding_the_users_files_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "env.json").write_text('{"mine": 1}\n')
    (out / "topology.json").write_text("my topology notes\n")
    (out / "llmflow_dump.json").write_text('{"my": "manifest"}\n')
    before = hashes(out)
    proc = run(tmp_path, out, "run")
    assert_bad_input(proc, f"dump_dir {out}", "env.json", "not written by an llmflow dump")
    assert hashes(out) == before


def test_a_dump_dir_holding_a_scripts_dump_is_refused_and_left_alone(tmp_path):
    """A dump of two ranks made by the user's register_hook script: not the stage's to replace
    (the stage would have rewritten rank0 beside the old rank1)."""
    for rank in (0, 1):
        done = script(tmp_path, tmp_path / "scripted", rank, 2)
        assert done.returncode == 0, done.stderr[-2000:]
    dump = tmp_path / "scripted" / "llmflow_dump"
    assert (dump / "rank0" / "rank.json").is_file() and (dump / "rank1" / "rank.json").is_file()
    before = hashes(dump)
    proc = run(tmp_path, dump, "run")
    assert_bad_input(proc, f"dump_dir {dump}", "llmflow dump this stage did not write")
    assert hashes(dump) == before


@pytest.fixture(scope="module")
def _first_run_saved(tmp_path_factory) -> tuple[Path, Path]:
    """The workflow run once (``--run-dir run``) with its dump into ``external``, an empty folder
    it was given: the folder it ran in, and a copy of that folder as the run left it."""
    base = tmp_path_factory.mktemp("first_run")
    work = base / "work"
    out = work / "external"
    out.mkdir(parents=True)  # an empty folder is free
    first = run(work, out, "run")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    shutil.copytree(work, base / "saved", symlinks=True)
    return work, base / "saved"


@pytest.fixture
def first_run(_first_run_saved) -> Path:
    """The folder of the workflow's first run (see ``_first_run_saved``), put back as that run
    left it, at the same path: the run dir and the dump's owner mark name it, and a copy keeps each
    file's size and mtime, all the run's cache records of them."""
    work, saved = _first_run_saved
    shutil.rmtree(work)
    shutil.copytree(saved, work, symlinks=True)
    return work


def test_the_stage_rewrites_its_own_dump_and_no_other_run_may(first_run):
    work = first_run
    out = work / "external"  # the first run's dump_dir, an empty folder before it
    (out / "notes.txt").write_text("the user's notes beside the dump\n")
    rerun = run(work, out, "run", "--force")  # the same stage of the same run dir: its own dump
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert (out / "notes.txt").read_text() == "the user's notes beside the dump\n"
    reader = LlmflowDumpReader(out)
    assert reader.meta()["complete"] and reader.problems() == [] and reader.steps() == [0, 1]
    before = hashes(out)
    other = run(work, out, "other-run")
    assert_bad_input(other, f"dump_dir {out}", str(work / "run"))
    assert hashes(out) == before


def test_a_dump_script_replaces_its_own_dump_but_not_the_users_files(tmp_path):
    """register_hook's documented behaviour stays: a new dump into the dump_path replaces the
    earlier llmflow dump there. A user's env.json where no llmflow dump is, is refused."""
    first = script(tmp_path, tmp_path / "out")
    assert first.returncode == 0, first.stderr[-2000:]
    again = script(tmp_path, tmp_path / "out")
    assert again.returncode == 0, again.stderr[-2000:]
    assert LlmflowDumpReader(tmp_path / "out" / "llmflow_dump").problems() == []

    users = tmp_path / "users" / "llmflow_dump"
    users.mkdir(parents=True)
    (users / "env.json").write_text('{"my": "environment"}\n')
    refused = script(tmp_path, tmp_path / "users")
    assert refused.returncode != 0
    assert f"{users / 'env.json'}: not written by an llmflow dump" in refused.stderr
    assert hashes(users) == {"env.json": hashlib.sha256(b'{"my": "environment"}\n').hexdigest()}


def test_a_dump_deleted_from_its_dump_dir_is_dumped_again_not_taken_from_the_cache(first_run):
    """The dump stage's result rests on the dump it wrote outside the run dir: a rank folder
    removed there (a clean-up, a disk quota) makes the stage run again, never a cached PASS over a
    dump that is no longer there."""
    work = first_run
    out = work / "external"  # the first run's dump_dir
    shutil.rmtree(out / "rank0")
    again = run(work, out, "run")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"dump: running (outputs changed on disk ({out} is gone" in again.stdout or \
        f"dump: running (outputs changed on disk ({out} was modified" in again.stdout, again.stdout
    assert (out / "rank0" / "index.jsonl").is_file() and not LlmflowDumpReader(out).problems()
    cached = run(work, out, "run")
    assert "dump: cached" in cached.stdout, cached.stdout
