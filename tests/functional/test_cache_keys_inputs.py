"""What a stage's cache key records of the files it reads, driven through the CLI as a user would:
a dump kept inside an adopted run dir is an input like one outside it (replaced, the stages that
read it run again), and the same command run from another directory reuses the cache (the same
dump reached by either spelling is the same input)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_helpers import as_dump  # noqa: E402
from workflow_helpers import REPO, llmflow  # noqa: E402

COMPARE_DUMPS = REPO / "workflows" / "compare_dumps.yaml"


def _stage_line(proc, stage: str) -> str:
    """What the reporter printed for ``stage`` (``align: cached``, ``align: running (...)``)."""
    found = re.findall(rf"{stage}: (cached|running.*)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    return found[0]


def _align(proc) -> str:
    return _stage_line(proc, "align")


def test_a_dump_replaced_inside_an_adopted_run_dir_is_compared_again(tmp_path):
    rd = tmp_path / "work"
    rd.mkdir()
    as_dump(rd, "g")
    as_dump(rd, "t")  # the same as the golden: passes
    args = ("run", "compare_dumps", "--set", f"golden_dump={rd / 'g'}", "--set", f"target_dump={rd / 't'}",
            "--run-dir", str(rd), "--adopt-run-dir")
    first = llmflow(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    shutil.rmtree(rd / "t")
    as_dump(rd, "t", noise=1.0)  # the real target: far from the golden
    again = llmflow(*args)
    assert _align(again) == f"running (input changed: {rd / 't'})", again.stdout
    assert again.returncode == 1, again.stdout + again.stderr
    assert again.stdout.strip().splitlines()[-1].startswith("FAILED"), again.stdout


def test_the_same_command_from_another_directory_reuses_the_cache(tmp_path):
    """Dumps beside the workflow file, named relative to it: found in the current directory when
    run from there, beside the workflow when run from elsewhere; the same files either way."""
    work = tmp_path / "work"
    work.mkdir()
    wf = work / "wf.yaml"
    shutil.copy(COMPARE_DUMPS, wf)
    as_dump(work, "g")
    as_dump(work, "t", noise=1e-3)
    args = ("run", str(wf), "--set", "golden_dump=g", "--set", "target_dump=t", "--run-dir", str(work / "rd"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    seen = []
    for cwd in (work, elsewhere, work, elsewhere):
        proc = llmflow(*args, cwd=cwd)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        seen.append(_align(proc))
    assert seen == ["running (new)", "cached", "cached", "cached"]


def test_folders_named_like_parameter_values_leave_the_cache_alone(tmp_path):
    """A folder named as a parameter's value (``cpu``, ``all``, ``local``) where the user runs from,
    or a value the stage enumerates (``executor: local``) beside the workflow, is not read as an
    input: the dumps compared before stay cached."""
    work = tmp_path / "work"
    work.mkdir()
    wf = work / "wf.yaml"
    shutil.copy(COMPARE_DUMPS, wf)
    as_dump(work, "g")
    as_dump(work, "t", noise=1e-3)
    here = tmp_path / "here"
    here.mkdir()
    args = ("run", str(wf), "--set", f"golden_dump={work / 'g'}", "--set", f"target_dump={work / 't'}",
            "--run-dir", str(work / "rd"))
    first = llmflow(*args, cwd=here)
    assert first.returncode == 0, first.stdout + first.stderr
    for word in ("cpu", "all", "auto", "local", "logits", "module", "float32", "bfloat16"):
        (here / word).mkdir()
        (here / word / "notes.txt").write_text("the user's own\n")
    for word in ("local", "logits"):
        (work / word).mkdir()
    again = llmflow(*args, cwd=here)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [_stage_line(again, s) for s in ("align", "compare")] == ["cached", "cached"], again.stdout
