"""Run the pairs of a compare in parallel: in-process, a local process pool, or a dask cluster.

Pairs are batched into chunks (``CHUNK_PAIRS`` pairs or ``CHUNK_BYTES`` of tensor data, whichever
comes first) so that thousands of small tensors do not pay one IPC round trip each. A task is a
chunk of ``Pair``s (names, keys, shapes: a few hundred bytes each); the reply is the rows. Every
worker process receives the ``Job`` (the two readers and the options) once, at start-up, and its
readers open the dump files lazily, so peak memory is a few tensors per worker.

In-process (the local executor below the pool's threshold), chunks run in threads of their own
when there are several workers, each kernel call on its share of them (``_threaded``).

Results are yielded in the order of the pairs (execution order), whatever the executor, so the
CSV can be streamed and "the first failing row" means the first in execution order.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from llmflow import interrupts
from llmflow.compare import kernels
from llmflow.compare.match import Pair
from llmflow.compare.rows import Job, run_chunk
from llmflow.errors import ComputeError, UserError

CHUNK_PAIRS = 64
CHUNK_BYTES = 64 << 20
# A process pool spreads the per-pair Python work (index rows, loading, the row: ~150 us a pair)
# over its workers, but starting them costs ~2 s (torch's import in each); the bytes go as fast
# in-process, where chunks run in threads (the kernel releases the GIL). So a pool pays when
# pairs * PAIR_SECONDS * (1 - 1/n) > POOL_START_SECONDS: above ~27,000 pairs on 2 cores, ~15,300 on
# 8. (Measured on 2 cores: a SmolLM2 module dump's 19,480 small pairs took 3.1 s in-process and
# 7.8 s on a 2-process pool; 1 GB of 4 MiB pairs, 119 of them, is all kernel either way.)
PAIR_SECONDS = 150e-6
POOL_START_SECONDS = 2.0

Result = tuple[tuple[str, ...], dict[str, Any], int]

_JOB: Job | None = None


def chunk_pairs(pairs: list[Pair], max_pairs: int | None = None,
                max_bytes: int | None = None) -> list[list[Pair]]:
    """Consecutive chunks of at most ``max_pairs`` pairs and about ``max_bytes`` of data."""
    max_pairs = max_pairs or CHUNK_PAIRS
    max_bytes = max_bytes or CHUNK_BYTES
    chunks: list[list[Pair]] = []
    cur: list[Pair] = []
    size = 0
    for p in pairs:
        b = p.nbytes
        if cur and (len(cur) >= max_pairs or size + b > max_bytes):
            chunks.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += b
    if cur:
        chunks.append(cur)
    return chunks


def _init_worker(job: Job, parent_pid: int) -> None:
    global _JOB
    import torch

    interrupts.die_with_parent(parent_pid)  # a compare killed with kill -9 takes its workers along

    torch.set_num_threads(1)  # parallelism comes from the processes; threads would oversubscribe
    _JOB = job


def _worker_chunk(pairs: list[Pair]) -> list[Result]:
    assert _JOB is not None, "compare worker used before its initializer ran"
    return run_chunk(_JOB, pairs)


def use_pool(pairs: int, processes: int) -> bool:
    """Is a pool of ``processes`` worth starting for ``pairs`` pairs (see ``PAIR_SECONDS``)?"""
    return processes > 1 and pairs * PAIR_SECONDS * (1 - 1 / processes) > POOL_START_SECONDS


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


def execute(job: Job, pairs: list[Pair], *, executor: str = "local", workers: int | None = None,
            scheduler_address: str | None = None, client: Any = None,
            on_chunk: Callable[[int, int], None] | None = None) -> Iterator[Result]:
    """Yield ``(levels, row, bytes)`` for every pair, in order."""
    chunks = chunk_pairs(pairs)
    if executor == "dask":
        results = _dask(job, chunks, scheduler_address, client)
    elif executor == "local":
        kernels.fused()  # built here if this machine has none yet, not by every worker at once
        n = min(workers or default_workers(), len(chunks))
        results = _pool(job, chunks, n) if use_pool(len(pairs), n) else _inline(job, chunks, threads=n)
    else:
        raise UserError(f"compare: executor: expected 'local' or 'dask', got {executor!r}")
    for chunk_rows in results:
        yield from chunk_rows
        if on_chunk is not None:
            on_chunk(len(chunk_rows), sum(r[2] for r in chunk_rows))


def _inline(job: Job, chunks: list[list[Pair]], threads: int = 1) -> Iterator[list[Result]]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(threads, before))
    try:
        if threads > 1 and len(chunks) > 1:
            yield from _threaded(job, chunks, threads)
        else:
            for chunk in chunks:
                yield run_chunk(job, chunk)
    finally:
        torch.set_num_threads(before)


class KernelShare:
    """The kernel threads of each chunk running at once: ``workers`` split among the running
    chunks, asked afresh at every kernel call, so that a chunk left running alone (a large tensor
    at the end) gets them all."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._running = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1

    def threads(self) -> int:
        return max(1, self.workers // max(1, self._running))



def _in_order(submit: Callable[[list[Pair]], Future], chunks: list[list[Pair]],
              ahead: int) -> Iterator[list[Result]]:
    """Each chunk's results in the chunks' order, with at most ``ahead`` chunks submitted and not
    yet yielded: a bounded look-ahead, so finished rows wait here in order rather than all at once
    (the memory of results), and the workers never run dry."""
    pending: list[Future] = []
    it = iter(chunks)
    for chunk in it:
        pending.append(submit(chunk))
        if len(pending) >= ahead:
            break
    while pending:
        fut = pending.pop(0)
        nxt = next(it, None)
        if nxt is not None:
            pending.append(submit(nxt))
        yield interrupts.wait(fut.result, FutureTimeout)  # Ctrl-C gets through (interrupts.py)

def _threaded(job: Job, chunks: list[list[Pair]], threads: int) -> Iterator[list[Result]]:
    """Chunks in ``threads`` threads of this process, each chunk's kernel calls on its share of
    the threads (``KernelShare``).

    Why threads of their own rather than one chunk at a time with the kernel's rows in parallel:
    a pair's Python work (its row, loading, judging: ~1 ms of a 4 MiB pair) then runs while
    another pair is in the kernel (which releases the GIL), not while the cores wait; and a
    kernel call on one thread has no end-of-region barrier at which a thread spins while the
    thread it waits for is off the CPU. A row does not depend on the threads that computed it
    (each kernel row is summed by one thread, the rows merged in order), so the CSV is the same.
    """
    share = KernelShare(threads)
    stop = threading.Event()  # set when the compare ends early: the threads stop after their pair

    def run(chunk: list[Pair]) -> list[Result]:
        rows: list[Result] = []
        with share.running(), kernels.threads_from(share.threads):
            for pair in chunk:
                if stop.is_set():
                    break  # (nobody reads these rows: the compare was interrupted or failed)
                rows += run_chunk(job, [pair])
        return rows

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="llmflow-compare")
    try:
        yield from _in_order(lambda chunk: pool.submit(run, chunk), chunks, 2 * threads)
    finally:  # done, interrupted or a chunk failed: no pair starts after this
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)


def _pool(job: Job, chunks: list[list[Pair]], n: int) -> Iterator[list[Result]]:
    # spawn, not fork: a forked child of a process that already ran OpenMP regions can hang
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_init_worker,
                             initargs=(job, os.getpid())) as pool:
        try:
            yield from _in_order(lambda chunk: pool.submit(_worker_chunk, chunk), chunks, 4 * n)
        except BaseException:  # interrupted (or a chunk failed): the workers stop now, not after their chunks
            _stop_workers(pool)
            raise


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    # the executor has no public way to end busy workers before Python 3.14's terminate_workers()
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        proc.terminate()
    for proc in processes:
        proc.join(timeout=5)


def _dask(job: Job, chunks: list[list[Pair]], address: str | None, client: Any) -> Iterator[list[Result]]:
    """Each chunk a dask task; the rows come back in the pairs' order.

    A worker that dies (killed, out of memory, its machine gone) loses its tasks; the scheduler
    gives them to another worker, up to ``distributed.scheduler.allowed-failures`` times (3 by
    default). A chunk that outlives that raises ``ComputeError`` naming its pairs: a compare never
    ends with a silent gap in its rows. An exception raised inside a task (a transient read
    error on a network filesystem) is retried once on whichever worker takes it.
    """
    try:
        from dask.distributed import Client, KilledWorker
    except ImportError as exc:
        raise UserError("compare: executor 'dask' needs dask.distributed "
                        "(pip install 'llmflow[dask]')") from exc
    own = client is None
    if own:
        if not address:
            raise UserError("compare: executor 'dask' needs scheduler_address (e.g. tcp://host:8786)")
        try:
            client = Client(address, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise UserError(f"compare: cannot reach the dask scheduler at {address}: {exc}") from exc
    try:
        job_f = client.scatter(job, broadcast=True)
        futures = [client.submit(run_chunk, job_f, chunk, pure=False, retries=1) for chunk in chunks]
        for i, fut in enumerate(futures):
            try:
                yield fut.result()
            except (KilledWorker, CancelledError) as exc:
                # (a chunk whose workers keep dying either errs with KilledWorker or, once the
                # scheduler has forgotten it or the job its workers held, comes back cancelled)
                first = next((e for e in (chunks[i][0].golden, *chunks[i][0].targets) if e), None)
                how = "died each time it ran" if isinstance(exc, KilledWorker) else \
                    "lost it: the scheduler cancelled it, as it does when they died each time it ran"
                raise ComputeError(
                    f"compare: the dask workers running chunk {i + 1} of {len(chunks)} ({len(chunks[i])} "
                    f"pairs from step {chunks[i][0].golden_step} {first.name if first else '?'}) {how} "
                    f"({exc}); the rows from there on are missing") from None
            fut.release()
    finally:
        if own:
            client.close()
