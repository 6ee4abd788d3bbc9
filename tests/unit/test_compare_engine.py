"""How the compare engine chooses between one process and a pool, and how it batches pairs."""

from __future__ import annotations

from llmflow.compare import engine
from llmflow.compare.match import Pair


def test_a_pool_only_for_enough_pairs_to_repay_its_start() -> None:
    # a SmolLM2 module dump (19,480 pairs) ran faster in-process on 2 cores: no pool there
    assert not engine.use_pool(19_480, 2)
    assert engine.use_pool(60_000, 2)
    assert engine.use_pool(16_000, 8) and not engine.use_pool(5_000, 8)
    assert not engine.use_pool(10**7, 1)  # one process is one process


def test_chunks_keep_order_and_bounds() -> None:
    pairs = [Pair(levels=("module",), golden=None, targets=(), match=f"name {i}", golden_step=0,
                  target_step=0, rank=0) for i in range(130)]
    chunks = engine.chunk_pairs(pairs, max_pairs=64)
    assert [len(c) for c in chunks] == [64, 64, 2]
    assert [p.match for c in chunks for p in c] == [p.match for p in pairs]


def test_kernel_threads_are_split_among_the_chunks_running() -> None:
    share = engine.KernelShare(4)
    assert share.threads() == 4
    with share.running():
        assert share.threads() == 4  # a chunk running alone gets every worker
        with share.running():
            assert share.threads() == 2
            with share.running():
                assert share.threads() == 1  # never less than one
        assert share.threads() == 4
    assert share.threads() == 4


def test_a_kernel_call_runs_on_the_threads_its_own_thread_was_given() -> None:
    import threading

    import torch

    from llmflow.compare import kernels

    seen: list[int] = []

    def library_call(a_ptr, a_bf16, b_ptr, b_bf16, n, row, threads, out_ptr) -> int:
        seen.append(threads)  # (the compiled function's arguments; it writes nothing here)
        return 0

    kernel = kernels._wrap(library_call)
    x = torch.ones(8)
    with kernels.threads_from(lambda: 3):
        kernel(x, x)
        # another thread keeps torch's count as that thread sees it (OpenMP's is per thread: a new
        # thread starts from the process's default, whatever the main thread was set to)
        counts: list[int] = []
        other = threading.Thread(target=lambda: (counts.append(torch.get_num_threads()), kernel(x, x)))
        other.start()
        other.join()
        with kernels.threads_from(lambda: 1):
            kernel(x, x)
        kernel(x, x)
    kernel(x, x)
    assert seen == [3, counts[0], 1, 3, torch.get_num_threads()]
