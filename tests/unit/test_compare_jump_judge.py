"""``JumpJudge`` row by row: which rows an error jump turns into a failure and which it leaves."""

from __future__ import annotations

import pytest

from llmflow.compare.jumps import JumpJudge, check_jump_ratio
from llmflow.errors import UserError


def _row(layer: int, error: float, *, step: int = 0, code: str = "threshold_warn",
         name: str = "model.layers.{}", **extra) -> dict:
    verdict = {"threshold_warn": "warn", "ok": "pass"}.get(code, "fail")
    return {"step": step, "rank": 0, "name": name.format(layer), "kind": "output", "index": "0",
            "relative_euclidean_distance": error, "code": code, "verdict": verdict, "reason": "r", **extra}


def _judged(ratio: float | None, rows: list[dict]) -> list[str]:
    judge = JumpJudge(ratio)
    for r in rows:
        judge.judge(("module",), r)
    return [r["code"] for r in rows]


def test_a_warn_row_ratio_times_the_previous_layers_fails() -> None:
    rows = [_row(0, 0.01), _row(1, 0.012), _row(2, 0.07), _row(3, 0.08)]
    assert _judged(5, rows) == ["threshold_warn", "threshold_warn", "error_jump", "threshold_warn"]
    assert rows[2]["verdict"] == "fail"
    assert rows[2]["reason"] == ("error jump: relative_euclidean_distance 0.07 is 5.83x the previous layer's "
                                 "(model.layers.1: 0.012; jump_ratio 5); r")
    assert _judged(6, [_row(0, 0.01), _row(1, 0.012), _row(2, 0.07)])[2] == "threshold_warn"
    assert _judged(None, [_row(0, 0.01), _row(1, 0.5)]) == ["threshold_warn", "threshold_warn"]


@pytest.mark.parametrize("rows", [
    [_row(0, 0.001, code="ok"), _row(1, 0.02, code="ok")],  # below every warn limit: no floor reached
    [_row(0, 0.0), _row(1, 0.05)],  # nothing to grow from
    [_row(0, 0.01), _row(2, 0.05)],  # layer 1 not compared: not the previous layer
    [_row(0, 0.01), _row(1, 0.05, diverged=True)],  # after the texts part: other inputs
    [_row(0, 0.01), _row(1, 0.05, step=1)],  # another step
    [_row(0, 0.01), _row(1, 0.05, name="model.layers.{}.mlp")],  # another module
    [_row(0, 0.01, name="lm_head"), _row(1, 0.05, name="norm")],  # outside the layer stack
    [_row(0, 0.01, kind="input"), _row(1, 0.05, kind="input")],  # an input: the previous output
])
def test_rows_an_error_jump_leaves_alone(rows: list[dict]) -> None:
    codes = [r["code"] for r in rows]
    assert _judged(5, rows) == codes


def test_api_rows_are_not_judged() -> None:
    op = "model.layers.{}.mlp/matmul.0"
    rows = [_row(0, 0.01, name=op), _row(1, 0.05, name=op)]
    judge = JumpJudge(5)
    for r in rows:
        judge.judge(("api",), r)
    assert [r["code"] for r in rows] == ["threshold_warn", "threshold_warn"]


def test_a_row_that_fails_already_keeps_its_code() -> None:
    rows = [_row(0, 0.01), _row(1, 0.9, code="threshold_fail")]
    assert _judged(5, rows) == ["threshold_warn", "threshold_fail"]


def test_the_ratio_is_checked() -> None:
    assert check_jump_ratio(None, "x") is None and check_jump_ratio(0, "x") is None
    assert check_jump_ratio(3, "x") == 3.0
    for bad in (1, 0.5, -2, float("inf"), float("nan"), "5", True):
        with pytest.raises(UserError, match=r"^x: expected 0 \(off\) or a ratio above 1, got "):
            check_jump_ratio(bad, "x")
