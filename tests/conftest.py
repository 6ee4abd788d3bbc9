"""Fixtures shared by the unit and functional tests (helpers without fixtures: ``*_helpers.py``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


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
