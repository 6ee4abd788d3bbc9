"""The bisect's verdict as types: a real bisect's verdict round-trips through verdict.json and fits
the committed schema, every row type round-trips with None/inf/nan, and a verdict.json that does
not fit its type stops the report with one line naming the file and the field."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import jsonschema
import pytest

from llmflow.compare.metrics import COLUMNS
from llmflow.errors import UserError
from llmflow.results.codec import RecordError, from_json, to_json
from llmflow.results.schemas import verdict_schema
from llmflow.results.verdict import (
    Candidate,
    Cost,
    Evidence,
    ExpertRow,
    Inconclusive,
    ModelRuns,
    OpLevel,
    OpRef,
    OpRow,
    OpTensors,
    Overflow,
    OverflowOp,
    OwnErrorStep,
    OwnErrorSteps,
    ReplayInfo,
    RoutedToken,
    RoutingRow,
    ScanOrigin,
    SideText,
    Texts,
    TokenDetail,
    TokenRow,
    Verdict,
)
from llmflow.stages.base import StageContext
from llmflow.stages.report import ReportStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import make_dumps, synthetic_verdict  # noqa: E402
from workflow_helpers import assert_bad_input, llmflow, write_workflow  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "schemas" / "verdict.schema.json"
MODEL = "tiny-llama:layers=4,hidden=64,intermediate=128,seed=3"


def _through_json(obj):
    """``obj`` written as verdict.json text and read back as its type."""
    text = json.dumps(to_json(obj), allow_nan=False)
    return from_json(type(obj), json.loads(text))


def _same(a, b) -> bool:
    """Equal records, a NaN equal to a NaN (JSON text is the judge: ``"nan"`` on both sides)."""
    return json.dumps(to_json(a), sort_keys=True) == json.dumps(to_json(b), sort_keys=True)


@pytest.fixture(scope="module")
def real_verdict(tmp_path_factory) -> Verdict:
    """A real bisect of a tiny Llama whose layer 2 post-attention norm has the wrong epsilon: ranked
    candidates, evidence, ops with the op level, logits rows, cost with the full-dump estimate."""
    from llmflow.localize.bisect import BisectInputs, run_bisect

    dumps = make_dumps(tmp_path_factory.mktemp("verdict"), MODEL, max_new_tokens=3,
                       patch="plugins/example_faults.py:wrong_eps_layer_2")
    return run_bisect(BisectInputs(**dumps), log=lambda _m: None)


def test_a_real_verdict_round_trips_and_fits_the_committed_schema(real_verdict):
    v = real_verdict
    assert v.status == "fail" and v.first_bad_module == "model.layers.2.post_attention_layernorm"
    assert v.candidates and v.evidence and v.ops and v.op_level and v.token_rows and v.texts and v.curves
    assert v.own_error_steps is not None and [r.step for r in v.own_error_steps.rows] == [0, 1, 2]
    assert v.first_bad_op_tensors is None  # kept only for a caller that asks (the bisect stage)
    assert v.cost is not None and v.cost.full_api_dump_bytes_estimate and v.replay.steps_tried
    back = _through_json(v)
    assert _same(back, v)
    assert back.candidates[0].name == v.candidates[0].name and back.op_level == v.op_level
    assert isinstance(back.token_rows[0], TokenRow) and isinstance(back.cost.model_runs, ModelRuns)
    jsonschema.validate(to_json(v), json.loads(SCHEMA.read_text(encoding="utf-8")))


def test_the_committed_schema_is_the_generated_one():
    assert json.loads(SCHEMA.read_text(encoding="utf-8")) == verdict_schema()


def test_token_rows_carry_every_compare_column():
    own = {"step", "target_step", "golden_token", "golden_text", "target_token", "target_text", "same_token",
           "golden_margin", "kl", "verdict"}
    assert [f.name for f in dataclasses.fields(TokenRow) if f.name not in own] == list(COLUMNS)


def _hand_built() -> Verdict:
    """Every row type, with the values JSON cannot hold and the optional fields left empty."""
    nan, inf = math.nan, math.inf
    return Verdict(
        status="fail", headline="h", diagnosis="d",
        replay=ReplayInfo(step=2, why="w", source="golden re-run", golden_rerun_max_abs_diff=None),
        first_mismatch_token=2, first_bad_expert=1,
        inconclusive=Inconclusive(reason="r", next="n"),
        token_detail=TokenDetail(step=2, golden_margin=nan),
        evidence=[Evidence(name="m", isolated_rel_l2=inf, typical=1e-3, score=inf, raw_rel_l2=None, step=2)],
        texts=Texts(golden=SideText(label="g", text=""), target=SideText(label="t", text="x", tokens=["x"])),
        curves={"relative L2 error": {"isolated": {"3": inf, "4": nan}}},
        candidates=[Candidate(name="m", rank=1, error=inf, score=inf, anomalous=True, overflow=True,
                              nonfinite=4),
                    Candidate(name="u", replayable=False, reason=None)],
        ops=[OpRow(name="m/exp.0", golden_api=None, target_api="exp", raw=None, iso=None,
                   status="not comparable")],
        experts=[ExpertRow(expert=1, tokens=3, rel_l2=0.5, max_abs=inf, max_rel=nan, cos_dist=0.1, l2=1.0,
                           norm=2.0, numel=8, nonfinite=0, score=None)],
        routing=[RoutingRow(module="b", step=1, tokens=[RoutedToken(position=0, golden_experts=[0, 1],
                                                                    target_experts=[0, 2], text="<t>")],
                            output_error_with_target_routing=0.3, output_error_with_golden_routing=0.01,
                            detail="1 token")],
        token_rows=[TokenRow(step=0, target_step=0, cosine_similarity=nan, max_absolute_error=inf)],
        cost=Cost(model_runs=ModelRuns(2, 2, 0, 1, 10, 0), bytes_dumped=1, golden_dump_bytes=1,
                  target_dump_bytes=0),
        overflow=Overflow(modules=["m"], layers=[], nonfinite={"m": None},
                          op=OverflowOp(name="m/exp.0", api="exp", dtype="float16", nan=0, inf=3, numel=8,
                                        input_max_abs=nan),
                          scan_origin=ScanOrigin(name="m", kind="inf", step=0), scan_agrees=True),
        op_level=OpLevel(comparable=False, first_difference=OpRef(name="a", api="mul", shape=[]),
                         target_ops_around=[OpRef(name="b", api="exp", shape=[1, 2])]),
        first_bad_op_tensors=OpTensors(file="first_bad_op.safetensors", op="m/exp.0", step=2,
                                       tensors=["golden.output.0", "target.output.0"], golden_op=None,
                                       sampled=["target.output.0"], notes=["n"]),
        own_error_steps=OwnErrorSteps(module="m", metric="rel_l2",
                                      rows=[OwnErrorStep(step=0, own_error=1e-3, peer_median=None),
                                            OwnErrorStep(step=1, own_error=inf, peer_median=nan, peers=3),
                                            OwnErrorStep(step=2, own_error=None)]),
    )


def test_every_verdict_type_round_trips_with_none_inf_and_nan():
    v = _hand_built()
    back = _through_json(v)
    assert _same(back, v)
    assert back.evidence[0].isolated_rel_l2 == math.inf and math.isnan(back.overflow.op.input_max_abs)
    assert back.curves["relative L2 error"]["isolated"]["3"] == math.inf
    assert back.candidates[1].rank is None and back.overflow.nonfinite == {"m": None}
    rows = back.own_error_steps.rows
    assert rows[1].own_error == math.inf and math.isnan(rows[1].peer_median) and rows[2].own_error is None
    assert back.first_bad_op_tensors == v.first_bad_op_tensors
    for record in (v.replay, v.inconclusive, v.token_detail, v.evidence[0], v.texts, v.candidates[0],
                   v.ops[0], v.experts[0], v.routing[0], v.token_rows[0], v.cost, v.overflow, v.op_level,
                   v.first_bad_op_tensors, v.own_error_steps, v.own_error_steps.rows[1],
                   TokenDetail(), Overflow()):
        assert _same(_through_json(record), record), type(record).__name__
    jsonschema.validate(to_json(v), verdict_schema())


@pytest.mark.parametrize("damage, field", [
    (lambda d: d.__setitem__("statuz", d.pop("status")), "unknown field 'statuz'"),
    (lambda d: d.pop("headline"), "verdict.headline: missing"),
    (lambda d: d["replay"].__setitem__("step", "two"), "verdict.replay.step"),
    (lambda d: d["candidates"][0].__setitem__("score", "high"), "verdict.candidates[0].score"),
])
def test_a_verdict_file_that_does_not_fit_stops_the_report_naming_file_and_field(tmp_path, damage, field):
    data = to_json(synthetic_verdict())
    damage(data)
    path = tmp_path / "verdict.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    out = tmp_path / "report"
    out.mkdir()
    ctx = StageContext(stage_id="report", params={"verdict_file": str(path)}, out_dir=out, final_dir=out,
                       run_dir=tmp_path, workflow_dir=tmp_path, inputs={}, log=lambda _m: None)
    with pytest.raises(UserError) as err:
        ReportStage().run(ctx)
    message = str(err.value)
    assert str(path) in message and field in message and "\n" not in message
    assert not isinstance(err.value, RecordError) or "verdict_file" in message


def test_llmflow_run_on_a_corrupted_verdict_is_bad_input_naming_the_field(tmp_path):
    data = to_json(synthetic_verdict())
    data["first_bad_op"] = 3
    (tmp_path / "verdict.json").write_text(json.dumps(data), encoding="utf-8")
    wf = write_workflow(tmp_path, """
        name: report-only
        stages:
          report:
            uses: report
            with: {verdict_file: verdict.json}
        """)
    proc = llmflow("run", str(wf), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert_bad_input(proc, "verdict.json", "verdict.first_bad_op")


def test_schema_command_writes_the_verdict_schema(tmp_path):
    out = tmp_path / "verdict.schema.json"
    proc = llmflow("schema", "--kind", "verdict", "-o", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text(encoding="utf-8")) == verdict_schema()
    check = llmflow("schema", "--kind", "verdict", "-o", str(SCHEMA), "--check", cwd=tmp_path)
    assert check.returncode == 0 and "up to date" in check.stdout
