"""``StageState``: what ``.llmflow-stage.json`` holds, written and read back as the same type; the
one planning decision (``plan_stage``/``decide``) on top of it."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields, replace
from pathlib import Path

from llmflow.workflow.plan import StageKey, decide
from llmflow.workflow.state import STATE_FILE, StageState, read_state


def _state(run_dir: Path) -> StageState:
    out = run_dir / "dump"
    return StageState(
        stage="dump", type="dump", identity="dump@2", fingerprint="f" * 64, code={"x.py:f": "ab"},
        run_id="0123456789abcdef", params={"model": "tiny-llama", "dump_dir": str(out / "d")},
        upstream={"seed": "e" * 64}, upstream_runs={"seed": "fedcba9876543210"},
        outputs={"dump_dir": str(out / "d"), "files": [str(out / "d" / "a.json"), "/elsewhere/b"]},
        summary={"dump": {"bytes": 12}}, outcome={"status": "pass", "headline": "ok", "next": ""},
        started="2026-01-01T00:00:00.000+00:00", finished="2026-01-01T00:00:01.500+00:00", duration_s=1.5)


def _write(state: StageState, run_dir: Path) -> Path:
    stage_dir = run_dir / state.stage
    (stage_dir / "d").mkdir(parents=True)
    (stage_dir / "d" / "a.json").write_text("{}", encoding="utf-8")
    (stage_dir / STATE_FILE).write_text(json.dumps(state.to_json(run_dir, stage_dir)), encoding="utf-8")
    return stage_dir


def test_a_state_reads_back_as_the_state_written(tmp_path):
    run_dir = tmp_path / "run"
    state = _state(run_dir)
    stage_dir = _write(state, run_dir)
    back = read_state(stage_dir)
    assert isinstance(back, StageState)
    assert back.files == {"d/a.json": [2, (stage_dir / "d" / "a.json").stat().st_mtime_ns]}
    assert replace(back, files=None) == state


def test_the_file_lists_every_field_in_order_with_run_dir_paths_relative(tmp_path):
    run_dir = tmp_path / "run"
    stage_dir = _write(_state(run_dir), run_dir)
    on_disk = json.loads((stage_dir / STATE_FILE).read_text(encoding="utf-8"))
    assert list(on_disk) == [f.name for f in fields(StageState) if f.name != "files"] + ["paths", "files"]
    assert on_disk["outputs"] == {"dump_dir": "dump/d", "files": ["dump/d/a.json", "/elsewhere/b"]}
    assert on_disk["paths"]["outputs"] == [["dump_dir"], ["files", 0]]
    assert str(tmp_path) not in json.dumps(on_disk)


def test_a_moved_run_dir_reads_its_own_files(tmp_path):
    run_dir = tmp_path / "run"
    _write(_state(run_dir), run_dir)
    shutil.move(run_dir, tmp_path / "moved")
    back = read_state(tmp_path / "moved" / "dump")
    assert back is not None
    assert back.outputs["dump_dir"] == str(tmp_path / "moved" / "dump" / "d")
    assert back.outputs["files"][1] == "/elsewhere/b"


def test_an_older_or_foreign_file(tmp_path):
    stage_dir = tmp_path / "run" / "s"
    stage_dir.mkdir(parents=True)
    older = {"fingerprint": "f", "outputs": {"x": 1}}
    (stage_dir / STATE_FILE).write_text(json.dumps(older), encoding="utf-8")
    old = read_state(stage_dir)
    assert old is not None and old.outputs == {"x": 1}
    assert (old.files, old.code, old.run_id, old.upstream_runs, old.summary) == (None, None, None, {}, {})
    assert (old.content, old.upstream_content) == (None, {})
    for text in ("[1, 2]", "{\"outputs\": {}}", "{not json"):
        (stage_dir / STATE_FILE).write_text(text, encoding="utf-8")
        assert read_state(stage_dir) is None
    assert read_state(tmp_path / "run" / "missing") is None


def _key(state: StageState, **changed: object) -> StageKey:
    base = {"params": state.params, "identity": state.identity, "code": state.code or {},
            "fingerprint": state.fingerprint, "upstream": state.upstream,
            "upstream_runs": state.upstream_runs}
    return StageKey(**{**base, **changed})  # type: ignore[arg-type]


def test_one_decision_and_its_reasons(tmp_path):
    run_dir = tmp_path / "run"
    state = _state(run_dir)
    stage_dir = _write(state, run_dir)
    state = read_state(stage_dir)
    assert state is not None
    assert decide(state, _key(state), stage_dir, False, False) == (False, "cached")
    assert decide(state, _key(state), stage_dir, True, False) == (True, "forced")
    assert decide(None, _key(state), stage_dir, False, False) == (True, "new")
    assert decide(None, None, stage_dir, False, True) == (True, "previous run failed")
    assert decide(state, None, stage_dir, False, False) == (True, "upstream changed")  # a need runs first
    assert decide(state, _key(state, upstream_runs={"seed": "0"}), stage_dir, False, False)[1] == \
        "upstream changed"
    assert decide(state, _key(state, fingerprint="g", identity="dump@3"), stage_dir, False, False)[1] == \
        "stage type or version changed"
    assert decide(state, _key(state, fingerprint="g", code={"x.py:f": "cd"}), stage_dir, False, False)[1] == \
        "code changed: x.py"
    assert decide(state, _key(state, fingerprint="g"), stage_dir, False, False)[1] == "parameters changed"
    assert decide(state, _key(state, fingerprint="g", params={**state.params, "model": "other"}), stage_dir,
                  False, False)[1] == "parameters changed: model"


def test_a_needed_stage_is_the_one_read_by_content_key_else_by_run_id(tmp_path):
    """A needed stage that ran again (another run id) with the same content key is the result the
    stage read; a state recorded without content keys (an older llmflow's) compares run ids."""
    run_dir = tmp_path / "run"
    stage_dir = _write(_state(run_dir), run_dir)
    older = read_state(stage_dir)
    assert older is not None
    rerun = {"upstream_runs": {"seed": "0"}, "upstream_content": {"seed": "c" * 64}}
    assert decide(older, _key(older, **rerun), stage_dir, False, False) == (True, "upstream changed")
    assert decide(older, _key(older, upstream_content={"seed": "c" * 64}), stage_dir, False, False) == \
        (False, "cached")
    state = replace(older, upstream_content={"seed": "c" * 64})
    assert decide(state, _key(state, **rerun), stage_dir, False, False) == (False, "cached")
    assert decide(state, _key(state, **{**rerun, "upstream_content": {"seed": "d" * 64}}), stage_dir, False,
                  False) == (True, "upstream changed")
    assert decide(state, _key(state, upstream_runs={"seed": "0"}), stage_dir, False, False) == \
        (True, "upstream changed")  # (the needed stage's result in use has no content key)
    (stage_dir / "d" / "a.json").unlink()
    assert decide(state, _key(state), stage_dir, False, False)[1] == \
        "outputs changed on disk (d/a.json is gone)"
