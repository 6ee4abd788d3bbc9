"""Step alignment: same index, ATB's prefill offset, warm-up folders, missing steps."""

from __future__ import annotations

import pytest

from llmflow.compare.align import align_steps, target_step
from llmflow.errors import UserError


def test_same_index() -> None:
    r = align_steps([0, 1, 2], [0, 1, 2])
    assert r["pairs"] == [{"golden_step": s, "target_step": s} for s in (0, 1, 2)]
    assert r["missing"] == []


def test_atb_prefill_offset() -> None:
    # msit's table: PyTorch 0 <-> ATB 0, 1 <-> 0, 2 <-> 1, ..., n <-> n-1
    assert [target_step(g, prefill_offset=1) for g in range(5)] == [0, 0, 1, 2, 3]
    r = align_steps(range(5), range(4), prefill_offset=1)
    assert [(p["golden_step"], p["target_step"]) for p in r["pairs"]] == [
        (0, 0),
        (1, 0),
        (2, 1),
        (3, 2),
        (4, 3),
    ]
    assert r["missing"] == []


def test_warmup_and_missing_steps() -> None:
    r = align_steps([0, 1, 2, 3], [0, 1, 2, 3, 5], warmup=1)
    assert [(p["golden_step"], p["target_step"]) for p in r["pairs"]] == [(0, 1), (1, 2), (2, 3)]
    assert {"side": "target", "golden_step": 3, "target_step": 4} in r["missing"]
    assert {"side": "golden", "target_step": 5} in r["missing"]
    assert not any(m.get("target_step") == 0 for m in r["missing"])  # the warm-up folder


def test_steps_filter_and_bad_values() -> None:
    r = align_steps([0, 1, 2], [0, 1, 2], steps=[1])
    assert r["pairs"] == [{"golden_step": 1, "target_step": 1}] and r["missing"] == []
    with pytest.raises(UserError, match="prefill_offset"):
        align_steps([0], [0], prefill_offset=-1)
