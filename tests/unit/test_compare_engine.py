"""How the compare engine chooses between one process and a pool, how it batches pairs, and how a
dask chunk lost to dying workers fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmflow.compare import engine
from llmflow.compare.match import Pair
from llmflow.errors import ComputeError


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

    def library_call(a_ptr, a_bf16, b_ptr, b_bf16, n, row, threads, out_ptr, softmax) -> int:
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


@pytest.mark.parametrize("lost", ["killed", "cancelled"])
def test_a_dask_chunk_lost_to_dying_workers_fails_by_name(lost: str) -> None:
    """Workers that keep dying make a chunk's future err with KilledWorker or, once the scheduler
    has forgotten it, come back cancelled: either is a ComputeError naming the chunk, never a
    traceback or a silent gap in the rows."""
    distributed = pytest.importorskip("distributed")
    from distributed.client import FutureCancelledError

    worker = SimpleNamespace(address="tcp://127.0.0.1:1")
    error = distributed.KilledWorker("run_chunk-1", worker, 3) if lost == "killed" else \
        FutureCancelledError("run_chunk-1", reason="already forgotten")

    class Future:
        def __init__(self, chunk):
            self.chunk = chunk

        def result(self):
            if self.chunk[0].golden_step == 1:
                raise error
            return [("row", self.chunk[0].golden_step)]

        def release(self):
            pass

    class Client:
        def scatter(self, job, broadcast):
            return job

        def submit(self, fn, job, chunk, pure, retries):
            return Future(chunk)

    def pair(step):
        return SimpleNamespace(golden=SimpleNamespace(name=f"layer{step}"), targets=(), golden_step=step)

    rows = engine._dask(object(), [[pair(0)], [pair(1), pair(1)]], None, Client())
    assert next(rows) == [("row", 0)]
    with pytest.raises(ComputeError) as failed:
        next(rows)
    message = str(failed.value)
    assert message.startswith("compare: the dask workers running chunk 2 of 2 (2 pairs from step 1 layer1)")
    assert "died each time it ran" in message and message.endswith("the rows from there on are missing")
