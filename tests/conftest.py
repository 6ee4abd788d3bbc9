"""Fixtures shared by the unit and functional tests (helpers without fixtures: ``*_helpers.py``)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["thread", "inline"])
def writer_mode(request, monkeypatch):
    """Both ways of writing a dump: a background thread, or in the forward thread at step ends."""
    monkeypatch.setenv("LLMFLOW_DUMP_WRITER", request.param)
    return request.param
