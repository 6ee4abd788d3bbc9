"""How the compare engine chooses between one process and a pool, and how it batches pairs."""

from __future__ import annotations

from llmflow.compare import engine
from llmflow.compare.match import Pair


def test_a_pool_only_for_enough_pairs_to_repay_its_start() -> None:
    # a SmolLM2 module dump (19,480 pairs) ran faster in-process on 2 cores: no pool there
    assert not engine.use_pool(19_480, 2)
    assert engine.use_pool(60_000, 2)
    assert engine.use_pool(15_000, 8) and not engine.use_pool(5_000, 8)
    assert not engine.use_pool(10**7, 1)  # one process is one process


def test_chunks_keep_order_and_bounds() -> None:
    pairs = [Pair(levels=("module",), golden=None, targets=(), match=f"name {i}", golden_step=0,
                  target_step=0, rank=0) for i in range(130)]
    chunks = engine.chunk_pairs(pairs, max_pairs=64)
    assert [len(c) for c in chunks] == [64, 64, 2]
    assert [p.match for c in chunks for p in c] == [p.match for p in pairs]
