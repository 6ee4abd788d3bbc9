"""A module's own error per token: an output whose norm a few tokens of massive activation carry
hides the error of every other token when measured whole; the mean token's error shows it."""

from __future__ import annotations

import pytest
import torch

from llmflow.localize.conclude import _per_token_sentence
from llmflow.localize.own_error import TOKEN_ROW_MIN, own_error, ranked_l2, relative_to_update, whole_rel
from llmflow.localize.rank import pick_candidate, rank_modules


def _massive_first_token(tokens: int = 12, width: int = 64, massive: float = 2000.0, seed: int = 0):
    """A golden output [1, tokens, width] whose first token is ``massive`` times the others'."""
    g = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(seed))
    g[0, 0] *= massive
    return g


def test_losing_every_token_but_the_massive_one_is_an_error_near_one():
    g = _massive_first_token()
    t = g.clone()
    t[0, 1:] = 0  # an int8 scale set by the first token rounds the others to its zero point
    m = own_error(g, t)
    whole = m["l2"] / m["norm"]
    assert whole < 0.01  # measured whole, the output is almost right
    assert m["token_rel"] == pytest.approx(11 / 12)
    assert m["rel_l2"] == m["token_rel"]


@pytest.mark.parametrize("shape", [(1, 12, 64), (12, 64), (2, 4, 6, 32)])
def test_tokens_that_round_alike_give_the_whole_outputs_error(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    t = g * (1 + 1e-3 * torch.randn(*shape, generator=torch.Generator().manual_seed(2)))
    m = own_error(g, t)
    assert m["token_rel"] == pytest.approx(m["l2"] / m["norm"], rel=0.2)
    assert m["l2"] == pytest.approx(float((t.double() - g.double()).norm()))
    assert m["norm"] == pytest.approx(float(g.double().norm()))


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 12, 8), (7,), ()])
def test_one_token_or_narrow_rows_are_measured_whole(shape):
    """A decode step's one token, a router's 8 expert logits per token, a vector, a scalar."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(3)) + 2.0
    m = own_error(g, g * 1.01)
    assert "token_rel" not in m
    assert m["rel_l2"] == pytest.approx(0.01, rel=1e-4)


def test_a_row_of_almost_nothing_is_floored_at_a_tenth_of_the_median_row():
    g = torch.ones(1, 10, TOKEN_ROW_MIN)
    g[0, 3] = 1e-9  # a token whose output is almost nothing, off by as much as a normal one
    t = g.clone()
    t[0, 3] += 0.01
    m = own_error(g, t)
    # 0.01 * 4 over 10 rows, that row divided by 0.1 x the median row's norm (4): 0.1 / 10
    assert m["token_rel"] == pytest.approx(0.01 * 4 / 0.4 / 10)


def test_the_ranking_finds_the_module_that_loses_its_ordinary_tokens():
    rows = []
    for layer in range(8):
        g = _massive_first_token(seed=layer)
        t = g * (1 + 3e-3 * torch.randn(g.shape, generator=torch.Generator().manual_seed(100 + layer)))
        if layer == 5:
            t[0, 1:] = 0
        rows.append({"name": f"model.layers.{layer}.mlp.down_proj", "replayable": True, **own_error(g, t)})
    ranked = rank_modules(rows)
    cand = pick_candidate(ranked)
    assert cand["name"] == "model.layers.5.mlp.down_proj" and cand["anomalous"] and cand["score"] > 50
    assert ranked_l2(cand) == pytest.approx(cand["token_rel"] * cand["norm"])
    # measured whole, the same rows show no fault
    whole = rank_modules([{k: v for k, v in r.items() if k != "token_rel"} for r in rows])
    assert not any(r["anomalous"] for r in whole)
    sentence = _per_token_sentence(cand)
    assert "the average token's output is 0.92 off" in sentence and whole_rel(cand) < 0.01


def test_a_module_that_errs_alike_in_every_token_says_nothing_per_token():
    g = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(4))
    row = {"name": "m", **own_error(g, g * 1.2)}
    assert _per_token_sentence(row) == ""


def test_an_error_against_output_plus_update_drops_the_token_mean():
    g = _massive_first_token()
    t = g.clone()
    t[0, 1:] = 0
    row = {"name": "model.layers.1", "replayable": True, **own_error(g, t)}
    moved = relative_to_update(row, update_norm=row["norm"])
    assert "token_rel" not in moved and moved["rel_l2"] == pytest.approx(row["l2"] / (2 * row["norm"]))


def test_complex_outputs_err_in_both_parts() -> None:
    """Complex angles (Llama 4's rotary) measured whole: an error in the imaginary part alone counts."""
    golden = torch.polar(torch.ones(6, 8), torch.arange(48.0).reshape(6, 8) / 10)
    target = torch.complex(golden.real, golden.imag * 1.1)
    row = own_error(golden, target)
    expected = float((golden.imag * 0.1).norm() / golden.abs().norm())
    assert row["rel_l2"] == pytest.approx(expected, rel=1e-4) and row["numel"] == 96
