"""What a bisect concludes, and the evidence behind it: ``BisectResult`` (written as verdict.json).

``status`` is one of the stage outcomes: ``fail`` (a module's own error stands out: the fault is
named), ``pass`` (the target matches, or its drift is the dtype's rounding, with every module
replayed at the step where the divergence starts and none standing out), ``inconclusive`` (the
evidence does not cover the question: ``inconclusive.reason`` says why and ``inconclusive.next``
what to run next). ``headline`` is the one line a terminal or a CI log shows; ``diagnosis`` the
paragraph a person reads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class ReplayInfo:
    """Which step was replayed, why, from which golden source, and what could not be replayed."""

    step: int
    why: str
    source: str  # "dump", "dump + layer recompute", "golden re-run"
    replayed: int = 0
    not_replayable: int = 0
    reasons: dict[str, list[str]] = field(default_factory=dict)  # reason -> module names
    steps_tried: list[int] = field(default_factory=list)
    ratio_threshold: float = 3.0
    device: str = ""
    dtype: str = ""
    golden_rerun_max_abs_diff: float | None = None


@dataclass
class Inconclusive:
    """Why the evidence does not cover the question, and what to run next."""

    reason: str
    next: str


@dataclass
class BisectResult:
    status: str
    headline: str
    diagnosis: str
    replay: ReplayInfo
    first_mismatch_token: int | None = None
    first_bad_token: int | None = None
    first_bad_layer: str | None = None
    first_bad_module: str | None = None
    first_bad_op: str | None = None
    first_bad_expert: int | None = None
    inconclusive: Inconclusive | None = None
    token_detail: dict[str, Any] = field(default_factory=dict)
    evidence: list[dict[str, Any]] = field(default_factory=list)
    texts: dict[str, Any] = field(default_factory=dict)
    curves: dict[str, Any] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    ops: list[dict[str, Any]] = field(default_factory=list)
    experts: list[dict[str, Any]] = field(default_factory=list)
    routing: list[dict[str, Any]] = field(default_factory=list)
    token_rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cost: dict[str, Any] = field(default_factory=dict)
    #: modules whose replay on finite golden inputs gives Inf/NaN, the op where the blamed one
    #: starts, the overflow scan's origin (``conclude.overflow_evidence``)
    overflow: dict[str, Any] = field(default_factory=dict)
    #: whether the blamed module's ops pair with the golden's (``ops.comparability``); None when
    #: the op level was not run
    op_level: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """verdict.json's content: every field, floats JSON cannot hold written as strings."""
        return to_json_safe(asdict(self))


def to_json_safe(obj: Any) -> Any:
    """Floats that JSON cannot hold (inf, nan) as strings; dtypes as their names."""
    if isinstance(obj, dict):
        return {str(k): to_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    return obj
