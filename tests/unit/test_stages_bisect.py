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
              "max_new_tokens": 5}
    ctx = _ctx(tmp_path, params)
    out = BadcaseStage().run(ctx)
    rows = json.loads(Path(out["ranking_file"]).read_text())
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert rows[0]["max_kl"] >= rows[1]["max_kl"] >= rows[2]["max_kl"] > 0
    assert out["worst_prompt"] == rows[0]["prompt"] == ctx.summary["badcase"]["worst_prompt"]
    assert len(rows[0]["golden_ids"]) == 5


# init=0.3: peaked logits, so a fault moves the KL (at the default init every KL is ~1e-6)
PEAKED = "tiny-llama:layers=4,hidden=64,init=0.3,seed=0"
PROMPTS = ["What is 2+2?", "Hi", "Tell me about France and its history in detail, please, all of it."]


def _max_kl(patch: str | None) -> dict[str, float]:
    from llmflow.localize.badcase import run_badcase
    from llmflow.models import load_model

    g = load_model(PEAKED)
    t = load_model(PEAKED, dtype="bfloat16", patch=patch, base_dir=Path(__file__).resolve().parents[2])
    return {r["prompt"]: r["max_kl"] for r in run_badcase(g, t, PROMPTS, max_new_tokens=6)}


def test_badcase_sees_a_fault_on_the_decode_path():
    """Scored through the decoding loop (prefill, then one token against the KV cache): a fault in
    the decode kernel alone raises every prompt's KL far above the clean port's."""
    clean = _max_kl(None)
    decode = _max_kl("plugins/example_faults.py:decode_attn_scale_layer_2")
    assert all(decode[p] > 10 * clean[p] for p in PROMPTS), (clean, decode)


def test_badcase_blames_only_the_prompts_a_shape_dependent_fault_touches(tmp_path):
    """A kernel that goes wrong on calls longer than 30 positions: each prompt scored alone, the
    short prompts keep the clean port's KL (padding them to the long one's width would not)."""
    (tmp_path / "long_path.py").write_text(
        "def patch(model):\n"
        "    model.model.layers[1].mlp.register_forward_hook(\n"
        "        lambda m, a, out: out * 0.5 if out.shape[-2] > 30 else None)\n")
    clean, faulty = _max_kl(None), _max_kl(f"{tmp_path / 'long_path.py'}:patch")
    long_prompt = PROMPTS[2]
    assert faulty[long_prompt] > 10 * clean[long_prompt], (clean, faulty)
    for p in PROMPTS[:2]:
        assert faulty[p] == pytest.approx(clean[p], rel=1e-6), (p, clean, faulty)


def test_a_prompt_past_learned_positions_is_bad_input_before_any_runs():
    from llmflow.localize.badcase import run_badcase
    from llmflow.models import load_model

    gpt2 = load_model("tiny-gpt2:layers=2,hidden=64,seed=0")
    limit = gpt2.model.config.n_positions
    said = rf"badcase: prompt 2 of 2: \d+ prompt tokens \+ max_new_tokens 4 exceed the model's context " \
           rf"\(max_position_embeddings={limit}\)"
    with pytest.raises(UserError, match=said):
        run_badcase(gpt2, gpt2, ["short", "x" * (limit + 10)], max_new_tokens=4)


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
