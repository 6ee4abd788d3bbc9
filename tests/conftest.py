"""Fixtures shared by the unit and functional tests (helpers without fixtures: ``*_helpers.py``)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

#: what one test worker may hold at its peak (SmolLM2 in fp32 and bf16 with their replays, a real
#: msprobe dump): the workers started never need more memory than the machine has free
WORKER_MEMORY_GIB = 3


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _available_gib() -> float | None:
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: two workers per core, as many as the free memory holds. Much of a functional
    test's time is a CLI or script subprocess starting (imports read from disk) and writing its
    dumps, which leaves a core idle: on 2 cores, 6 functional test files took 254 s with 2 workers,
    220 s with 4."""
    free = _available_gib()
    by_memory = int(free // WORKER_MEMORY_GIB) if free is not None else _cores()
    return max(1, min(2 * _cores(), by_memory))


def _share_cores_among_workers() -> None:
    """``pytest -n N`` runs N workers on the same cores, and torch gives each of them a thread per
    core: on a 2-core machine two workers' thread pools then wait on each other's spinning threads.
    Each worker, and the CLI and script subprocesses its tests start (through OMP_NUM_THREADS),
    gets its share of the cores instead. A run with one worker keeps torch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers <= 1:
        return
    share = max(1, _cores() // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_cores_among_workers()


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state: data a test draws without a seed of its own
    is the same on every run, so an unlucky draw cannot make a test fail one run in a hundred."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(params=["thread", "inline"])
def writer_mode(request, monkeypatch):
    """Both ways of writing a dump: a background thread, or in the forward thread at step ends."""
    monkeypatch.setenv("LLMFLOW_DUMP_WRITER", request.param)
    return request.param


@pytest.fixture(params=["batches", "small batches"])
def batches(request, monkeypatch):
    """The dump writer's default batches, or batches of a few KiB: a fence every 2 KiB of copies
    and data files written at those fences, the mid-step path a big model's dump takes."""
    if request.param == "small batches":
        import functools

        from llmflow.dump import capture
        from llmflow.dump.writer import AsyncWriter

        monkeypatch.setattr(capture, "AsyncWriter", functools.partial(AsyncWriter, batch_bytes=4096,
                                                                      wake_bytes=2048))
    return request.param


@pytest.fixture
def keepers(monkeypatch) -> list:
    """The dumps' ``copies.TensorKeeper``s, as the sessions make them, with the writer inline
    (where a dump may hold tensors instead of copying them)."""
    from llmflow.dump import copies

    monkeypatch.setenv("LLMFLOW_DUMP_WRITER", "inline")
    made = []
    init = copies.TensorKeeper.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(copies.TensorKeeper, "__init__", record)
    return made
