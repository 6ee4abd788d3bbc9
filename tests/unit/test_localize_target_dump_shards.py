"""How target-dump isolation joins a module's shards (``localize/target_dump.replay_module``) on
hand-made entries: a row-parallel linear whose output is all-reduced inside it, or left as
partial products for an all-reduce after it, and a column-parallel one; a mapping's shards rule
over what the shapes and values say."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
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


class _PortLinear(nn.Linear):
    """A model's own linear class (its own forward): shares found by zeroing the other slices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _linear(bias: bool = False, cls: type[nn.Linear] = nn.Linear) -> nn.Linear:
    torch.manual_seed(0)
    return cls(8, 6, bias=bias)


def _golden(module: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(model=module, device=torch.device("cpu"), dtype=torch.float32)


def _rule(merge: str) -> ShardRule:
    return ShardRule(re.compile(r"proj"), merge)


def _row_parallel(reduced: bool, faulty_rank: int | None, rules: tuple[ShardRule, ...] = (), world: int = 2,
                  bias: bool = False, cls: type[nn.Linear] = nn.Linear) -> dict:
    """Each rank holds its slice of the input features and those columns of the weight; with a
    bias, rank 0 adds it to its partial product (as vLLM's row-parallel linear does)."""
    golden = _linear(bias, cls)
    x = torch.randn(1, 3, 8)
    reader = _Reader()
    part = 8 // world
    partial = []
    for r in range(world):
        w = golden.weight[:, r * part:(r + 1) * part] * (1.5 if r == faulty_rank else 1.0)
        partial.append(F.linear(x[..., r * part:(r + 1) * part], w, golden.bias if r == 0 else None).detach())
    total = torch.stack(partial).sum(0)
    by_rank = {r: [reader.add(r, "input", 0, x[..., r * part:(r + 1) * part].clone()),
                   reader.add(r, "output", 1, total.clone() if reduced else partial[r])]
               for r in range(world)}
    return replay_module("proj", golden, by_rank, reader, _golden(golden), 0, {}, list(range(world)),
                         rules=rules)


def test_a_row_parallel_output_reduced_inside_is_the_modules_error_with_no_rank() -> None:
    clean, faulty = _row_parallel(True, None), _row_parallel(True, 1)
    assert clean["replayable"] and clean["sharding"] == "inputs concat:2, output replicated"
    assert clean["rel_l2"] < 1e-6 < 0.05 < faulty["rel_l2"]
    assert faulty["shard_rank"] is None and "row-parallel" in faulty["rank_note"]
    assert "before the all-reduce" in faulty["rank_note"]  # what would name the rank


@pytest.mark.parametrize("cls", [nn.Linear, _PortLinear])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("faulty_rank", [None, 0, 1])
def test_partial_products_name_the_rank_whose_share_is_wrong(world: int, bias: bool, faulty_rank: int | None,
                                                             cls: type[nn.Linear]) -> None:
    """Left for an all-reduce after the module, the ranks' outputs differ: summed for the module's
    error, and each compared with the golden module's output on that rank's slice alone."""
    row = _row_parallel(False, faulty_rank, world=world, bias=bias, cls=cls)
    assert row["sharding"] == "inputs concat:2, output sum"
    assert len(row["rank_errors"]) == world and row["rank_note"] is None
    assert row["shard_rank"] == faulty_rank, row["rank_errors"]
    if faulty_rank is None:
        assert row["rel_l2"] < 1e-6 and max(row["rank_errors"]) < 1e-6
    else:
        assert row["rel_l2"] > 0.05 and abs(row["rank_errors"][faulty_rank] - 0.5) < 1e-5
        assert max(e for r, e in enumerate(row["rank_errors"]) if r != faulty_rank) < 1e-6


def test_partial_products_of_a_module_not_linear_in_its_slices_name_no_rank() -> None:
    """A norm over sliced features is not the sum of its runs on each slice: no share exists."""
    golden = nn.LayerNorm(8)
    x = torch.randn(1, 3, 8)
    reader = _Reader()
    whole = golden(x).detach()
    by_rank = {r: [reader.add(r, "input", 0, x[..., r * 4:(r + 1) * 4].clone()),
                   reader.add(r, "output", 1, whole * (0.5 if r else 0.5 + 0.1))] for r in (0, 1)}
    shapes = {("proj", "0"): [1, 3, 8]}  # the golden dump's input: the slices join on the features
    row = replay_module("proj", golden, by_rank, reader, _golden(golden), 0, shapes, [0, 1])
    assert row["sharding"] == "inputs concat:2, output sum" and row["shard_rank"] is None
    assert row["rank_errors"] == [] and "not linear" in row["rank_note"]


@pytest.mark.parametrize("in_weights", [True, False])
def test_a_reduced_output_names_the_rank_whose_dumped_weight_shard_is_wrong(in_weights: bool) -> None:
    """All-reduced inside, the output is one sum; the ranks' dumped weight shards name rank 1 where
    its shard is wrong, and say the fault is not a shard where every shard matches."""
    golden = _linear()
    x = torch.randn(1, 3, 8)
    reader = _Reader()
    shards = [golden.weight[:, r * 4:(r + 1) * 4].detach() * (1.5 if r == 1 else 1.0) for r in (0, 1)]
    total = sum(F.linear(x[..., r * 4:(r + 1) * 4], shards[r]) for r in (0, 1)).detach()
    by_rank = {r: [reader.add(r, "input", 0, x[..., r * 4:(r + 1) * 4].clone()),
                   reader.add(r, "output", 1, total.clone())] for r in (0, 1)}
    dumped = shards if in_weights else [golden.weight[:, r * 4:(r + 1) * 4].detach() for r in (0, 1)]
    weights = {r: {"weight": reader.add(r, "weight", 2, dumped[r].clone())} for r in (0, 1)}
    row = replay_module("proj", golden, by_rank, reader, _golden(golden), 0, {}, [0, 1], weights=weights)
    assert row["rel_l2"] > 0.05 and row["sharding"] == "inputs concat:2, output replicated"
    if in_weights:
        assert row["shard_rank"] == 1 and row["rank_note"] is None and "weight shards" in row["rank_source"]
        assert row["rank_errors"][0] < 1e-6 and abs(row["rank_errors"][1] - 0.5) < 1e-6
    else:
        assert row["shard_rank"] is None and "match the golden's on every rank" in row["rank_note"]


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
    """All-reduced inside, yet a rule says sum: summed all the same, twice the golden; each rank's
    copy is as far from its share as the other's, so no rank is named."""
    row = _row_parallel(True, None, (_rule("sum"),))
    assert row["sharding"] == "inputs concat:2, output sum (shards rule)"
    assert abs(row["rel_l2"] - 1.0) < 1e-5 and row["shard_rank"] is None
    assert len(row["rank_errors"]) == 2 and min(row["rank_errors"]) > 0.3
    assert "no rank's departure" in row["rank_note"]


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
