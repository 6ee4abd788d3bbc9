"""The badcase and report stages, run directly with a StageContext (no workflow engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llmflow.errors import UserError
from llmflow.localize.badcase import load_prompts
from llmflow.results.codec import to_json
from llmflow.stages.badcase import BadcaseStage
from llmflow.stages.base import StageContext
from llmflow.stages.report import ReportStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import synthetic_verdict  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _ctx(tmp_path: Path, params: dict, stage_id: str = "s") -> StageContext:
    out = tmp_path / stage_id
    out.mkdir()
    return StageContext(stage_id=stage_id, params=params, out_dir=out, final_dir=out, run_dir=tmp_path,
                        workflow_dir=REPO / "workflows", inputs={}, log=lambda _m: None)


def test_report_stage_reads_verdict_and_csv(tmp_path):
    vf = tmp_path / "verdict.json"
    vf.write_text(json.dumps(to_json(synthetic_verdict())))
    csv_file = tmp_path / "logits.csv"
    csv_file.write_text("name,step,cosine_similarity,verdict\nlogits,0,0.99999,pass\nlogits,1,0.9,fail\n"
                        "<img src=x onerror=alert(1)>,2,,warn\n")
    ctx = _ctx(tmp_path, {"verdict_file": str(vf), "csv": {"logits": str(csv_file)}, "title": "t"})
    out = ReportStage().run(ctx)
    html = Path(out["html"]).read_text()
    assert ctx.summary["report"]["html"] == out["html"]
    assert "compare: logits" in html and 'data-v="0.9"' in html and "<img src=x" not in html
    assert 'class="fail"' in html and "model.layers.7.mlp.down_proj/mul.0" in html


def test_report_stage_without_anything_still_writes_a_page(tmp_path):
    out = ReportStage().run(_ctx(tmp_path, {}))
    assert Path(out["html"]).read_text().startswith("<!DOCTYPE html>")


def test_report_stage_bad_verdict_file_is_a_user_error(tmp_path):
    bad = tmp_path / "v.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="verdict_file"):
        ReportStage().run(_ctx(tmp_path, {"verdict_file": str(bad)}))


def test_load_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert load_prompts(str(f), tmp_path) == ["a", "b"]
    assert load_prompts(["x"], tmp_path) == ["x"]
    f.write_text('{"text": "a"}\n')
    with pytest.raises(UserError, match=r"p.jsonl:1"):
        load_prompts(str(f), tmp_path)
    with pytest.raises(UserError, match="no prompts"):
        load_prompts([], tmp_path)


def test_badcase_ranks_prompts_by_divergence(tmp_path):
    # a wrong activation in the target: every prompt diverges; the ranking is by max KL
    prompts = tmp_path / "prompts.jsonl"
    lines = (json.dumps({"prompt": p}) for p in ("hi", "a much longer prompt here", "yo"))
    prompts.write_text("\n".join(lines))
    params = {"golden_model": "tiny-llama:layers=2", "target_model": "tiny-llama:layers=2",
              "target_patch": "../plugins/example_faults.py:wrong_act_layer_1", "prompts": str(prompts),
              "max_new_tokens": 5, "batch_size": 2}
    ctx = _ctx(tmp_path, params)
    out = BadcaseStage().run(ctx)
    rows = json.loads(Path(out["ranking_file"]).read_text())
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert rows[0]["max_kl"] >= rows[1]["max_kl"] >= rows[2]["max_kl"] > 0
    assert out["worst_prompt"] == rows[0]["prompt"] == ctx.summary["badcase"]["worst_prompt"]
    assert len(rows[0]["golden_ids"]) == 5


def test_badcase_batched_matches_unbatched_on_fp32():
    from llmflow.localize.badcase import run_badcase
    from llmflow.models import load_model

    g = load_model("tiny-llama:layers=2")
    t = load_model("tiny-llama:layers=2")
    prompts = ["one", "a longer second prompt", "3"]
    batched = {r["prompt"]: r for r in run_badcase(g, t, prompts, max_new_tokens=4, batch_size=3)}
    single = {r["prompt"]: r for r in run_badcase(g, t, prompts, max_new_tokens=4, batch_size=1)}
    for p in prompts:  # left padding must not change what is generated
        assert batched[p]["golden_ids"] == single[p]["golden_ids"]
        assert batched[p]["first_mismatch_token"] is None and batched[p]["max_kl"] < 1e-6


def test_the_bisect_reads_the_compares_first_failing_row_and_whether_it_passed():
    from llmflow.stages.bisect import _first_failing_row

    row = {"step": 3, "order": 40, "name": "model.layers.0.mlp"}
    later = {"step": 5, "order": 2, "name": "model.layers.1"}
    failing = {"levels": {"layer": {"first_fail": later}, "module": {"first_fail": row}},
               "outcome": {"status": "fail"}}
    assert _first_failing_row(failing) == {"step": 3, "name": "model.layers.0.mlp"}
    passed = {"levels": {"module": {"first_fail": None}}, "outcome": {"status": "pass"}}
    assert _first_failing_row(passed) == {}
    # nothing failed, but the compare did not cover the dumps: it says nothing of the rows
    incomplete = {"levels": {"logits": {"first_fail": None}}, "outcome": {"status": "fail"}}
    assert _first_failing_row(incomplete) is None
    assert _first_failing_row({"not": "a summary"}) is None
