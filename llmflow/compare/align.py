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
``missing``, never dropped silently: a target cut short, or one that generated more tokens.

A value that cannot be right is refused (``UserError``, naming the flag and the steps each dump
holds), never turned into pairs that fail on every row:

* a ``prefill_offset`` that puts every golden step onto one target step, when the golden holds
  more than one step: no engine's first folder holds the whole generation. The one exception is
  ATB's offset 1 on a golden of two steps (the prefill and the first decode step, exactly what
  ATB's first folder holds). So with N golden steps (N > 1) an offset >= max(N - 1, 2) is
  refused;
* an offset of 2 or more while the target holds, after its warm-up, at least as many steps as
  the golden: a folder for every golden step, so its first folder holds one step, not several.
  Offset 1 is always taken (ATB's; a target that generated one token more looks the same), and
  so is a larger one on a target with fewer steps than the golden (the steps it leaves unpaired
  are listed);
* a ``warmup`` that puts every golden step's target step beyond the target's last step: the
  target holds no folder after the warm-up it claims.
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
    _check_offsets(g_steps, t_steps, prefill_offset, warmup, steps)
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


def _check_offsets(g_steps: list[int], t_steps: set[int], prefill_offset: int, warmup: int,
                   steps: Iterable[int] | None) -> None:
    """Refuse a ``prefill_offset`` or ``warmup`` that cannot be right (the module docstring says
    which): in one line naming the flag and the steps each dump holds."""
    held = f"the golden dump holds steps {steps_text(g_steps)}, the target dump steps {steps_text(t_steps)}"
    n = len(g_steps)
    if n > 1 and prefill_offset >= max(n - 1, 2):
        raise UserError(
            f"--prefill-offset {prefill_offset} (prefill_offset): every golden step would pair with target "
            f"step {target_step(g_steps[-1], prefill_offset, warmup)}; {held}; the offset counts the "
            "decode steps a target's first folder holds besides the prefill (ATB: 1, else 0)")
    after_warmup = sum(1 for t in t_steps if t >= warmup)
    if prefill_offset >= 2 and n and after_warmup >= n:
        raise UserError(
            f"--prefill-offset {prefill_offset} (prefill_offset): golden steps "
            f"{steps_text(g_steps[:prefill_offset + 1])} would all pair with target step "
            f"{target_step(0, prefill_offset, warmup)}, but the target holds a step for every golden step; "
            f"{held}; the offset counts the decode steps a target's first folder holds besides the "
            "prefill (ATB: 1, else 0)")
    wanted = g_steps if steps is None else [g for g in g_steps if g in {int(s) for s in steps}]
    if not (warmup and wanted and t_steps):
        return
    # (target_step grows with the golden step: the first golden step's is the least)
    first, last = (target_step(g, prefill_offset, warmup) for g in (wanted[0], wanted[-1]))
    if first > max(t_steps):
        raise UserError(
            f"--warmup {warmup} (warmup): golden steps {steps_text(wanted)} would pair with target steps "
            f"{steps_text(range(first, last + 1))}, beyond the target's last; {held}; warmup counts the "
            "warm-up folders before the target's first step of the prompt")


def align_dumps(golden: Any, target: Any, *, prefill_offset: int = 0, warmup: int = 0,
                steps: Iterable[int] | None = None) -> dict[str, Any]:
    """``align_steps`` over two ``DumpReader``s (steps >= 0; weights have step -1)."""
    return align_steps(golden.steps(), target.steps(), prefill_offset=prefill_offset, warmup=warmup,
                       steps=steps)
