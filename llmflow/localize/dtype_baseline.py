"""How far the target's dtype alone takes the logits: the baseline a port's failing logits are read
against where no module's own error stands out.

A port whose logits fail the thresholds of its dtype at some step, with no module standing out from
its peers, may be faulty in a way a module replayed alone does not show (state carried between
steps, error spread over the layers) or may simply be that dtype on that device: a bf16 model's
logits drift from the fp32 golden's by an amount that depends on the model and the prompt, and the
thresholds cannot know it. The golden model itself, run in the target's dtype on the target's
device and teacher-forced on the golden's tokens through the same steps, is that drift with no port
in it. Where the target's logits at the failing step are within ``FACTOR`` times as far from the
golden's as the golden model's own are (relative L2 of the last position's logits, both measured
alike here), the failing logits are the dtype's own; where they are further, the port adds error of
its own, and the verdict stays inconclusive with both figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from llmflow.formats.base import DumpReader
from llmflow.localize.golden import golden_rerun
from llmflow.localize.tokens import logits_entries
from llmflow.results.verdict import DtypeBaseline, DtypeBaselineStep

#: how many times the golden model's own logits error in the target's dtype the target's may be and
#: still be that dtype's drift: a port's kernels (fused attention, another reduction order) round
#: differently from the golden model's eager ones, by well under 2x on the ports measured; a port
#: error that is not rounding adds to it
FACTOR = 2.0


def last_position(logits: torch.Tensor) -> torch.Tensor:
    """The last position's logits (float32, CPU) of a dumped or re-run step: a prefill dump may
    hold every position's."""
    flat = logits.detach().float().cpu()
    return flat.reshape(-1, flat.shape[-1])[-1] if flat.dim() > 1 else flat


def measure(golden_dump: DumpReader, target_logits: Callable[[int], torch.Tensor | None], baseline: Any, *,
            prompt_ids: list[int], golden_ids: list[int], failing: list[int], dtype: str, device: str,
            judge_dtype: str, thresholds: dict[str, Any] | None,
            on_target_device: bool = True) -> DtypeBaseline:
    """``baseline`` (the golden model loaded in the target's dtype on its device, a LoadedModel)
    re-run on the prompt through the last of the ``failing`` steps with the golden's tokens forced;
    its logits and the target's at each step against the golden dump's. It covers the target where
    every failing step is within ``FACTOR`` (a port may fail at its first step as the dtype does and
    further on through a fault of its own); ``step`` is the first it does not cover, else the first
    failing. ``target_logits(step)``: the target's logits at a golden step (its dump's, or its run on
    the golden's tokens after the texts part), None where it has none; ``judge_dtype``/``thresholds``
    judge the logits."""
    from llmflow.compare.metrics import compare_tensors
    from llmflow.compare.thresholds import judge

    last = max(failing)
    rerun = golden_rerun(baseline, prompt_ids, golden_ids, last, select=lambda name, module: False)
    g_log = logits_entries(golden_dump)
    found = DtypeBaseline(dtype=dtype, device=device, on_target_device=on_target_device, step=failing[0],
                          factor=FACTOR)
    for s, rerun_logits in enumerate(rerun.logits[: last + 1]):
        if s not in g_log:
            continue
        golden, rerun_last = last_position(golden_dump.load(g_log[s])), last_position(rerun_logits)
        own = compare_tensors(golden, rerun_last)
        target, target_rel = target_logits(s), None
        if target is not None:
            target_rel = _rel_l2(golden, last_position(target))
        found.steps.append(DtypeBaselineStep(
            step=s, target_rel_l2=target_rel, baseline_rel_l2=_rel_l2(golden, rerun_last, own),
            baseline_verdict=judge(own, judge_dtype, thresholds).verdict))
    measured = {r.step: r for r in found.steps}
    if any(s not in measured for s in failing):
        missing = next(s for s in failing if s not in measured)
        found.step, found.error = missing, f"its re-run gave no logits at step {missing}"
        return found
    judged = [measured[s] for s in failing]
    worst = next((r for r in judged if not covers(r.target_rel_l2, r.baseline_rel_l2)), None)
    found.covers = worst is None
    at = worst or judged[0]
    found.step, found.target_rel_l2, found.baseline_rel_l2 = at.step, at.target_rel_l2, at.baseline_rel_l2
    found.failing_steps = list(failing)
    return found


def _rel_l2(golden: torch.Tensor, other: torch.Tensor, metrics: dict[str, Any] | None = None) -> float | None:
    """``other``'s relative L2 distance from ``golden``, as the compare measures it (``metrics``: the
    pair's ``compare_tensors`` row, where already made); inf where ``other`` holds NaN/Inf the golden
    does not (the compare's distance leaves such elements out, which would let logits with a few NaN
    pass as close)."""
    from llmflow.compare.metrics import compare_tensors

    if other.shape == golden.shape and int((~torch.isfinite(other) & torch.isfinite(golden)).sum()):
        return math.inf
    rel = (metrics or compare_tensors(golden, other)).get("relative_euclidean_distance")
    return float(rel) if isinstance(rel, (int, float)) else None


def covers(target_rel: float | None, baseline_rel: float | None) -> bool:
    """Whether a target error of ``target_rel`` is within ``FACTOR`` times the golden model's own in
    the target's dtype (``baseline_rel``): finite both, and a baseline of 0 covers nothing."""
    if not isinstance(target_rel, float) or not isinstance(baseline_rel, float):
        return False
    if not math.isfinite(target_rel) or not math.isfinite(baseline_rel) or baseline_rel <= 0:
        return False
    return target_rel <= FACTOR * baseline_rel


def unmeasured(dtype: str, device: str, step: int, why: str, on_target_device: bool = True) -> DtypeBaseline:
    """The baseline that could not be run, and why (the verdict says so)."""
    return DtypeBaseline(dtype=dtype, device=device, on_target_device=on_target_device, step=step,
                         factor=FACTOR, error=why)


class OnDemand:
    """A baseline measured only when the verdict asks for it (a model load and a re-run), once."""

    def __init__(self, measure_it: Callable[[], DtypeBaseline | None] | None):
        self._measure, self.asked, self.value = measure_it, False, None

    def __call__(self) -> DtypeBaseline | None:
        if not self.asked and self._measure is not None:
            self.asked = True
            self.value = self._measure()
        return self.value
