"""Where nothing fails (the texts agree, no step's logits and no compare row fail), a module that
stands out only a little is taken as rounding (``conclude.below_notice``): a tiny model's median
of 3 peer layers spreads past the 3x threshold on a clean bf16 port. Anything that fails, a
clear standout, an overflow, or no compare to say the rows pass keeps the standout a fault."""

from __future__ import annotations

from types import SimpleNamespace

from llmflow.localize.conclude import QUIET_QUANTIZED_STANDOUT, QUIET_STANDOUT, below_notice


def _inp(compare_first_fail):
    return SimpleNamespace(ratio_threshold=3.0, compare_first_fail=compare_first_fail)


def test_a_weak_standout_where_nothing_fails_is_rounding():
    assert below_notice(_inp({}), {"score": 3.04}, None, None)
    assert below_notice(_inp({}), {"score": QUIET_STANDOUT * 3.0 - 0.01}, None, None)


def test_a_standout_stays_a_fault_where_the_evidence_says_so():
    weak = {"score": 3.04}
    assert not below_notice(_inp({}), {"score": QUIET_STANDOUT * 3.0}, None, None)  # a clear one
    assert not below_notice(_inp(None), weak, None, None)  # no compare: nothing says the rows pass
    assert not below_notice(_inp({"step": 2, "name": "m"}), weak, None, None)  # a compare row fails
    assert not below_notice(_inp({}), weak, 4, None)  # the texts part
    assert not below_notice(_inp({}), weak, None, 3)  # a step's logits fail
    assert not below_notice(_inp({}), {"score": 3.04, "overflow": True}, None, None)
    assert not below_notice(_inp({}), None, None, None)


def test_a_quantized_linear_standing_out_where_nothing_fails_is_its_quantization_up_to_its_own_limit():
    quantized = {"model.layers.1.self_attn.o_proj": "W8A8"}
    honest = {"name": "model.layers.1.self_attn.o_proj", "score": 6.2}  # activation outliers
    clipped = {"name": "model.layers.1.self_attn.o_proj", "score": QUIET_QUANTIZED_STANDOUT * 3.0}
    assert below_notice(_inp({}), honest, None, None, quantized)
    assert not below_notice(_inp({}), clipped, None, None, quantized)
    assert not below_notice(_inp({}), honest, None, None)  # a float target's module: the float limit
    float_module = {"name": "model.layers.1.mlp.act_fn", "score": 6.2}  # not quantized, in a quantized model
    assert not below_notice(_inp({}), float_module, None, None, quantized)
    assert not below_notice(_inp({}), honest, 2, None, quantized)  # the texts part: never quiet
