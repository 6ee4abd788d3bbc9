"""The verdict's three answers from synthetic evidence: a fault, a pass, and each way the evidence
can fall short (inconclusive, with the reason and what to run next)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from llmflow.localize.conclude import StepReplay, conclude
from llmflow.localize.rank import pick_candidate, rank_modules
from llmflow.results.codec import to_json
from llmflow.results.verdict import OpLevel, OpRef, OverflowOp, TokenRow


@dataclass
class Inputs:
    golden_ids: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    target_ids: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    golden_spec: dict = field(default_factory=lambda: {"model": "m", "dtype": "float32", "device": "cpu"})
    target_spec: dict = field(default_factory=lambda: {"model": "m", "dtype": "bfloat16", "device": "cpu"})
    ratio_threshold: float = 3.0
    replay_step: int | None = None
    top_k: int = 15


def replay(step: int = 0, bad: dict[str, float] | None = None, unreplayable: int = 0) -> StepReplay:
    errors = {f"model.layers.{i}.mlp.down_proj": 0.004 + 0.0002 * i for i in range(6)} | (bad or {})
    rows = [{"name": name, "replayable": True, "rel_l2": err} for name, err in errors.items()]
    rows += [{"name": f"model.layers.{i}.self_attn", "replayable": False,
              "reason": "input 1 is an opaque Foo"} for i in range(unreplayable)]
    s = StepReplay(step=step, why="test", source="dump", rows=rows)
    s.ranked = rank_modules(s.replayed)
    s.candidate = pick_candidate(s.ranked)
    return s


def verdict(tried, mismatch=None, bad_token=None, problems=(), inp=None):
    return conclude(inp or Inputs(), tried, tried[0] if not any(t.anomalous for t in tried)
                    else next(t for t in tried if t.anomalous), rows=[], mismatch=mismatch,
                    bad_token=bad_token, stack=None, decode=str, dtype="bfloat16", device="cpu",
                    problems=list(problems))


def test_a_module_that_stands_out_is_the_fault():
    v = verdict([replay(2, bad={"model.layers.4.mlp.down_proj": 0.5})], mismatch=3, bad_token=2)
    assert v.status == "fail" and v.first_bad_module == "model.layers.4.mlp.down_proj"
    assert v.first_bad_layer == "model.layers.4" and "decode step 2" in v.headline


def test_matching_tokens_and_nothing_standing_out_passes():
    v = verdict([replay(0), replay(1)])
    assert v.status == "pass" and "matches" in v.headline and v.inconclusive is None


def test_a_decode_step_tried_whose_modules_could_not_be_replayed_is_no_pass():
    """The prefill shows nothing and decode step 1, where a fault on the decode path alone shows,
    could not replay its attentions: never "no fault" for modules nobody ran there."""
    decode = replay(1, unreplayable=2)
    decode.source = "target dump"
    v = verdict([replay(0), decode])
    assert v.status == "inconclusive", v.headline
    assert v.inconclusive.reason.startswith("2 module(s) could not be replayed at decode step 1: 2x input 1 "
                                            "is an opaque Foo (e.g. model.layers.0.self_attn)")
    assert "isolate: target_model" in v.inconclusive.next


def test_a_layer_standing_out_at_the_decode_step_tried_is_the_step_chosen():
    """From a target dump a layer replayed whole that stands out where none of its modules does is a
    lead: the step where it does is the one the verdict speaks of."""
    from llmflow.localize.conclude import stands_out

    quiet, lead = replay(0), replay(1)
    lead.layer_errors = {f"model.layers.{i}": 0.004 for i in range(5)} | {"model.layers.2": 0.2}
    lead.source = "target dump"
    assert not stands_out(quiet, 3.0) and stands_out(lead, 3.0)
    v = conclude(Inputs(), [quiet, lead], lead, rows=[], mismatch=None, bad_token=None, stack=None,
                 decode=str, dtype="bfloat16", device="cpu", problems=[])
    assert v.status == "inconclusive" and v.inconclusive.reason.startswith(
        "model.layers.2, replayed whole from the target dump, has 50x the own error of the other layers at "
        "decode step 1"), v.headline


def test_texts_that_part_with_nothing_standing_out_is_rounding():
    inp = Inputs(target_ids=[1, 2, 9, 9])
    v = verdict([replay(2), replay(0)], mismatch=2, inp=inp)
    assert v.status == "pass" and "rounding" in v.diagnosis


def test_no_module_replayed_is_inconclusive():
    s = StepReplay(step=0, why="test", source="dump",
                   rows=[{"name": "model.layers.0.mlp", "replayable": False, "reason": "no inputs recorded"}])
    v = verdict([s])
    assert v.status == "inconclusive" and "no module could be replayed" in v.inconclusive.reason
    assert "no inputs recorded" in v.inconclusive.reason and v.inconclusive.next
    assert v.replay.reasons == {"no inputs recorded": ["model.layers.0.mlp"]}


PORT = {"model": "m", "dtype": "bfloat16", "device": "cpu", "patch": "port.py:fused_kernels"}


def test_failing_logits_with_nothing_standing_out_is_inconclusive_not_rounding():
    v = verdict([replay(3), replay(0)], mismatch=5, bad_token=3,
                inp=Inputs(target_ids=[1, 2, 3, 4, 5, 9], target_spec=PORT))
    assert v.status == "inconclusive" and "rounding" not in v.diagnosis
    assert "step 3" in v.inconclusive.reason and "replay_step" in v.inconclusive.next


@dataclass
class WithCompare(Inputs):
    compare_first_fail: dict | None = None


@pytest.mark.parametrize(("bad_token", "row", "says", "next_says"), [
    (0, None, "the fault may live in a module the replay cannot isolate", None),
    (3, None, "in state carried between steps (a KV cache written wrong at earlier steps)", None),
    (0, {"step": 0, "name": "logits"}, "the compare's first failing row is the logits at step 0: every "
     "module's output before them passes", "final_logit_softcapping"),
    (0, {"step": 0, "name": "model.layers.0"}, "the compare's first failing row is model.layers.0 at step 0, "
     "yet no module replayed on the golden inputs errs beyond its peers: what the model's forward hands it "
     "differs (an attention mask, a sliding window, positions)", "sliding_window"),
    (3, {"step": 3, "name": "model.layers.2"}, "positions, or at a decode step the KV cache it reads)",
     "compare what model.layers.2 is handed at step 3"),
    (0, {"step": 2, "name": "model.layers.0"}, "the fault may live in a module", None),  # (after: not it)
])
def test_failing_logits_with_nothing_standing_out_say_where_the_compare_saw_the_error(bad_token, row, says,
                                                                                       next_says):
    """At the prefill nothing was carried from an earlier step; the compare's first failing row, at or
    before the failing step, says where to look (the logits alone: the forward after the last module;
    a layer whose modules are right on the golden inputs: what it is handed)."""
    tried = [replay(bad_token)] + ([replay(0)] if bad_token else [replay(1)])
    inp = WithCompare(target_ids=[1, 2, 3, 4, 5, 9], target_spec=PORT, compare_first_fail=row)
    v = verdict(tried, mismatch=5, bad_token=bad_token, inp=inp)
    reason = v.inconclusive.reason
    assert v.status == "inconclusive" and says in reason, reason
    # (the places a fault may hide, a KV cache only after the prefill, where the compare names none)
    assert ("KV cache written wrong" in reason) == (bad_token > 0 and row is None), reason
    if next_says:
        assert next_says in v.inconclusive.next, v.inconclusive.next


def test_a_lead_of_no_error_is_not_named():
    """Every module replayed without error (a fault between the modules): no "strongest lead" at
    0.0x the typical own error."""
    silent = replay(0, bad={f"model.layers.{i}.mlp.down_proj": 0.0 for i in range(6)})
    v = verdict([silent, replay(1)], mismatch=5, bad_token=0,
                inp=Inputs(target_ids=[1, 2, 3, 4, 5, 9], target_spec=PORT))
    assert v.status == "inconclusive" and "strongest lead" not in v.inconclusive.reason, v.inconclusive.reason


BF16 = {"model": "m", "dtype": "bfloat16", "device": "cpu"}


@pytest.mark.parametrize(("target", "codes", "made_so", "status"), [
    (BF16, ("threshold_fail",), True, "pass"),
    ({"model": "m", "dtype": "bfloat16"}, ("threshold_fail",), True, "pass"),  # (the device's default: cpu)
    (BF16, ("threshold_fail",), False, "inconclusive"),
    (BF16, ("nan_inf",), True, "inconclusive"),
    (BF16, ("threshold_fail", "nan_inf"), True, "inconclusive"),
    (PORT, ("threshold_fail",), True, "inconclusive"),
    ({"model": "m", "dtype": "bfloat16", "device": "npu:0"}, ("threshold_fail",), True, "inconclusive"),
    ({"model": "other", "dtype": "bfloat16", "device": "cpu"}, ("threshold_fail",), True, "inconclusive"),
    ({"model": "m", "dtype": "float32", "device": "cpu"}, ("threshold_fail",), True, "inconclusive"),
    ({"model": "m", "device": "cpu"}, ("threshold_fail",), True, "inconclusive"),  # (no dtype: float32)
    ({"model": "m", "dtype": "float64", "device": "cpu"}, ("threshold_fail",), True, "inconclusive"),
    (None, ("threshold_fail",), True, "inconclusive"),
])
def test_failing_logits_of_the_golden_model_itself_in_another_dtype_are_that_dtypes_drift(target, codes,
                                                                                          made_so, status):
    """The same model on the same device, no patch, only the dtype changed to a coarser one, and the
    dumps made so: finite logits failing the dtype's thresholds with nothing standing out are the
    dtype's own rounding (the baseline a port is measured against, which a port's inconclusive
    verdict advises running), not a loop back to that advice. Dumps not made as the specs say, a
    step's logits with NaN/Inf, another device, model or patch, the same or a finer dtype, or no
    target model stay inconclusive."""
    inp = Inputs(target_ids=[1, 2, 3, 4, 5, 9], target_spec=target)
    tried = [replay(3), replay(0)]
    rows = [TokenRow(step=3 + i, target_step=3 + i, code=code) for i, code in enumerate(codes)]
    v = conclude(inp, tried, tried[0], rows=rows, mismatch=5, bad_token=3, stack=None, decode=str,
                 dtype="bfloat16", device="cpu", problems=[], dumps_as_specs=made_so)
    assert v.status == status, v.headline
    if status == "pass":
        assert v.inconclusive is None and v.first_bad_module is None
        assert v.headline.startswith("no fault: the target is the golden model itself in bfloat16; its "
                                     "logits fail the bfloat16 thresholds at step 3"), v.headline
    else:
        assert v.inconclusive.reason.startswith("the logits fail the bfloat16 thresholds at step 3")


def test_an_overflow_in_the_golden_model_itself_in_another_dtype_is_no_drift():
    """NaN/Inf the overflow scan found in the target dump is not the dtype's drift, even where the
    target is the golden model itself."""
    inp = Inputs(target_ids=[1, 9, 9, 9])
    inp.overflow_scan = {"first_origin": {"name": "model.layers.3", "kind": "nan", "step": 0, "rank": 0}}
    v = conclude(inp, [replay(0)], replay(0), rows=[TokenRow(step=0, target_step=0, code="threshold_fail")],
                 mismatch=1, bad_token=0, stack=None, decode=str, dtype="bfloat16", device="cpu", problems=[],
                 dumps_as_specs=True)
    assert v.status == "inconclusive" and "no module overflows" in v.inconclusive.reason


def test_modules_that_could_not_be_replayed_make_it_inconclusive_and_are_named():
    v = verdict([replay(0, unreplayable=2)])
    assert v.status == "inconclusive" and "2 module(s) could not be replayed" in v.inconclusive.reason
    assert v.replay.not_replayable == 2 and "opaque Foo" in next(iter(v.replay.reasons))


def test_dumps_with_problems_never_pass():
    v = verdict([replay(0)], problems=["golden dump: rank0/data/000001.safetensors is missing"])
    assert v.status == "inconclusive" and "not whole" in v.inconclusive.reason


def test_a_fault_is_still_named_when_a_dump_has_problems():
    v = verdict([replay(0, bad={"model.layers.1.mlp.down_proj": 0.9})], problems=["target dump: torn index"])
    assert v.status == "fail" and "torn index" in v.diagnosis


def test_an_overflow_is_the_fault_and_the_curve_shows_it_at_the_top():
    s = replay(0)
    s.rows.append({"name": "model.layers.3.self_attn", "replayable": True, "rel_l2": float("inf"),
                   "nonfinite": 40, "numel": 256})
    s.rows += [{"name": f"model.layers.{i}.self_attn", "replayable": True, "rel_l2": 0.003}
               for i in (0, 1, 2, 4, 5)]
    s.ranked = rank_modules(s.replayed)
    s.candidate = pick_candidate(s.ranked)
    s.op_level = OpLevel(comparable=False, reason="the target computes this module with other ops",
                         target_ops_around=[OpRef(name="model.layers.3.self_attn/exp.0", api="exp",
                                                  shape=[1])])
    s.overflow_op = OverflowOp(name="model.layers.3.self_attn/exp.0", api="exp", dtype="float16", nan=0,
                               inf=7, numel=64, input_max_abs=21.5)
    s.first_op = "model.layers.3.self_attn/exp.0"
    v = verdict([s], mismatch=0, bad_token=0)
    assert v.status == "fail" and v.first_bad_module == "model.layers.3.self_attn"
    assert "overflows" in v.headline and "op level not comparable" in v.headline
    assert "40 of its 256" in v.diagnosis and "exp in float16" in v.diagnosis
    assert v.candidates[0].overflow and "overflow" in v.candidates[0].reason
    assert v.overflow.modules == ["model.layers.3.self_attn"]
    assert v.overflow.layers == ["model.layers.3"]
    iso = v.curves["relative L2 error"]["isolated (worst module, replay)"]
    assert iso["3"] == float("inf") and max(x for k, x in iso.items() if k != "3") < 0.01
    assert to_json(v)["curves"]["relative L2 error"]["isolated (worst module, replay)"]["3"] == "inf"


def test_an_overflow_scan_origin_is_cited():
    scan = {"first_origin": {"name": "model.layers.3", "kind": "nan", "step": 0, "rank": 0}}
    inp = Inputs(target_ids=[1, 9, 9, 9])
    inp.overflow_scan = scan
    s = replay(0)
    s.rows.append({"name": "model.layers.3.self_attn", "replayable": True, "rel_l2": float("inf"),
                   "nonfinite": 2, "numel": 8})
    s.ranked = rank_modules(s.replayed)
    s.candidate = pick_candidate(s.ranked)
    v = verdict([s], mismatch=1, bad_token=0, inp=inp)
    assert v.overflow.scan_agrees is True and "Consistent with this" in v.diagnosis
    quiet = verdict([replay(0)], mismatch=1, bad_token=0, inp=inp)
    assert quiet.status == "inconclusive" and "no module overflows" in quiet.inconclusive.reason


def test_a_fault_where_the_other_layers_have_no_own_error_is_not_a_ratio_to_zero():
    """Both sides in the same dtype (a golden run on the target's recorded inputs): the other layers'
    copies reproduce the target exactly, so the fault is named by its error, not by a ratio to 0."""
    s = StepReplay(step=0, why="test", source="dump", rows=[
        {"name": f"model.layers.{i}.mlp.down_proj", "replayable": True, "rel_l2": 0.25 if i == 3 else 0.0}
        for i in range(6)])
    s.ranked = rank_modules(s.replayed)
    s.candidate = pick_candidate(s.ranked)
    v = verdict([s], mismatch=1, bad_token=1)
    assert v.status == "fail" and v.first_bad_module == "model.layers.3.mlp.down_proj"
    assert "0.25" in v.headline and "has none" in v.headline, v.headline
    assert "x the own error" not in v.headline and "adds none" in v.diagnosis


def test_a_module_of_one_kind_faulty_where_no_other_module_errs_is_not_said_to_have_other_layers():
    """The embedding (no copy in other layers) of an fp32 target whose other modules match the golden
    exactly: its error is set against the model's other modules, not "the other layers"."""
    rows = [{"name": "model.embed_tokens", "replayable": True, "rel_l2": 2.0}]
    rows += [{"name": f"model.layers.{i}.mlp.down_proj", "replayable": True, "rel_l2": 0.0} for i in range(6)]
    s = StepReplay(step=2, why="test", source="dump", rows=rows)
    s.ranked = rank_modules(s.replayed)
    s.candidate = pick_candidate(s.ranked)
    v = verdict([s], mismatch=2, bad_token=2)
    assert v.status == "fail" and v.first_bad_module == "model.embed_tokens", v.headline
    assert "where the model's other modules have none" in v.headline, v.headline
    assert "other layers" not in v.headline


def test_a_decoder_layer_replayed_whole_stands_out_only_well_beyond_the_module_threshold():
    from llmflow.localize.conclude import LAYER_STANDOUT, StepReplay, _layer_standing_out

    step = StepReplay(step=1, why="", layer_errors={f"model.layers.{i}": 0.004 for i in range(6)})
    assert _layer_standing_out(step, LAYER_STANDOUT * 3.0) is None
    step.layer_errors["model.layers.2"] = 0.004 * 5.5  # a clean first layer reaches ~4x: not enough
    assert _layer_standing_out(step, LAYER_STANDOUT * 3.0) is None
    step.layer_errors["model.layers.4"] = 0.004 * 30
    name, ratio = _layer_standing_out(step, LAYER_STANDOUT * 3.0)
    assert name == "model.layers.4" and ratio == pytest.approx(30)
    step.layer_errors = {"model.layers.0": 0.5, "model.layers.1": 0.0, "model.layers.2": 0.0}
    assert _layer_standing_out(step, 6.0) is None  # a ratio to a median of 0 says nothing


def test_a_layer_standing_out_must_stand_out_against_its_update_alone_too():
    """Clean SmolLM2 in bf16: its busiest layer is 6x the others against output plus update but
    1.9x against its update alone, so it is not the fault; a faulty layer is both."""
    from llmflow.localize.conclude import LAYER_STANDOUT, StepReplay, _layer_standing_out

    layers = [f"model.layers.{i}" for i in range(6)]
    step = StepReplay(step=0, why="", layer_errors={n: 0.001 for n in layers} | {"model.layers.4": 0.0065},
                      layer_update_errors={n: 0.004 for n in layers} | {"model.layers.4": 0.0076})
    assert _layer_standing_out(step, LAYER_STANDOUT * 3.0) is None
    step.layer_update_errors["model.layers.4"] = 0.004 * 40
    name, ratio = _layer_standing_out(step, LAYER_STANDOUT * 3.0)
    assert name == "model.layers.4" and ratio == pytest.approx(6.5)
    step.layer_update_errors = {}  # no update known: the output-based measure alone
    assert _layer_standing_out(step, LAYER_STANDOUT * 3.0)[0] == "model.layers.4"


def test_the_same_module_standing_out_in_two_layers_names_both():
    bad = {"model.layers.1.mlp.down_proj": 0.5, "model.layers.3.mlp.down_proj": 0.5}
    v = verdict([replay(0, bad=bad)], mismatch=0, bad_token=0)
    assert v.status == "fail" and v.first_bad_module == "model.layers.1.mlp.down_proj"
    assert v.headline.endswith("; also in model.layers.3.mlp.down_proj"), v.headline
    assert "stands out in 1 more layer(s): model.layers.3.mlp.down_proj (0.5)" in v.diagnosis


@pytest.mark.parametrize(("own", "peers", "says"), [
    (0.0, 0.0, "at the prefill its own error is none, as its copies', so the fault lives on the decode path"),
    (0.15, 0.0, "stands out at the prefill too (0.15, its copies have none)"),
    (0.004, 0.004, "at the prefill its own error is 1.0x its copies' in the other layers, so the fault"),
    (0.4, 0.004, "stands out at the prefill too (0.4, 100x its copies in the other layers)"),
])
def test_the_decode_path_sentence_follows_the_prefills_own_error(own, peers, says):
    """A fault found at a decode step: whether it lives on the decode path alone is read off the
    module's own error at the prefill against its copies' (none at all counts: an fp32 target)."""
    from llmflow.localize.conclude import _decode_path
    from llmflow.results.verdict import OwnErrorStep, OwnErrorSteps

    chosen = replay(2, bad={"model.layers.4.mlp.down_proj": 0.5})
    steps = OwnErrorSteps(module="model.layers.4.mlp.down_proj", metric="rel_l2",
                          rows=[OwnErrorStep(step=0, own_error=own, peer_median=peers, peers=3)])
    assert says in _decode_path(chosen, [chosen], steps, 3.0)
    assert "not measured" in _decode_path(chosen, [chosen], None, 3.0)


class _Dump:
    """A dump reader's env.json and ranks, as ``dumps_made_as_specs`` reads them."""

    def __init__(self, device: str | None, dtype: str | None, quantization: str | None = None, ranks=(0,)):
        self._env = {"torch_settings": {"model_device": device, "model_dtype": dtype,
                                        "quantization": quantization}}
        self._ranks = list(ranks)

    def env(self):
        return self._env

    def ranks(self):
        return self._ranks


@pytest.mark.parametrize(("golden", "target", "isolation", "made_so"), [
    (_Dump("cpu", "float32"), _Dump("cpu", "bfloat16"), "target_model", True),
    (_Dump("cpu", "float32"), _Dump("npu:0", "bfloat16"), "target_model", False),  # made elsewhere
    (_Dump("cpu", "float32"), _Dump("cpu", "float16"), "target_model", False),  # not the spec's dtype
    (_Dump("cpu", "float32"), _Dump("cpu", "bfloat16", ranks=(0, 1)), "target_model", False),
    (_Dump("cpu", "float32"), _Dump("cpu", "bfloat16", quantization="w8a8"), "target_model", False),
    (_Dump("cpu", "float32"), _Dump(None, "bfloat16"), "target_model", False),  # nothing recorded
    (_Dump("cpu", "float32"), _Dump("cpu", "bfloat16"), "target_dump", False),
])
def test_the_dumps_speak_for_the_specs_only_where_they_record_what_the_specs_say(golden, target, isolation,
                                                                                 made_so):
    from llmflow.localize.bisect import dumps_made_as_specs

    assert dumps_made_as_specs(Inputs(), golden, target, isolation) is made_so
