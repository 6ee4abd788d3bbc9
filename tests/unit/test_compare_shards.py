"""How a tensor-parallel target's shards join (compare/shards.py): the rule from shapes, a mapping
file's override where the shapes allow it, joined statistics, and the rank that stands out."""

from __future__ import annotations

import math
import re

import pytest
import torch

from llmflow.compare.mappings import ShardRule, glob_to_regex
from llmflow.compare.shards import join_tensors, joined_stats, merge_of, shard_errors, standout
from llmflow.formats.base import Entry


def rule(glob: str, merge: str) -> ShardRule:
    return ShardRule(re.compile(glob_to_regex(glob)), merge)


@pytest.mark.parametrize("golden,shards,merge", [
    ([1, 6, 64], [[1, 6, 32], [1, 6, 32]], "concat:2"),
    ([1, 6, 64], [[1, 6, 16]] * 4, "concat:2"),
    ([8, 64], [[4, 64], [4, 64]], "concat:0"),
    ([1, 6, 64], [[1, 6, 64], [1, 6, 64]], "replicated"),
    ([1, 6, 64], [[1, 6, 32], [1, 6, 16]], None),  # uneven shards
    ([1, 6, 64], [[1, 6, 20], [1, 6, 20]], None),  # do not add up
    ([1, 6, 64], [[1, 3, 32], [1, 3, 32]], None),  # split along two dimensions
    ([1, 6, 64], [None, [1, 6, 32]], None),
])
def test_the_shapes_give_the_rule(golden: list[int], shards: list, merge: str | None) -> None:
    assert merge_of(golden, shards) == merge


def test_a_mapping_rule_applies_where_the_shapes_allow_it() -> None:
    rules = [rule("model.layers.*.mlp.down_proj/linear.*", "sum")]
    name = "model.layers.3.mlp.down_proj/linear.0"
    assert merge_of([1, 6, 64], [[1, 6, 64]] * 2, name, rules) == "sum"  # the partial products
    assert merge_of([1, 6, 128], [[1, 6, 64]] * 2, name, rules) == "concat:2"  # its sharded input
    assert merge_of([1, 6, 64], [[1, 6, 64]] * 2, "model.norm", rules) == "replicated"


def test_tensors_and_statistics_join_as_the_golden_holds_them() -> None:
    torch.manual_seed(0)
    g = torch.randn(2, 3, 8)
    a, b = g[..., :4].clone(), g[..., 4:].clone()
    assert torch.equal(join_tensors("concat:2", [a, b]), g)
    assert torch.allclose(join_tensors("sum", [g * 0.25, g * 0.75]), g)
    stats = [{"max": float(x.max()), "min": float(x.min()), "mean": float(x.double().mean()),
              "norm": float(torch.linalg.vector_norm(x.double())), "nan": 0, "inf": 0} for x in (a, b)]
    entries = [Entry(0, r, "m", "output", "0", "module", 0, "float32", (2, 3, 4)) for r in (0, 1)]
    joined = joined_stats("concat:2", stats, entries)
    assert joined is not None
    assert joined["max"] == float(g.max()) and joined["min"] == float(g.min())
    assert math.isclose(joined["mean"], float(g.double().mean()), rel_tol=1e-12)
    assert math.isclose(joined["norm"], float(torch.linalg.vector_norm(g.double())), rel_tol=1e-12)
    assert joined_stats("sum", stats, entries) is None  # a sum's statistics are not its parts'
    assert joined_stats("replicated", stats, entries) == stats[0]


def test_the_rank_whose_own_shard_error_stands_out() -> None:
    torch.manual_seed(0)
    g = torch.randn(4, 64)
    shards = [g[:, :32].clone(), g[:, 32:] * 1.5]
    errors = shard_errors(g, "concat:1", shards)
    assert errors[0] == 0 and math.isclose(errors[1], 0.5, rel_tol=1e-6)
    assert standout(errors, [0, 1])[0] == 1
    assert standout([0.01, 0.012, 0.011, 0.009], [0, 1, 2, 3]) is None  # rounding everywhere
    assert standout([0.01, 0.5, 0.011, 0.009], [0, 1, 2, 3])[0] == 1
    assert standout([0.0, 0.0], [0, 1]) is None
    assert shard_errors(g, "sum", shards) == []


@pytest.mark.parametrize("merge", ["concat:2", "concat:0", "sum", "replicated"])
@pytest.mark.parametrize("note", ["", "; rank 1 stands out (relative distance 0.25)", "worst"])
def test_a_rows_shards_column_reads_back_as_the_join_it_says(merge: str, note: str) -> None:
    from llmflow.compare.shards import label_join, shards_label, worst_copy_note

    label = shards_label(4, merge) + (worst_copy_note(3) if note == "worst" else note)
    assert label_join(label) == (4, merge, 3 if note == "worst" else None)


@pytest.mark.parametrize("label", [None, "", 3, "4 ranks", "4 ranks, concat", "two ranks, sum",
                                   "4 ranks, sums"])
def test_a_column_that_names_no_join_reads_back_as_none(label: object) -> None:
    from llmflow.compare.shards import label_join

    assert label_join(label) is None
