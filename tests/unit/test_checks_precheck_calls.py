"""``check_call`` on calls built by hand: a call with several outputs gets a row per output
(values by the float rules, indices bit-exact), an exact op passes without a benchmark run, and
an op that writes into its inputs is replayed on copies (the recorded inputs stay as dumped)."""

from __future__ import annotations

import torch

from llmflow.checks.precheck import OpCall, PrecheckOptions, call_status, check_call, writes_inputs

g = torch.Generator().manual_seed(0)
X = torch.randn(4, 16, generator=g).to(torch.bfloat16)


def call(api: str, args: list, outputs: dict[str, torch.Tensor], **kwargs) -> OpCall:
    return OpCall(f"model.layers.0.mlp/{api}.0", api, 0, 0, 0, args=args, kwargs=kwargs, outputs=outputs)


def test_topk_has_a_row_per_output_and_wrong_indices_fail_alone():
    values, indices = torch.topk(X, 3, dim=-1)
    wrong = indices.clone()
    wrong[0, 0] = (wrong[0, 0] + 1) % 16
    rows, _ = check_call(call("topk", [X, 3], {"0": values, "1": wrong}, dim=-1), PrecheckOptions())
    assert [(r["output"], r["status"], r["dtype"]) for r in rows] == [("0", "pass", "bfloat16"),
                                                                    ("1", "fail", "int64")]
    assert rows[1]["reason"] == "1 elements differ (bit-exact rule)" and call_status(rows) == "fail"


def test_var_mean_values_are_judged_by_the_float_rules():
    var, mean = torch.var_mean(X, dim=-1)
    rows, _ = check_call(call("var_mean", [X], {"0": var, "1": mean * 1.05}, dim=-1), PrecheckOptions())
    assert [r["status"] for r in rows] == ["pass", "fail"] and rows[1]["ratio"] > 4


def test_a_one_output_call_keeps_one_row_without_output_index():
    rows, _ = check_call(call("silu", [X], {"0": torch.nn.functional.silu(X)}), PrecheckOptions())
    assert len(rows) == 1 and rows[0]["output"] is None and rows[0]["status"] == "pass"
    assert rows[0]["benchmark_error"] is not None  # inexact in bf16: the benchmark ran


def test_an_exact_op_passes_without_a_benchmark():
    rows, _ = check_call(call("transpose", [X, 0, 1], {"0": X.transpose(0, 1)}), PrecheckOptions())
    assert rows[0]["status"] == "pass" and rows[0]["error"] == 0.0 and "benchmark_error" not in rows[0]


def test_ops_that_write_into_their_inputs_are_replayed_on_copies():
    assert writes_inputs("add_", {}) and writes_inputs("__iadd__", {}) and writes_inputs("__setitem__", {})
    assert writes_inputs("relu", {"inplace": True}) and writes_inputs("add", {"out": None})
    assert not any(writes_inputs(api, {}) for api in ("add", "__add__", "__invert__", "__index__"))
    x = X.clone()
    rows, _ = check_call(call("add_", [x, 1.0], {"0": X + 1.0}), PrecheckOptions())
    assert rows[0]["status"] == "pass" and torch.equal(x, X)
    silu = torch.nn.functional.silu(X)  # (inexact in bf16: the benchmark runs on the inputs too)
    rows, _ = check_call(call("silu", [x], {"0": silu}, inplace=True), PrecheckOptions())
    assert rows[0]["status"] == "pass" and torch.equal(x, X)
