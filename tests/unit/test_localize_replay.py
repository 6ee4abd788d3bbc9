"""Isolation replay and op-level capture, on hand-made calls and a tiny Llama."""

from __future__ import annotations

import math

import torch
from torch import nn

from llmflow.dump.memory import Call, capture_calls, flatten_outputs
from llmflow.localize.calls import build_call
from llmflow.localize.ops import align_ops, capture_ops, compare_ops
from llmflow.localize.own_error import own_error
from llmflow.localize.replay import is_branch, replay_call, replay_modules
from llmflow.results.verdict import OpRef


class Kw(nn.Module):
    """A module called with positional, nested and keyword inputs (like LlamaAttention)."""

    def forward(self, x, pair, *, scale=1.0, mask=None, past_key_values=None):
        out = (x * pair[0] + pair[1]) * scale
        if mask is not None:
            out = out + mask
        return out, None


def test_build_call_rebuilds_positional_nested_and_keyword_inputs():
    x, a, b = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    call = build_call("m", [("0", x), ("1.0", a), ("1.1", b), ("kw:scale", (2.0, "float")),
                            ("kw:mask", (None, "NoneType")), ("kw:past_key_values", (None, "DynamicCache"))],
                      [("0", (x * a + b) * 2), ("1", None)], step=0)
    assert call.replayable and call.kwargs["past_key_values"] is None  # an empty cache at prefill
    assert isinstance(call.args[1], tuple) and call.args[1][1] is b
    row = replay_call(Kw(), call, device=torch.device("cpu"), dtype=torch.float32)
    assert row["replayable"] and row["rel_l2"] < 1e-6


def test_opaque_input_after_prefill_is_not_replayable():
    call = build_call("m", [("0", torch.ones(2)), ("kw:past_key_values", (None, "DynamicCache"))],
                      [("0", torch.ones(2))], step=3)
    assert not call.replayable and "DynamicCache" in call.reason
    row = replay_call(Kw(), call, device=torch.device("cpu"), dtype=torch.float32)
    assert row["replayable"] is False and "KV cache" in row["reason"]


def test_replay_failure_is_reported_not_raised():
    call = Call("m", args=[torch.ones(3)], outputs={"0": torch.ones(3)})
    row = replay_call(nn.Linear(4, 4), call, device=torch.device("cpu"), dtype=torch.float32)
    assert row["replayable"] is False and row["reason"].startswith("replay failed")


def test_own_error_and_flatten():
    g = torch.tensor([1.0, 2.0, 2.0])
    m = own_error(g, g * 1.1)
    assert math.isclose(m["rel_l2"], 0.1, rel_tol=1e-6) and m["cos_dist"] < 1e-9
    assert own_error(g, torch.ones(2))["rel_l2"] == math.inf
    assert set(flatten_outputs((g, (g, None)))) == {"0", "1.0"}


def test_branch_selection():
    assert is_branch("model.layers.3.mlp.down_proj") and is_branch("model.layers.3.self_attn")
    assert not is_branch("model.layers.3")
    assert is_branch("lm_head", nn.Linear(2, 2)) and not is_branch("model", nn.Sequential(nn.Linear(2, 2)))


def _tiny(patch=None):
    from llmflow.models import load_model
    loaded = load_model("tiny-llama:layers=3", dtype="float32" if patch is None else "bfloat16")
    if patch is not None:
        patch(loaded.model)
    return loaded


def test_capture_and_replay_tiny_llama_bf16_finds_the_wrong_epsilon():
    golden = _tiny()
    ids = torch.tensor([[256, 72, 101, 108, 108, 111]])
    calls = capture_calls(golden.model, lambda: golden.model(ids), select=is_branch)
    assert "model.layers.1.self_attn" in calls and "model.layers.1" not in calls

    def wrong_eps(model):
        model.model.layers[2].input_layernorm.variance_epsilon = 0.5

    target = _tiny(patch=wrong_eps)
    replayed = replay_modules(target.model, calls, device=target.device, dtype=target.dtype)
    rows = {r["name"]: r for r in replayed}
    assert all(r["replayable"] for r in rows.values()), [r for r in rows.values() if not r["replayable"]]
    bad = rows["model.layers.2.input_layernorm"]["rel_l2"]
    same = rows["model.layers.1.input_layernorm"]["rel_l2"]
    assert bad > 50 * same and same < 1e-2  # bf16 noise is ~2e-3; the fault is of order 1

    # op level: the add of the epsilon is the op whose own error explodes
    name = "model.layers.2.input_layernorm"
    mods_g, mods_t = dict(golden.model.named_modules()), dict(target.model.named_modules())
    g_ops = capture_ops(mods_g[name], name, calls[name], device=golden.device, dtype=golden.dtype)
    t_ops = capture_ops(mods_t[name], name, calls[name], device=target.device, dtype=target.dtype)
    assert [o.api for o in g_ops] == [o.api for o in t_ops]
    rows, first = compare_ops(g_ops, t_ops, target_dtype=target.dtype)
    assert first == f"{name}/add.0"
    assert next(r for r in rows if r.name == first).iso_score > 100


def test_align_ops_pairs_a_different_api_and_marks_extra_ops():
    class Op:
        def __init__(self, name):
            self.name, self.api = name, name.split("/")[1].split(".")[0]
    g = [Op("m/linear.0"), Op("m/silu.0"), Op("m/mul.0")]
    t = [Op("m/linear.0"), Op("m/relu.0"), Op("m/mul.0"), Op("m/mul.1")]
    pairs = [(a and a.name, b and b.name) for a, b in align_ops(g, t)]
    assert pairs == [("m/linear.0", "m/linear.0"), ("m/silu.0", "m/relu.0"), ("m/mul.0", "m/mul.0"),
                     (None, "m/mul.1")]


def test_ops_of_children_renamed_by_a_wrapper_pair_by_api_and_shape():
    """A target that wraps the module (``mlp.inner.*``) runs the golden's ops under other names:
    they pair by API and output shape, and the wrapper's own op is the one only the target runs
    (by name alone the wrapper's ``mlp/mul.0`` took the golden's ``mlp/mul.0`` and the rest stayed
    unpaired)."""
    g = [_op("mlp.gate_proj/linear.0", (1, 4, 16)), _op("mlp.act_fn/silu.0", (1, 4, 16)),
         _op("mlp.up_proj/linear.0", (1, 4, 16)), _op("mlp/mul.0", (1, 4, 16)),
         _op("mlp.down_proj/linear.0", (1, 4, 8))]
    t = [_op("mlp.inner.gate_proj/linear.0", (1, 4, 16)), _op("mlp.inner.act_fn/silu.0", (1, 4, 16)),
         _op("mlp.inner.up_proj/linear.0", (1, 4, 16)), _op("mlp.inner/mul.0", (1, 4, 16)),
         _op("mlp.inner.down_proj/linear.0", (1, 4, 8)), _op("mlp/mul.0", (1, 4, 8))]
    pairs = [(a and a.name, b and b.name) for a, b in align_ops(g, t)]
    assert pairs == [(a.name, b.name) for a, b in zip(g, t[:5], strict=True)] + [(None, "mlp/mul.0")]
    # names that pair most ops keep pairing by name (an op inserted with the golden's shape is extra)
    t2 = [_op("mlp.gate_proj/linear.0", (1, 4, 16)), _op("mlp/add.0", (1, 4, 16))] + g[1:]
    assert [(a and a.name, b and b.name) for a, b in align_ops(g, t2)][:2] == [
        ("mlp.gate_proj/linear.0", "mlp.gate_proj/linear.0"), (None, "mlp/add.0")]


def test_own_error_of_an_overflow_is_infinite_and_counted():
    golden = torch.tensor([1.0, -2.0, 3.0, float("-inf")])
    err = own_error(golden, torch.tensor([1.0, float("nan"), float("inf"), float("-inf")]))
    assert err["nonfinite"] == 2 and err["rel_l2"] == math.inf and err["cos_dist"] == math.inf
    assert err["norm"] == math.sqrt(14)  # of the golden's finite values
    same = own_error(golden[:3], golden[:3])
    assert same["nonfinite"] == 0 and same["rel_l2"] == 0.0


def _op(name: str, shape: tuple[int, ...], *inputs: torch.Tensor, output: torch.Tensor | None = None):
    from llmflow.dump.memory import OpCall
    api = name.split("/")[1].split(".")[0]
    return OpCall(name, api, getattr(torch, api, None), inputs, {},
                  output if output is not None else torch.zeros(shape))


def test_ops_that_line_up_are_comparable_with_inserted_and_swapped_ops():
    from llmflow.localize.ops import comparability
    g = [_op("m.q/linear.0", (1, 4, 8)), _op("m/silu.0", (1, 4, 8)), _op("m/mul.0", (1, 4, 8))]
    t = [_op("m.q/linear.0", (1, 4, 8)), _op("m/relu.0", (1, 4, 8)), _op("m/mul.0", (1, 4, 8)),
         _op("m/randn.0", (1, 4, 8)), _op("m/add.0", (1, 4, 8))]
    level = comparability(g, t)
    assert level.comparable and level.reason is None and level.first_difference is None


def test_a_reimplemented_module_is_not_comparable_and_its_ops_are_listed():
    from llmflow.localize.ops import comparability
    g = [_op("a.q_proj/linear.0", (1, 5, 64)), _op("a/mul.0", (1, 4, 5, 16)), _op("a/cat.0", (1, 4, 5, 16)),
         _op("a/scaled_dot_product_attention.0", (1, 4, 5, 16)), _op("a.o_proj/linear.0", (1, 5, 64))]
    t = [_op("a.q_proj/linear.0", (1, 5, 64)), _op("a/mul.0", (1, 4, 5, 8)), _op("a/cat.0", (1, 4, 5, 16)),
         _op("a/repeat_interleave.0", (1, 4, 5, 16)), _op("a/matmul.0", (1, 4, 5, 5)),
         _op("a/softmax.0", (1, 4, 5, 5)), _op("a/matmul.1", (1, 4, 5, 16)),
         _op("a.o_proj/linear.0", (1, 5, 64))]
    level = comparability(g, t)
    assert not level.comparable and "other ops than the golden" in level.reason
    assert level.first_difference == OpRef(name="a/mul.0", api="mul", shape=[1, 4, 5, 16])
    assert (level.golden_ops_paired, level.target_ops_paired) == (1, 1)
    around = [o.name for o in level.target_ops_around]
    assert around[0] == "a.q_proj/linear.0" and "a/repeat_interleave.0" in around


def test_first_overflow_op_skips_masks_and_ops_fed_an_inf():
    from llmflow.localize.ops import first_overflow_op
    scores = torch.tensor([[20.0, 3.0], [24.0, 1.0]], dtype=torch.float16)
    masked = scores.masked_fill(torch.tensor([[False, True], [False, False]]), float("-inf"))
    e = torch.exp(masked)
    ops = [_op("a/masked_fill.0", (), scores, output=masked), _op("a/exp.0", (), masked, output=e),
           _op("a/div.0", (), e, output=e / e.sum(-1, keepdim=True))]
    assert torch.isinf(e).any()
    assert first_overflow_op(ops).name == "a/exp.0"
    assert first_overflow_op(ops[:1]) is None
