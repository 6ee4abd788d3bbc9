"""How far a keyword input a module is handed is from its enclosing module's, and the limit a cast on
the way stays within (``localize/handed_down.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from llmflow.localize.handed_down import HANDED_DOWN_FLOORS, difference, handed_down_limit


def of(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(4, dtype=dtype)


def test_equal_tensors_differ_by_nothing() -> None:
    x = torch.tensor([1.0, -2.0, float("-inf"), 0.5])
    assert difference(x, x.clone()) == 0.0
    assert difference(torch.tensor([True, False]), torch.tensor([True, False])) == 0.0


def test_a_floating_change_is_its_relative_l2_distance() -> None:
    given = torch.tensor([3.0, 4.0])
    assert difference(torch.tensor([3.0, 4.5]), given) == pytest.approx(0.1)
    # the reshaped tensor of the same values is the same input
    assert difference(given.reshape(1, 2), given) == 0.0


def test_a_masked_position_unmasked_has_no_finite_distance_and_a_size_change_no_comparison() -> None:
    mask = torch.tensor([0.0, 0.0, float("-inf")])
    assert difference(torch.tensor([float("-inf"), 0.0, float("-inf")]), mask) == math.inf
    assert difference(torch.zeros(4), torch.zeros(3)) is None  # sliced on the way: not compared


def test_a_mask_cast_on_the_way_and_a_nan_passed_on_are_no_change() -> None:
    """fp32's lowest turns -inf in bf16 and fp16; fp16's lowest stays finite in fp32: all "masked"."""
    lowest = torch.finfo(torch.float32).min
    mask = torch.tensor([0.0, lowest, lowest, 0.0])
    assert difference(mask.bfloat16(), mask) == 0.0 and difference(mask.half(), mask) == 0.0
    half = torch.tensor([0.0, torch.finfo(torch.float16).min, 0.0, 0.0], dtype=torch.float16)
    assert difference(half.float(), half) == 0.0
    x = torch.tensor([1.0, float("nan"), 2.0])
    assert difference(x, x.clone()) == 0.0
    # finfo.min as the additive mask's "masked": a finite value, a huge distance
    lowest = torch.finfo(torch.float32).min
    assert difference(torch.tensor([lowest, 0, 0, 0]), torch.zeros(4)) == math.inf  # an all-zero mask given
    assert difference(torch.tensor([-3e38, 1.0, 1.0, 1.0]), torch.ones(4)) > 1e30


def test_integers_and_booleans_give_the_share_of_elements_changed() -> None:
    assert difference(torch.tensor([7, 8, 9, 10]), torch.tensor([6, 8, 9, 10])) == 0.25
    assert difference(torch.tensor([False, True, True, True]), torch.ones(4, dtype=torch.bool)) == 0.25


def test_the_limit_is_the_coarsest_dtypes_rounding_and_zero_for_integers() -> None:
    assert handed_down_limit(of(torch.int64), of(torch.int64), "bfloat16") == 0.0
    assert handed_down_limit(of(torch.bool), of(torch.bool), "float32") == 0.0
    assert handed_down_limit(of(torch.int8), of(torch.int8), "w8a8") == 0.0
    bf16 = handed_down_limit(of(torch.float32), of(torch.float32), "bfloat16")
    fp32 = handed_down_limit(of(torch.float32), of(torch.float32), "float32")
    assert bf16 == pytest.approx(HANDED_DOWN_FLOORS * 4e-3)
    assert fp32 == pytest.approx(HANDED_DOWN_FLOORS * 1e-6)
    # fp32 tables handed on in bf16 inside an fp32 run: the bf16 cast's rounding is within the limit
    assert handed_down_limit(of(torch.bfloat16), of(torch.float32), "float32") == bf16
    tables = torch.randn(64)
    assert difference(tables.bfloat16().float(), tables) < bf16


def test_complex_angles_differ_by_both_parts_within_a_floating_limit() -> None:
    """Llama 4's rotary hands its attention unit complex numbers: a turn is a relative distance,
    judged by a float's limit, not a share of elements changed."""
    angles = torch.polar(torch.ones(6, 8), torch.arange(48.0).reshape(6, 8) / 10)
    turned = angles * torch.polar(torch.ones(8), torch.full((8,), 0.1))
    assert difference(angles, angles.clone()) == 0.0
    turn = abs(complex(math.cos(0.1) - 1, math.sin(0.1)))
    assert difference(turned, angles) == pytest.approx(turn, rel=1e-5)
    assert handed_down_limit(turned, angles, "bfloat16") > 0
