"""Pair the step (token) folders of a golden and a target dump.

Both sides normally dump one folder per generation step and step ``n`` pairs with step ``n``.
Two engine habits break that, and each has a parameter:

``prefill_offset``
    Engines that put the prefill AND the first decode step into their first folder (ATB, see
    msit's "文件夹比对关系" table): with ``prefill_offset=1`` PyTorch 0 <-> ATB 0, 1 <-> 0,
    n <-> n-1. In general target step = max(golden step - prefill_offset, 0).
``warmup``
    A target whose first ``warmup`` folders are warm-up runs of the engine (not the prompt):
    they are skipped, target step = (the step above) + warmup.

Golden steps without a target step (and target steps nothing pairs with) are listed in
``missing``, never dropped silently.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmflow.errors import UserError


def steps_text(steps: Iterable[int]) -> str:
    """Steps (or ranks) as a person reads them: runs joined, ``0..4, 7``; ``none`` for none."""
    ordered = sorted(set(steps))
    runs: list[list[int]] = []
    for s in ordered:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in runs) or "none"


def target_step(golden_step: int, prefill_offset: int = 0, warmup: int = 0) -> int:
    """The target folder that holds the same token as golden folder ``golden_step``."""
    return max(golden_step - prefill_offset, 0) + warmup


def align_steps(golden_steps: Iterable[int], target_steps: Iterable[int], *, prefill_offset: int = 0,
                warmup: int = 0, steps: Iterable[int] | None = None) -> dict[str, Any]:
    """``{"pairs": [{golden_step, target_step}], "missing": [...]}`` for two lists of step ids.

    ``steps`` restricts the golden steps considered (None: all). A missing item is
    ``{"side": "target", "golden_step": g, "target_step": t}`` (the target lacks the folder a golden
    step needs) or ``{"side": "golden", "target_step": t}`` (a target folder no golden step uses;
    warm-up folders are not reported).
    """
    for name, v in (("prefill_offset", prefill_offset), ("warmup", warmup)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise UserError(f"align: {name}: expected an integer >= 0, got {v!r}")
    g_steps = sorted(set(int(s) for s in golden_steps))
    t_steps = set(int(s) for s in target_steps)
    if steps is not None:
        wanted = {int(s) for s in steps}
        g_steps = [s for s in g_steps if s in wanted]
    pairs: list[dict[str, int]] = []
    missing: list[dict[str, Any]] = []
    used: set[int] = set()
    for g in g_steps:
        t = target_step(g, prefill_offset, warmup)
        if t in t_steps:
            pairs.append({"golden_step": g, "target_step": t})
            used.add(t)
        else:
            missing.append({"side": "target", "golden_step": g, "target_step": t})
    if steps is None:
        for t in sorted(t_steps - used):
            if t >= warmup:
                missing.append({"side": "golden", "target_step": t})
    return {"pairs": pairs, "missing": missing}


def align_dumps(golden: Any, target: Any, *, prefill_offset: int = 0, warmup: int = 0,
                steps: Iterable[int] | None = None) -> dict[str, Any]:
    """``align_steps`` over two ``DumpReader``s (steps >= 0; weights have step -1)."""
    return align_steps(golden.steps(), target.steps(), prefill_offset=prefill_offset, warmup=warmup,
                       steps=steps)
