"""The cache trusts only what it can still see: a stage whose files changed on disk re-runs, an
edited code file a stage names re-runs it, and a copied or moved run dir reads its own files. What a
stage reads of a needed stage is that stage's result, not its run: a rerun that made the same
result leaves it cached."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import jsonschema
import pytest

from llmflow.workflow import plan_workflow, run_workflow
from llmflow.workflow.state import STATE_FILE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO, llmflow, ran, write_workflow  # noqa: E402

CHAIN = """
    name: chain
    stages:
      a: {uses: "{HELPERS}:EchoStage", with: {value: "code.py:make"}}
      b: {uses: "{HELPERS}:EchoStage", needs: [a], with: {value: "${stages.a.outputs.file}"}}
      local: {uses: "local_stage.py:Local"}
"""

LOCAL_STAGE = '''
from llmflow.stages.base import Stage


class Local(Stage):
    """A plugin stage next to the workflow."""

    type = "local"

    def run(self, ctx):
        (ctx.out_dir / "out.txt").write_text("local")
        return {"out": str(ctx.out_dir / "out.txt")}
'''


@pytest.fixture
def chain(tmp_path):
    wf = write_workflow(tmp_path, CHAIN)
    (tmp_path / "code.py").write_text("def make():\n    return 1\n")
    (tmp_path / "local_stage.py").write_text(LOCAL_STAGE)
    rd = tmp_path / "run"
    assert run_workflow(wf, run_dir=rd).exit_code == 0
    return wf, rd


def plan(wf: Path, rd: Path) -> dict[str, tuple[str, str]]:
    return {i.stage: (i.action, i.reason) for i in plan_workflow(wf, run_dir=rd)}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda f: f.unlink(), "value.json is gone"),
        (lambda f: f.write_text('"edited"'), "value.json was modified"),
    ],
    ids=["deleted", "modified"],
)
def test_a_stage_whose_files_changed_reruns(chain, change, reason):
    wf, rd = chain
    change(rd / "a" / "value.json")
    assert plan(wf, rd) == {
        "a": ("run", f"outputs changed on disk ({reason})"),
        "b": ("run", "upstream changed"),
        "local": ("cached", "cached"),
    }
    res = run_workflow(wf, run_dir=rd)
    # a made again what b read: b, which the plan could not know of, stays cached
    assert [res.stages[s].status for s in ("a", "b", "local")] == ["done", "cached", "cached"]
    assert ran(rd) == ["a", "b", "a"]
    assert json.loads((rd / "a" / "value.json").read_text()) == "code.py:make"
    assert {i.action for i in plan_workflow(wf, run_dir=rd)} == {"cached"}


def test_the_users_files_in_a_stage_folder_keep_it_cached_and_survive_a_forced_rerun(chain, tmp_path):
    wf, rd = chain
    (rd / "a" / "notes.txt").write_text("what I saw")
    (rd / "a" / "plots" / "deep").mkdir(parents=True)
    (rd / "a" / "plots" / "deep" / "fig.png").write_bytes(b"png")
    assert {i.action for i in plan_workflow(wf, run_dir=rd)} == {"cached"}
    proc = llmflow("run", str(wf), "--run-dir", str(rd), "--force", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ran(rd) == ["a", "b", "a", "b"]
    assert (rd / "a" / "notes.txt").read_text() == "what I saw"
    assert (rd / "a" / "plots" / "deep" / "fig.png").read_bytes() == b"png"
    assert json.loads((rd / "a" / "value.json").read_text()) == "code.py:make"
    assert {i.action for i in plan_workflow(wf, run_dir=rd)} == {"cached"}
    # a file of the user's where the rerun writes its own output: refused, both kept
    (rd / "a" / "value.json").unlink()
    state = json.loads((rd / "a" / STATE_FILE).read_text())
    (rd / "a" / "value.json").write_text("mine")
    state["files"].pop("value.json")
    (rd / "a" / STATE_FILE).write_text(json.dumps(state))
    proc = llmflow("run", str(wf), "--run-dir", str(rd), "--force", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"{rd / 'a' / 'value.json'}: not written by llmflow" in proc.stdout + proc.stderr
    assert (rd / "a" / "value.json").read_text() == "mine"
    assert (rd / "a" / "notes.txt").read_text() == "what I saw"


def test_edited_code_files_rerun_their_stage(chain, tmp_path):
    wf, rd = chain
    with open(tmp_path / "code.py", "a") as fh:
        fh.write("# a comment is an edit too\n")
    with open(tmp_path / "local_stage.py", "a") as fh:
        fh.write("# edited\n")
    assert plan(wf, rd) == {
        "a": ("run", "code changed: code.py"),
        "b": ("run", "upstream changed"),
        "local": ("run", "stage type or version changed"),
    }
    res = run_workflow(wf, run_dir=rd)
    # (a's output does not change with code.py, only its cache key does: b, reading it, stays cached)
    assert [res.stages[s].status for s in ("a", "b", "local")] == ["done", "cached", "done"]
    assert ran(rd) == ["a", "b", "a"]  # the helper stages log their starts; local does not


SAME_RESULT = """
    name: same
    params:
      count: {type: integer, default: 1}
    stages:
      a: {uses: "{HELPERS}:EchoStage", with: {value: 7, count: "${params.count}"}}
      b: {uses: "{HELPERS}:EchoStage", needs: [a], with: {value: "${stages.a.outputs.file}"}}
      judge: {uses: "{HELPERS}:OutcomeStage", needs: [b], with: {status: fail, headline: "b judged"}}
"""


def test_a_needed_stage_that_ran_again_and_made_the_same_result_leaves_its_readers_cached(tmp_path):
    """A forced rerun of ``a``, or one for a parameter that changes nothing it writes (``count``),
    makes the same files and outputs: ``b`` and ``judge`` stay cached, the judge's outcome still
    decides the exit code, and summary.json gives the cached stages the times of the run that made
    their results."""
    wf = write_workflow(tmp_path, SAME_RESULT)
    rd = tmp_path / "run"

    def run(*args: str) -> str:
        proc = llmflow("run", str(wf), "--run-dir", str(rd), *args, cwd=tmp_path)
        assert proc.returncode == 1, proc.stdout + proc.stderr  # the judge's "fail", every time
        assert proc.stdout.strip().splitlines()[-1] == "FAILED: b judged", proc.stdout
        return proc.stdout

    run()
    made = json.loads((rd / "summary.json").read_text())["stages"]
    run("--only", "a", "--force")  # the judge's outcome is not stale: a made what b read
    assert ran(rd) == ["a", "b", "judge", "a"]
    run()
    assert ran(rd) == ["a", "b", "judge", "a"]  # b and judge cached
    proc = llmflow("plan", str(wf), "--run-dir", str(rd), "--set", "count=2", "--json", cwd=tmp_path)
    assert json.loads(proc.stdout)[0]["reason"] == "parameters changed: count", proc.stdout
    run("--set", "count=2")
    assert ran(rd) == ["a", "b", "judge", "a", "a"]

    summary = json.loads((rd / "summary.json").read_text())
    jsonschema.validate(summary, json.loads((REPO / "schemas" / "summary.schema.json").read_text()))
    for sid in ("b", "judge"):
        entry = summary["stages"][sid]
        assert (entry["status"], entry["cached"]) == ("cached", True)
        assert entry["started"] is not None
        times = ("started", "finished", "duration_s")
        assert {k: entry[k] for k in times} == {k: made[sid][k] for k in times}
    assert summary["stages"]["a"]["status"] == "done" and summary["stages"]["a"]["cached"] is False


REFS = """
    name: refs
    params:
      fn: {type: string, default: "faults.py:scale_a"}
    stages:
      a: {uses: "{HELPERS}:EchoStage", with: {value: "${params.fn}"}}
"""


def test_naming_another_function_of_a_code_file_is_a_parameter_change(tmp_path):
    """``--set fn=faults.py:scale_b`` after ``:scale_a`` changes a parameter, not the code;
    "code changed" is for the file's content."""
    wf = write_workflow(tmp_path, REFS)
    (tmp_path / "faults.py").write_text("def scale_a(m):\n    pass\n\n\ndef scale_b(m):\n    pass\n")
    rd = tmp_path / "run"
    proc = llmflow("run", str(wf), "--run-dir", str(rd), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def reason(*args: str) -> str:
        proc = llmflow("plan", str(wf), "--run-dir", str(rd), "--json", *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(proc.stdout)[0]["reason"]

    assert reason() == "cached"
    assert reason("--set", "fn=faults.py:scale_b") == "parameters changed: value"
    with open(tmp_path / "faults.py", "a") as fh:
        fh.write("# edited\n")
    assert reason() == "code changed: faults.py"
    assert reason("--set", "fn=faults.py:scale_b") == "code changed: faults.py"


INPUTS = """
    name: inputs
    stages:
      read: {uses: "{HELPERS}:EchoStage", with: {value: "dumps/target"}}
      after: {uses: "{HELPERS}:EchoStage", needs: [read], with: {value: "${stages.read.outputs.value}"}}
"""


def test_a_dump_written_again_in_place_reruns_the_stages_that_read_it(tmp_path):
    """A stage naming a folder outside the run dir (a dump, a checkpoint) is cached only while
    that folder's files are the ones it read: a dump made again under the same path re-runs it."""
    wf = write_workflow(tmp_path, INPUTS)
    dump = tmp_path / "dumps" / "target"
    (dump / "rank0").mkdir(parents=True)
    (dump / "rank0" / "index.jsonl").write_text("first\n")
    rd = tmp_path / "run"
    assert run_workflow(wf, run_dir=rd).exit_code == 0
    assert plan(wf, rd) == {"read": ("cached", "cached"), "after": ("cached", "cached")}
    (dump / "rank0" / "index.jsonl").write_text("second, longer\n")  # the dump made again
    assert plan(wf, rd) == {"read": ("run", "input changed: dumps/target"),
                            "after": ("run", "upstream changed")}
    assert run_workflow(wf, run_dir=rd).exit_code == 0
    assert plan(wf, rd)["read"] == ("cached", "cached")
    (dump / "rank0" / "data.safetensors").write_bytes(b"new file")  # a file added
    assert plan(wf, rd)["read"] == ("run", "input changed: dumps/target")


@pytest.mark.parametrize("how", ["copy", "move"])
def test_a_copied_or_moved_run_dir_reads_its_own_files(chain, tmp_path, how):
    wf, rd = chain
    state_text = (rd / "b" / STATE_FILE).read_text()
    assert str(rd) not in state_text  # paths inside the run dir are stored relative to it
    other = tmp_path / "elsewhere" / "run-copy"
    other.parent.mkdir()
    if how == "copy":
        shutil.copytree(rd, other, symlinks=True)  # copy2 keeps mtimes, like cp -a / rsync -a
        shutil.rmtree(rd)  # the original is gone: nothing may still point at it
    else:
        os.rename(rd, other)
    assert {i.action for i in plan_workflow(wf, run_dir=other)} == {"cached"}
    res = run_workflow(wf, run_dir=other)
    assert {r.status for r in res.stages.values()} == {"cached"}
    assert res.stages["a"].outputs["file"] == str(other / "a" / "value.json")
    assert res.stages["b"].outputs["value"] == str(other / "a" / "value.json")
    assert res.stages["b"].outputs["nested"]["dir"] == str(other / "b")
    summary = json.loads((other / "summary.json").read_text())
    assert str(rd) + os.sep not in json.dumps(summary)


TINY = "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64,seed=5"

DUMPS = f"""
    name: dumps
    params:
      target_patch: {{type: string, default: "patch.py:identity"}}
    stages:
      seed: {{uses: seed, with: {{seed: 3}}}}
      golden:
        uses: dump
        needs: [seed]
        with: {{model: "{TINY}", prompt: "hi", max_new_tokens: 4, chat_template: false,
                seed_settings: "${{stages.seed.outputs.settings}}"}}
      target:
        uses: dump
        needs: [seed]
        with: {{model: "{TINY}", prompt: "hi", max_new_tokens: 4, chat_template: false,
                patch: "${{params.target_patch}}", seed_settings: "${{stages.seed.outputs.settings}}"}}
      align:
        uses: align
        needs: [golden, target]
        with: {{golden_dump: "${{stages.golden.outputs.dump_dir}}",
                target_dump: "${{stages.target.outputs.dump_dir}}"}}
      compare:
        uses: compare
        needs: [align]
        with: {{golden_dump: "${{stages.align.outputs.golden_dump}}",
                target_dump: "${{stages.align.outputs.target_dump}}",
                pairs_file: "${{stages.align.outputs.pairs_file}}", target_dtype: float32}}
"""


EXTERNAL_DUMP = f"""
    name: external
    stages:
      golden:
        uses: dump
        with: {{model: "{TINY}", prompt: "hi", max_new_tokens: 2, chat_template: false,
                dump_dir: "kept/golden"}}
      read: {{uses: "{{HELPERS}}:EchoStage", needs: [golden],
              with: {{value: "${{stages.golden.outputs.dump_dir}}"}}}}
"""


def test_a_dump_written_outside_the_run_dir_is_its_stages_output_not_its_input(tmp_path):
    """``dump_dir`` names where the dump stage writes (``writes_to``): the dump it made there does
    not count as a changed input on the next run; the stage reading it is cached with it."""
    wf = write_workflow(tmp_path, EXTERNAL_DUMP)
    rd = tmp_path / "run"
    assert run_workflow(wf, run_dir=rd).exit_code == 0
    assert (tmp_path / "kept" / "golden" / "llmflow_dump.json").is_file()
    assert plan(wf, rd) == {"golden": ("cached", "cached"), "read": ("cached", "cached")}


def _rows(rd: Path) -> dict[str, int]:
    levels = json.loads((rd / "summary.json").read_text())["compare"]["levels"]
    return {level: info["rows"] for level, info in levels.items()}


@pytest.mark.slow
def test_deleted_dump_data_and_an_edited_patch_rerun_through_the_cli(tmp_path):
    """A dump whose data file was deleted re-dumps (the compare sees every row again, not what
    was left); an edited target patch re-runs its dump. env.json records no secret values."""
    wf = write_workflow(tmp_path, DUMPS)
    (tmp_path / "patch.py").write_text("def identity(model):\n    return None\n")
    rd = tmp_path / "run"
    secrets = {"TORCH_HUB_TOKEN": "hunter2-token", "ASCEND_PASSWORD": "hunter2-pw", "ATB_SECRET": "hunter2-s"}
    first = llmflow("run", str(wf), "--run-dir", str(rd), "--workers", "2", timeout=300, env=secrets)
    assert first.returncode == 0, first.stdout + first.stderr
    rows = _rows(rd)
    assert sum(rows.values()) > 10
    # env.json names the secret-looking variables but never holds their values
    env_vars = json.loads((rd / "target" / "dump" / "env.json").read_text())["env_vars"]
    assert {k: env_vars[k] for k in secrets} == dict.fromkeys(secrets, "<redacted>")
    assert not [p for p in rd.rglob("*") if p.is_file() and b"hunter2" in p.read_bytes()]

    data = sorted((rd / "target" / "dump").rglob("*.safetensors"))
    assert len(data) > 1
    data[-1].unlink()
    proc = llmflow("plan", str(wf), "--run-dir", str(rd), "--json")
    reasons = {i["stage"]: (i["action"], i["reason"]) for i in json.loads(proc.stdout)}
    assert reasons["target"][0] == "run" and reasons["target"][1].startswith("outputs changed on disk (dump/")
    assert reasons["golden"] == ("cached", "cached") and reasons["compare"] == ("run", "upstream changed")
    again = llmflow("run", str(wf), "--run-dir", str(rd), timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert _rows(rd) == rows  # the whole target again, not what was left of it

    with open(tmp_path / "patch.py", "a") as fh:
        fh.write("# reviewed\n")
    proc = llmflow("plan", str(wf), "--run-dir", str(rd))
    assert "code changed: patch.py" in proc.stdout and proc.returncode == 0


EDITED_MID_RUN = '''
from pathlib import Path

from llmflow.stages.base import Stage

VERSION = "v1"


class Versioned(Stage):
    """Writes the version of the code that runs."""

    type = "versioned"
    outputs = {"version": "the code's version"}

    def run(self, ctx):
        (ctx.out_dir / "version.txt").write_text(VERSION)
        return {"version": VERSION}
'''
EDITOR = '''
from pathlib import Path

from llmflow.stages.base import Stage


class Editor(Stage):
    """Edits versioned.py to v2, as a user does while a long run goes on."""

    type = "editor"

    def run(self, ctx):
        code = Path(__file__).with_name("versioned.py")
        code.write_text(code.read_text().replace('VERSION = "v1"', 'VERSION = "v2"'))
        return {}
'''


def test_a_plugin_edited_while_the_run_goes_on_is_cached_as_the_code_that_ran(tmp_path):
    """The run imported the plugin once: the stage after the edit ran the old code, and its cache
    entry says so. The next run, importing the edited file, runs that stage again."""
    (tmp_path / "versioned.py").write_text(EDITED_MID_RUN)
    (tmp_path / "editor.py").write_text(EDITOR)
    wf = write_workflow(tmp_path, """
        name: edited
        stages:
          edit: {uses: "editor.py:Editor"}
          after: {uses: "versioned.py:Versioned", needs: [edit]}
    """)
    rd = tmp_path / "run"
    proc = llmflow("run", str(wf), "--run-dir", str(rd), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (rd / "after" / "version.txt").read_text() == "v1"
    proc = llmflow("run", str(wf), "--run-dir", str(rd), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (rd / "after" / "version.txt").read_text() == "v2"
