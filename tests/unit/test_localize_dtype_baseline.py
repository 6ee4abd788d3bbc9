"""A port's failing logits read against the golden model itself in the port's dtype: within its
drift at every failing step is a pass, beyond it at one step is the port's own error (inconclusive,
both figures and that step named), and the baseline is measured only where failing logits are all
that is left to explain."""

from __future__ import annotations

import math

import pytest
import torch
from test_localize_conclude import PORT, Inputs, replay

from llmflow.localize.conclude import conclude
from llmflow.localize.dtype_baseline import FACTOR, covers, last_position, unmeasured
from llmflow.results.codec import from_json, to_json
from llmflow.results.verdict import DtypeBaseline, DtypeBaselineStep, TeacherForced, TokenRow, Verdict


@pytest.mark.parametrize(("target", "baseline", "covered"), [
    (0.010, 0.006, True),
    (0.012, 0.006, True),  # (exactly FACTOR times)
    (0.0121, 0.006, False),
    (0.004, 0.006, True),  # (a port rounding less than the golden's eager kernels)
    (0.01, 0.0, False),  # the golden model computes as the golden: nothing to explain the drift
    (0.0, 0.0, False),
    (math.nan, 0.006, False),
    (0.01, math.inf, False),
    (math.inf, 0.006, False),
    (None, 0.006, False),
    (0.01, None, False),
])
def test_a_target_error_is_covered_within_factor_times_the_golden_models_own(target, baseline, covered):
    assert FACTOR == 2.0
    assert covers(target, baseline) is covered


def test_the_last_position_is_taken_of_a_prefill_that_holds_every_position():
    logits = torch.arange(24, dtype=torch.bfloat16).reshape(1, 3, 8)
    assert torch.equal(last_position(logits), torch.arange(16, 24, dtype=torch.float32))
    assert torch.equal(last_position(logits[:, -1]), torch.arange(16, 24, dtype=torch.float32))
    assert last_position(torch.ones(8)).shape == (8,)


def _baseline(covered: bool, step: int = 3, failing: tuple[int, ...] = (3, 4)) -> DtypeBaseline:
    target, base = (0.011, 0.009) if covered else (0.2, 0.008)
    return DtypeBaseline(dtype="bfloat16", device="cpu", step=step, failing_steps=list(failing),
                         target_rel_l2=target, baseline_rel_l2=base, covers=covered,
                         steps=[DtypeBaselineStep(step=s, target_rel_l2=target, baseline_rel_l2=base,
                                                  baseline_verdict="fail") for s in failing])


def _conclude(tried, baseline, *, bad_token=3, problems=(), inp=None, code="threshold_fail"):
    calls: list[int] = []

    def measure() -> DtypeBaseline | None:
        calls.append(1)
        return baseline

    inp = inp or Inputs(target_ids=[1, 2, 3, 4, 5, 9], target_spec=PORT)
    rows = [TokenRow(step=bad_token, target_step=bad_token, code=code, verdict="fail")]
    v = conclude(inp, tried, tried[0], rows=rows, mismatch=5, bad_token=bad_token, stack=None, decode=str,
                 dtype="bfloat16", device="cpu", problems=list(problems), dtype_baseline=measure)
    return v, len(calls)


def test_failing_logits_within_the_golden_models_own_drift_pass():
    v, calls = _conclude([replay(3), replay(0)], _baseline(True))
    assert calls == 1 and v.status == "pass" and v.inconclusive is None and v.first_bad_module is None
    assert v.headline.startswith(
        "no fault: no module stands out at decode step 3 and the prefill (step 0); the logits fail the "
        "bfloat16 thresholds at steps 3..4 no more than the golden model itself does in bfloat16 on cpu "
        "(relative L2 0.011 against its 0.009 at step 3)"), v.headline
    assert v.dtype_baseline is not None and v.dtype_baseline.covers
    back = from_json(Verdict, to_json(v))  # written to verdict.json and read back as the same type
    assert back.dtype_baseline == v.dtype_baseline


def test_failing_logits_beyond_it_at_a_later_step_are_the_ports_own_and_point_there():
    """Step 3 fails as bf16 itself does, step 4 goes far beyond: the verdict names step 4, both
    figures, and sends the user to that step, not to the first failing one."""
    v, calls = _conclude([replay(3), replay(0)], _baseline(False, step=4))
    assert calls == 1 and v.status == "inconclusive"
    reason = v.inconclusive.reason
    assert reason.startswith("the logits fail the bfloat16 thresholds at step 3"), reason
    assert ("at step 4 the target's logits are 0.2 from the golden's (relative L2), 25.0x its 0.008 for the "
            "golden model itself in bfloat16 on cpu: error of the port's own") in reason, reason
    assert "replay_step: 4" in v.inconclusive.next and "target_dtype" not in v.inconclusive.next
    assert v.dtype_baseline is not None and not v.dtype_baseline.covers


def test_a_baseline_that_could_not_run_is_said_and_the_advice_stays():
    v, _ = _conclude([replay(3), replay(0)], unmeasured("bfloat16", "cpu", 3, "OutOfMemoryError: no room"))
    assert v.status == "inconclusive"
    assert ("the golden model itself in bfloat16 on cpu could not be run to measure that dtype's own drift: "
            "OutOfMemoryError: no room") in v.inconclusive.reason


def test_no_baseline_keeps_the_inconclusive_verdict_as_it_was():
    v, calls = _conclude([replay(3), replay(0)], None)
    assert calls == 1 and v.status == "inconclusive" and v.dtype_baseline is None
    assert "golden model itself" not in v.inconclusive.reason


@pytest.mark.parametrize("case", ["problems", "standing_out", "unreplayable", "unreplayable_elsewhere",
                                  "nan_inf"])
def test_a_covering_baseline_never_hides_another_cause(case):
    """Dumps with problems, a module that stands out, modules that could not be replayed (at the
    step chosen or another tried) and logits holding NaN/Inf are judged without the baseline: it is
    not even measured (a model load and a re-run that could not change the verdict)."""
    tried = {"problems": [replay(3), replay(0)],
             "standing_out": [replay(3, bad={"model.layers.2.mlp.down_proj": 0.2}), replay(0)],
             "unreplayable": [replay(3, unreplayable=2), replay(0)],
             "unreplayable_elsewhere": [replay(3), replay(0, unreplayable=2)],
             "nan_inf": [replay(3), replay(0)]}[case]
    code = "nan_inf" if case == "nan_inf" else "threshold_fail"
    problems = ["target dump: index lines lost"] if case == "problems" else ()
    v, calls = _conclude(tried, _baseline(True), problems=problems, code=code)
    assert v.status != "pass", v.headline
    assert calls == 0 and v.dtype_baseline is None


# -- after the texts part: the target on the golden's tokens (teacher-forced) --------------------

def _parted(forced: TeacherForced | None, baseline: DtypeBaseline | None = None):
    """Texts that part at token 4 of 8 with nothing standing out at the steps replayed."""
    inp = Inputs(golden_ids=list(range(1, 9)), target_ids=[1, 2, 3, 4, 9, 9, 9, 9], target_spec=PORT)
    tried = [replay(4), replay(0)] + ([replay(forced.first_fail)] if forced and forced.first_fail else [])
    return conclude(inp, tried, tried[0], rows=[], mismatch=4, bad_token=None, stack=None, decode=str,
                    dtype="bfloat16", device="cpu", problems=[], teacher_forced=forced,
                    dtype_baseline=(lambda: baseline) if baseline is not None else None)


def test_texts_parted_by_rounding_pass_where_the_steps_after_hold_on_the_golden_tokens():
    v = _parted(TeacherForced(after=4, steps=[5, 6, 7]))
    assert v.status == "pass" and v.headline.startswith("no fault: no module stands out"), v.headline
    assert ("On the golden's tokens (teacher-forced) the target's logits stay within the thresholds at every "
            "step after the part (5..7).") in v.diagnosis
    assert from_json(Verdict, to_json(v)).teacher_forced == v.teacher_forced


def test_a_step_after_the_part_failing_on_the_golden_tokens_is_never_a_pass():
    forced = TeacherForced(after=4, steps=[5, 6, 7], failing=[6, 7], first_fail=6,
                           reason="cosine_similarity 0.5 < fail 0.98 (bfloat16)")
    v = _parted(forced, _baseline(False, step=6, failing=(6, 7)))
    assert v.status == "inconclusive", v.headline
    reason = v.inconclusive.reason
    assert reason.startswith(
        "the texts part at token 4 through bfloat16 rounding, but on the golden's tokens (teacher-forced) "
        "the target's logits fail the bfloat16 thresholds at step 6, after the part (cosine_similarity 0.5 "
        "< fail 0.98 (bfloat16))"), reason
    assert "at step 6 the target's logits are 0.2 from the golden's" in reason, reason
    assert "replay_step: 5" in v.inconclusive.next


def test_steps_before_and_after_the_part_are_each_said_where_they_ran():
    """A step failing before the texts part (the target's own text) and steps after it (on the
    golden's tokens), all within the dtype's drift: the headline tells the two apart."""
    forced = TeacherForced(after=4, steps=[5, 6, 7], failing=[6, 7], first_fail=6, reason="r")
    inp = Inputs(golden_ids=list(range(1, 9)), target_ids=[1, 2, 3, 4, 9, 9, 9, 9], target_spec=PORT)
    tried = [replay(3), replay(0), replay(6)]
    v = conclude(inp, tried, tried[0], rows=[TokenRow(step=3, target_step=3, code="threshold_fail",
                                                       verdict="fail")],
                 mismatch=4, bad_token=3, stack=None, decode=str, dtype="bfloat16", device="cpu", problems=[],
                 teacher_forced=forced, dtype_baseline=lambda: _baseline(True, step=3, failing=(3, 6, 7)))
    assert v.status == "pass", v.headline
    assert ("the logits fail the bfloat16 thresholds at step 3 and steps 6..7 (on the golden's tokens, after "
            "the texts part at token 4) no more than") in v.headline, v.headline


def test_logits_with_nan_are_never_within_the_dtypes_drift():
    """The compare's distance leaves out non-finite elements: a few NaN among close logits would
    measure close. Here they are infinitely far, never covered."""
    from llmflow.localize.dtype_baseline import _rel_l2

    golden = torch.linspace(-3, 3, 64)
    target = golden + 0.001
    assert 0 < _rel_l2(golden, target) < 0.01
    target[5] = float("nan")
    assert _rel_l2(golden, target) == math.inf and not covers(_rel_l2(golden, target), 0.01)


def test_steps_after_the_part_failing_as_the_dtype_itself_does_pass_saying_where():
    forced = TeacherForced(after=4, steps=[5, 6, 7], failing=[6, 7], first_fail=6, reason="r")
    v = _parted(forced, _baseline(True, step=6, failing=(6, 7)))
    assert v.status == "pass", v.headline
    assert ("the logits fail the bfloat16 thresholds at steps 6..7 (on the golden's tokens, after the texts "
            "part at token 4) no more than the golden model itself does in bfloat16 on cpu") in v.headline


def test_steps_after_the_part_not_checked_are_said_so():
    """From a target dump alone no step after the part runs on the golden's text: the pass says
    which steps it does not speak for."""
    v = _parted(None)
    assert v.status == "pass" and "Steps after token 4, where each side continues its own text, are not " \
                                  "checked" in v.diagnosis, v.diagnosis


@pytest.mark.parametrize(("error", "status"), [(0.018, "pass"), (0.25, "fail")])
def test_a_step_replayed_for_being_furthest_names_only_a_clear_stand_out(error, status):
    """No step after the part fails on the golden's tokens; the one furthest from the golden's is
    replayed: a module standing out a little there (4x) is held to the bar of a run where nothing
    fails, one far out (55x) is named."""
    forced = TeacherForced(after=4, steps=[5, 6, 7], furthest=6)
    inp = Inputs(golden_ids=list(range(1, 9)), target_ids=[1, 2, 3, 4, 9, 9, 9, 9], target_spec=PORT)
    late = replay(6, bad={"model.layers.2.mlp.down_proj": error})
    tried = [replay(4), replay(0), late]
    v = conclude(inp, tried, late, rows=[], mismatch=4, bad_token=None, stack=None, decode=str,
                 dtype="bfloat16", device="cpu", problems=[], teacher_forced=forced)
    assert v.status == status, v.headline
    if status == "fail":
        assert v.first_bad_module == "model.layers.2.mlp.down_proj"


# -- logits that warn, none failing: a port error too small yet to fail them ----------------------

def _warning(baseline: DtypeBaseline | None, mismatch: int | None = None, tried=None):
    """Logits that warn at steps 0..2 and fail nowhere, nothing standing out at the steps replayed."""
    if baseline is not None:
        baseline.warning, baseline.failing_steps = True, [0, 1, 2]
    ids = [1, 2, 3, 4, 5, 6]
    parted = ids if mismatch is None else ids[:mismatch] + [9] * (6 - mismatch)
    inp = Inputs(golden_ids=ids, target_ids=parted, target_spec=PORT)
    rows = [TokenRow(step=s, target_step=s, code="threshold_warn", verdict="warn") for s in range(3)]
    tried = tried or [replay(0), replay(1)]
    return conclude(inp, tried, tried[0], rows=rows, mismatch=mismatch, bad_token=None, stack=None,
                    decode=str, dtype="bfloat16", device="cpu", problems=[],
                    dtype_baseline=(lambda: baseline) if baseline is not None else None)


@pytest.mark.parametrize("mismatch", [None, 4])
def test_warning_logits_beyond_the_dtypes_drift_are_not_passed(mismatch):
    v = _warning(_baseline(False, step=0), mismatch)
    assert v.status == "inconclusive" and v.first_bad_module is None
    tokens = "the greedy tokens agree" if mismatch is None else "the texts part at token 4 and up to there"
    reason = v.inconclusive.reason
    assert reason.startswith(
        f"{tokens} and no step's logits fail the bfloat16 thresholds, but they warn at steps 0..2"), reason
    assert "25.0x its 0.008 for the golden model itself in bfloat16 on cpu" in v.inconclusive.reason
    # step 0 was replayed: what is left is the logits row against the modules' rows
    assert v.inconclusive.next.startswith("dump both sides in module mode at step 0"), v.inconclusive.next


def test_warning_logits_beyond_the_drift_at_a_step_not_replayed_point_there():
    v = _warning(_baseline(False, step=2))
    assert v.status == "inconclusive" and "--set replay_step=2" in v.inconclusive.next, v.inconclusive.next


def test_warning_logits_within_the_dtypes_drift_pass_with_both_figures():
    v = _warning(_baseline(True, step=0))
    assert v.status == "pass" and v.headline.startswith("the target matches the golden"), v.headline
    assert ("Where the logits warn (steps 0..2), they are no further from the golden's than those of the "
            "golden model itself in bfloat16 on cpu (relative L2 0.011 against its 0.009 at step 0)"
            ) in v.diagnosis, v.diagnosis


@pytest.mark.parametrize("baseline", [None, "error"])
def test_warning_logits_the_baseline_cannot_judge_stay_a_pass(baseline):
    """Within the thresholds and nothing standing out: a baseline that was not measured (a quantized
    target, a golden in the target's dtype) or could not run leaves the pass as the thresholds say."""
    measured = unmeasured("bfloat16", "cpu", 0, "OutOfMemoryError: no room") if baseline else None
    v = _warning(measured)
    assert v.status == "pass" and v.inconclusive is None, v.headline
    if baseline:
        assert "could not tell them from that dtype's own drift: OutOfMemoryError: no room" in v.diagnosis


def test_warning_logits_never_hide_a_module_standing_out():
    v = _warning(_baseline(False, step=0), tried=[replay(0, bad={"model.layers.2.mlp.down_proj": 0.2}),
                                                 replay(1)])
    assert v.status == "fail" and v.first_bad_module == "model.layers.2.mlp.down_proj"


def test_warning_logits_beyond_a_baseline_run_off_the_targets_device_stay_a_pass():
    """A target known by its dump (another device's kernels): logits within their thresholds are not
    held to the golden model's drift on the golden's device; the figures are said."""
    measured = _baseline(False, step=0)
    measured.on_target_device = False
    v = _warning(measured)
    assert v.status == "pass" and v.inconclusive is None, v.headline
    assert "which ran on another device than the target's" in v.diagnosis, v.diagnosis
