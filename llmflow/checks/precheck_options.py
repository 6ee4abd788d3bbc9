"""The precheck's options and their defaults, apart from the check itself so that the CLI's help
and the stage's schema (read by ``llmflow validate``) do not import torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_FAIL_RATIO = 4.0  # a call fails when its error is this many times the benchmark's
DEFAULT_WARN_RATIO = 2.0
DEFAULT_PERTURB_RATIO = 50.0  # output moved this many times more than the inputs: ill-conditioned
DEFAULT_MIN_CHECKED = 0.5  # below this share of calls checked, the precheck is inconclusive


@dataclass
class PrecheckOptions:
    """How calls are judged (``checks/precheck.py``); ``references``: API name -> reference."""

    fail_ratio: float = DEFAULT_FAIL_RATIO
    warn_ratio: float = DEFAULT_WARN_RATIO
    min_checked: float = DEFAULT_MIN_CHECKED
    perturb: bool = False
    perturb_ratio: float = DEFAULT_PERTURB_RATIO
    references: dict[str, Callable[..., Any]] = field(default_factory=dict)
