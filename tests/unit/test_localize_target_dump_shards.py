"""How target-dump isolation joins a module's shards (``localize/target_dump.replay_module``) on
hand-made entries: a row-parallel linear whose output is all-reduced inside it, or left as
partial products for an all-reduce after it, and a column-parallel one; a mapping's shards rule
over what the shapes and values say."""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from llmflow.compare.mappings import ShardRule
from llmflow.formats.base import Entry
from llmflow.localize.target_dump import replay_module


class _Reader:
    """The one call a replay reads: ``load(entry)`` by its key."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, rank: int, kind: str, order: int, tensor: torch.Tensor) -> Entry:
        key = f"{rank}:{kind}:{order}"
        self.tensors[key] = tensor
        return Entry(step=0, rank=rank, name="proj", kind=kind, index="0", level="module", order=order,
                     dtype="float32", shape=tuple(tensor.shape), module_type="Linear", key=key)

    def load(self, entry: Entry) -> torch.Tensor:
        return self.tensors[entry.key]


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 6, bias=False)


def _golden(module: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(model=module, device=torch.device("cpu"), dtype=torch.float32)


def _rule(merge: str) -> ShardRule:
    return ShardRule(re.compile(r"proj"), merge)


def _row_parallel(reduced: bool, faulty_rank: int | None, rules: tuple[ShardRule, ...] = ()) -> dict:
    """Each rank holds half the input features and its half of the weight's columns."""
    golden = _linear()
    x = torch.randn(1, 3, 8)
    reader = _Reader()
    partial = []
    for r in (0, 1):
        w = golden.weight[:, r * 4:(r + 1) * 4] * (1.5 if r == faulty_rank else 1.0)
        partial.append(F.linear(x[..., r * 4:(r + 1) * 4], w).detach())
    total = partial[0] + partial[1]
    by_rank = {r: [reader.add(r, "input", 0, x[..., r * 4:(r + 1) * 4].clone()),
                   reader.add(r, "output", 1, total.clone() if reduced else partial[r])] for r in (0, 1)}
    return replay_module("proj", golden, by_rank, reader, _golden(golden), 0, {}, [0, 1], rules=rules)


def test_a_row_parallel_output_reduced_inside_is_the_modules_error_with_no_rank() -> None:
    clean, faulty = _row_parallel(True, None), _row_parallel(True, 1)
    assert clean["replayable"] and clean["sharding"] == "inputs concat:2, output replicated"
    assert clean["rel_l2"] < 1e-6 < 0.05 < faulty["rel_l2"]
    assert faulty["shard_rank"] is None and "row-parallel" in faulty["rank_note"]


def test_partial_products_are_summed_before_they_are_compared() -> None:
    """Left for an all-reduce after the module, the ranks' outputs differ: they are summed."""
    clean, faulty = _row_parallel(False, None), _row_parallel(False, 1)
    assert clean["sharding"] == "inputs concat:2, output sum" and clean["rel_l2"] < 1e-6
    assert faulty["sharding"] == "inputs concat:2, output sum" and faulty["rel_l2"] > 0.05
    assert faulty["shard_rank"] is None


def test_a_column_parallel_slice_names_the_rank_whose_own_error_stands_out() -> None:
    golden = _linear()
    x = torch.randn(1, 3, 8)
    reader = _Reader()
    by_rank = {}
    for r in (0, 1):
        w = golden.weight[r * 3:(r + 1) * 3] * (1.5 if r == 0 else 1.0)
        out = F.linear(x, w).detach()
        by_rank[r] = [reader.add(r, "input", 0, x.clone()), reader.add(r, "output", 1, out)]
    row = replay_module("proj", golden, by_rank, reader, _golden(golden), 0, {}, [0, 1])
    assert row["sharding"] == "inputs whole, output concat:2" and row["shard_rank"] == 0
    assert row["rank_errors"][0] > 0.3 and row["rank_errors"][1] < 1e-6


def test_a_sum_rule_sums_outputs_equal_on_every_rank() -> None:
    """All-reduced inside, yet a rule says sum: summed all the same, twice the golden."""
    row = _row_parallel(True, None, (_rule("sum"),))
    assert row["sharding"] == "inputs concat:2, output sum (shards rule)"
    assert abs(row["rel_l2"] - 1.0) < 1e-5 and row["rank_errors"] == []


def test_a_replicated_rule_compares_each_differing_copy_and_keeps_the_worst() -> None:
    """Partial products a rule calls copies: each against the whole golden output, not summed."""
    row = _row_parallel(False, None, (_rule("replicated"),))
    assert row["sharding"] == "inputs concat:2, output replicated (shards rule)"
    assert len(row["rank_errors"]) == 2 and row["rel_l2"] == max(row["rank_errors"]) > 0.1


def test_a_sum_rule_on_whole_inputs_runs_the_golden_once_against_the_sum() -> None:
    """Each rank's output is its share of the whole (an MLP dumped before its all-reduce): without a
    rule each share is taken for a copy; with a sum rule the shares are summed."""
    golden = _linear()
    x = torch.randn(1, 3, 8)
    reader = _Reader()
    whole = golden(x).detach()
    shares = (whole * 0.25, whole * 0.75)
    by_rank = {r: [reader.add(r, "input", 0, x.clone()), reader.add(r, "output", 1, shares[r].clone())]
               for r in (0, 1)}
    copies = replay_module("proj", golden, by_rank, reader, _golden(golden), 0, {}, [0, 1])
    summed = replay_module("proj", golden, by_rank, reader, _golden(golden), 0, {}, [0, 1],
                           rules=(_rule("sum"),))
    assert copies["sharding"] == "inputs whole, output replicated" and copies["rel_l2"] > 0.5
    assert summed["sharding"] == "inputs whole, output sum (shards rule)" and summed["rel_l2"] < 1e-6
