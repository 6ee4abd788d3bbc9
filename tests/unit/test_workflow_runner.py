"""The runner: caching, resume after failure, --only/--from/--force, plan reasons, lock, resources,
summary.json (validated against schemas/summary.schema.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from llmflow.errors import UserError
from llmflow.workflow import plan_workflow, run_workflow
from llmflow.workflow.rundir import RunDirLock
from llmflow.workflow.state import STATE_FILE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO, events, ran, write_workflow  # noqa: E402

CHAIN = """
    name: chain
    params:
      v: {type: string, default: one}
      w: {type: integer, default: 1}
    stages:
      a:
        uses: {HELPERS}:EchoStage
        with: {value: "${params.v}"}
      b:
        uses: {HELPERS}:EchoStage
        needs: [a]
        with: {value: "${stages.a.outputs.value}-b"}
      c:
        uses: {HELPERS}:EchoStage
        needs: [b]
        with: {value: "${stages.b.outputs.nested}"}
      side:
        uses: {HELPERS}:EchoStage
        with: {value: "${params.w}"}
"""


def summary_schema() -> dict:
    return json.loads((REPO / "schemas" / "summary.schema.json").read_text())


def plan(wf: Path, rd: Path, **kw) -> dict[str, tuple[str, str]]:
    return {i.stage: (i.action, i.reason) for i in plan_workflow(wf, run_dir=rd, **kw)}


def test_run_then_cached_and_outputs(tmp_path):
    wf = write_workflow(tmp_path, CHAIN)
    rd = tmp_path / "run"
    res = run_workflow(wf, run_dir=rd)
    assert res.status == "passed" and res.exit_code == 0
    assert ran(rd) == ["a", "b", "c", "side"]
    # whole-reference keeps the type (a dict), paths point at the final stage dir
    assert res.stages["c"].outputs["value"] == {"dir": str(rd / "b"), "items": [1, 2, 3]}
    assert res.stages["b"].outputs["file"] == str(rd / "b" / "value.json")
    assert json.loads((rd / "b" / "value.json").read_text()) == "one-b"
    state = json.loads((rd / "a" / STATE_FILE).read_text())
    assert state["outputs"]["value"] == "one" and len(state["fingerprint"]) == 64
    assert not list((rd / ".tmp").iterdir())
    summary = json.loads((rd / "summary.json").read_text())
    jsonschema.validate(summary, summary_schema())
    assert summary["status"] == "passed" and summary["echo_b"] == {"value": "one-b"}
    assert summary["stages"]["c"]["status"] == "done" and summary["params"] == {"v": "one", "w": 1}

    res2 = run_workflow(wf, run_dir=rd)
    assert [r.status for r in res2.stages.values()] == ["cached"] * 4
    assert ran(rd) == ["a", "b", "c", "side"]  # nothing ran again
    assert res2.stages["c"].outputs == res.stages["c"].outputs
    summary = json.loads((rd / "summary.json").read_text())
    jsonschema.validate(summary, summary_schema())
    assert summary["echo_b"] == {"value": "one-b"} and summary["stages"]["a"]["cached"] is True


def test_param_change_reruns_downstream_only(tmp_path):
    wf = write_workflow(tmp_path, CHAIN)
    rd = tmp_path / "run"
    run_workflow(wf, run_dir=rd)
    assert plan(wf, rd, set_params=["w=2"]) == {
        "a": ("cached", "cached"),
        "b": ("cached", "cached"),
        "c": ("cached", "cached"),
        "side": ("run", "parameters changed: value"),
    }
    assert plan(wf, rd, set_params={"v": "two"}) == {
        "a": ("run", "parameters changed: value"),
        "b": ("run", "upstream changed"),
        "c": ("run", "upstream changed"),
        "side": ("cached", "cached"),
    }
    res = run_workflow(wf, run_dir=rd, set_params=["v=two"])
    assert {k: r.status for k, r in res.stages.items()} == {
        "a": "done",
        "b": "done",
        "c": "done",
        "side": "cached",
    }
    assert res.stages["b"].outputs["value"] == "two-b"


def test_force_and_from(tmp_path):
    wf = write_workflow(tmp_path, CHAIN)
    rd = tmp_path / "run"
    run_workflow(wf, run_dir=rd)
    assert {k: v[0] for k, v in plan(wf, rd, force=True).items()} == dict.fromkeys("abc", "run") | {
        "side": "run"
    }
    assert plan(wf, rd, from_stage="b") == {
        "a": ("cached", "cached"),
        "b": ("run", "forced"),
        "c": ("run", "forced"),
        "side": ("cached", "cached"),
    }
    n = len(ran(rd))
    res = run_workflow(wf, run_dir=rd, from_stage="b")
    assert ran(rd)[n:] == ["b", "c"]
    assert res.stages["a"].status == "cached" and res.stages["c"].status == "done"
    with pytest.raises(UserError, match="unknown stage 'bb' \\(did you mean 'b'\\?\\)"):
        run_workflow(wf, run_dir=rd, from_stage="bb")


def test_only(tmp_path):
    wf = write_workflow(tmp_path, CHAIN)
    rd = tmp_path / "run"
    with pytest.raises(UserError, match="--only b: stage 'a' \\(needed by 'b'\\) has no completed result"):
        run_workflow(wf, run_dir=rd, only=["b"])
    res = run_workflow(wf, run_dir=rd, only=["a"])
    assert ran(rd) == ["a"] and res.stages["b"].status == "pending"
    res = run_workflow(wf, run_dir=rd, only=["b"])
    assert ran(rd) == ["a", "b"]
    assert res.stages["a"].status == "cached" and res.stages["c"].status == "pending"
    assert plan(wf, rd, only=["b"])["c"] == ("skip", "not selected (--only)")
    # re-running an upstream stage alone makes its dependents out of date, unless it made the same
    run_workflow(wf, run_dir=rd, only=["a"], force=True)
    assert plan(wf, rd)["b"] == ("cached", "cached")
    run_workflow(wf, run_dir=rd, only=["a"], set_params=["v=two"])
    assert plan(wf, rd, set_params=["v=two"])["b"] == ("run", "upstream changed")


FAILING = """
    name: branches
    stages:
      ok1:
        uses: {HELPERS}:EchoStage
        with: {value: 1}
      bad:
        uses: {HELPERS}:FailStage
        needs: [ok1]
        with: {unless_file: "%s"}
      after-bad:
        uses: {HELPERS}:EchoStage
        needs: [bad]
      other:
        uses: {HELPERS}:EchoStage
        needs: [ok1]
        with: {value: 2}
"""


def test_failed_branch_then_resume(tmp_path):
    fixed = tmp_path / "fixed"
    wf = write_workflow(tmp_path, FAILING % fixed)
    rd = tmp_path / "run"
    res = run_workflow(wf, run_dir=rd)
    status = {k: r.status for k, r in res.stages.items()}
    assert status == {"ok1": "done", "bad": "failed", "after-bad": "skipped", "other": "done"}
    assert res.exit_code == 1 and "RuntimeError: boom" in res.reason
    assert res.stages["after-bad"].error == "needs 'bad', which failed"
    assert not (rd / "bad").exists()
    assert (rd / ".failed" / "bad" / "partial.txt").exists()  # kept for inspection
    summary = json.loads((rd / "summary.json").read_text())
    jsonschema.validate(summary, summary_schema())
    assert summary["status"] == "failed" and summary["stages"]["bad"]["error"] == "RuntimeError: boom"
    assert plan(wf, rd)["bad"] == ("run", "previous run failed")
    fixed.write_text("")
    res = run_workflow(wf, run_dir=rd)
    assert {k: r.status for k, r in res.stages.items()} == {
        "ok1": "cached",
        "bad": "done",
        "after-bad": "done",
        "other": "cached",
    }
    assert res.exit_code == 0


def test_user_error_in_stage_is_exit_2(tmp_path):
    wf = write_workflow(
        tmp_path,
        """
        name: ue
        stages:
          x: {uses: "{HELPERS}:FailStage", with: {user: true}}
    """,
    )
    res = run_workflow(wf, run_dir=tmp_path / "run")
    assert res.exit_code == 2 and res.stages["x"].error == "fail: device 'npu9' is not available"


def test_lock_refuses_second_run(tmp_path):
    wf = write_workflow(tmp_path, CHAIN)
    rd = tmp_path / "run"
    with RunDirLock(rd):
        with pytest.raises(UserError, match=r"run dir .*run is in use by another llmflow run \(pid \d+\)"):
            run_workflow(wf, run_dir=rd)
    assert run_workflow(wf, run_dir=rd).status == "passed"


def test_stale_tmp_dirs_removed(tmp_path):
    wf = write_workflow(tmp_path, CHAIN)
    rd = tmp_path / "run"
    run_workflow(wf, run_dir=rd)
    (rd / ".tmp" / "a-deadbeef").mkdir(parents=True)  # as a killed run leaves it
    (rd / ".tmp" / "a-deadbeef" / "junk").write_text("x")
    run_workflow(wf, run_dir=rd)
    assert list((rd / ".tmp").iterdir()) == []


def test_workers_run_in_parallel_but_resources_exclusive(tmp_path):
    wf = write_workflow(
        tmp_path,
        """
        name: par
        stages:
          p1: {uses: "{HELPERS}:EchoStage", with: {sleep: 0.3}}
          p2: {uses: "{HELPERS}:EchoStage", with: {sleep: 0.3}}
          r1: {uses: "{HELPERS}:EchoStage", needs: [p1, p2], with: {sleep: 0.2, resource: "device:cpu"}}
          r2: {uses: "{HELPERS}:EchoStage", needs: [p1, p2], with: {sleep: 0.2, resource: "device:cpu"}}
    """,
    )
    rd = tmp_path / "run"
    assert run_workflow(wf, run_dir=rd, workers=4).status == "passed"
    t = {(s, e): ts for s, e, ts in events(rd)}
    assert t[("p2", "start")] < t[("p1", "end")] and t[("p1", "start")] < t[("p2", "end")]  # overlapped
    first, second = sorted(["r1", "r2"], key=lambda s: t[(s, "start")])
    assert t[(second, "start")] >= t[(first, "end")]  # never overlapped


def test_runtime_reference_error_fails_stage_with_mark(tmp_path):
    wf = write_workflow(
        tmp_path,
        """
        name: rt
        stages:
          a: {uses: "{HELPERS}:EchoStage", with: {value: {x: 1}}}
          b:
            uses: "{HELPERS}:EchoStage"
            needs: [a]
            with: {value: "${stages.a.outputs.value.y}"}
    """,
    )
    res = run_workflow(wf, run_dir=tmp_path / "run")
    assert res.exit_code == 2
    assert res.stages["b"].error == (
        f"{wf}:7:19: ${{stages.a.outputs.value.y}}: stage 'a' has no output "
        "'value.y' (it has: file, nested, value)"
    )


def test_runtime_schema_check_after_interpolation(tmp_path):
    wf = write_workflow(
        tmp_path,
        """
        name: rt
        stages:
          a: {uses: "{HELPERS}:EchoStage", with: {value: notanumber}}
          b:
            uses: "{HELPERS}:EchoStage"
            needs: [a]
            with: {count: "${stages.a.outputs.value}"}
    """,
    )
    res = run_workflow(wf, run_dir=tmp_path / "run")
    assert res.stages["b"].status == "failed" and res.exit_code == 2
    assert res.stages["b"].error.endswith(":7:19: stages.b.with.count: 'notanumber' is not of type 'integer'")


def test_dry_run_runs_nothing(tmp_path):
    wf = write_workflow(tmp_path, CHAIN)
    res = run_workflow(wf, run_dir=tmp_path / "run", dry_run=True)
    assert res.status == "planned" and [i.reason for i in res.plan] == ["new"] * 4
    assert not (tmp_path / "run").exists()


def test_extends_and_include_run(tmp_path):
    write_workflow(
        tmp_path,
        """
        params:
          v: {type: string, default: base}
        stages:
          a:
            uses: {HELPERS}:EchoStage
            with: {value: "${params.v}", count: 2}
    """,
        name="recipes/base.yaml",
    )
    write_workflow(
        tmp_path,
        """
        stages:
          extra:
            uses: {HELPERS}:EchoStage
            needs: [a]
            with: {value: "${stages.a.outputs.value}+extra"}
    """,
        name="recipes/extra.yaml",
    )
    wf = write_workflow(
        tmp_path,
        """
        name: child
        extends: recipes/base.yaml
        include: [recipes/extra.yaml]
        params:
          v: {default: child}
        stages:
          a:
            with: {count: 3}
    """,
    )
    res = run_workflow(wf, run_dir=tmp_path / "run")
    assert res.status == "passed"
    assert res.stages["extra"].outputs["value"] == "child+extra"
    state = json.loads((tmp_path / "run" / "a" / STATE_FILE).read_text())
    assert state["params"] == {"value": "child", "count": 3, "sleep": 0}


def test_a_rerun_carries_the_users_entries_and_leaves_empty_folders_to_the_new_output(tmp_path):
    from llmflow.workflow.rundir import install
    from llmflow.workflow.state import file_manifest

    final, tmp = tmp_path / "stage", tmp_path / "new"
    for d in (final, tmp):
        (d / "empty" / "deeper").mkdir(parents=True)
        (d / "data").mkdir()
        (d / "data" / "t.bin").write_text(d.name)
    (final / STATE_FILE).write_text(json.dumps({"files": file_manifest(final)}))
    (final / "notes.txt").write_text("mine")
    (final / "data" / "mine.csv").write_text("mine")
    (final / "plots" / "a").mkdir(parents=True)
    (final / "plots" / "a" / "p.png").write_text("mine")
    install(tmp, final)
    assert sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()) == [
        "data/mine.csv", "data/t.bin", "notes.txt", "plots/a/p.png"]
    assert (final / "data" / "t.bin").read_text() == "new" and (final / "empty" / "deeper").is_dir()


def test_a_failed_install_puts_the_users_entries_back_in_the_old_folder(tmp_path, monkeypatch):
    from llmflow.workflow import rundir
    from llmflow.workflow.state import file_manifest

    final, tmp = tmp_path / "stage", tmp_path / "new"
    for d in (final, tmp):
        d.mkdir()
        (d / "t.bin").write_text(d.name)
    (final / STATE_FILE).write_text(json.dumps({"files": file_manifest(final)}))
    (final / "notes.txt").write_text("mine")

    def refused(staged, where):
        raise OSError("no room")

    monkeypatch.setattr(rundir, "install_staged", refused)
    with pytest.raises(OSError):
        rundir.install(tmp, final)
    assert (final / "notes.txt").read_text() == "mine" and not (tmp / "notes.txt").exists()
