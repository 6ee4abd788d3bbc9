"""A layer whose error jumps: the row that says where a fault enters the residual stream.

A decoder's error grows from layer to layer, smoothly where only the dtype's rounding drives it:
each layer adds a little to what the layers before it passed on. A faulty layer adds much more
than its neighbours at once, yet its output may stay within the dtype's fail limits (a wrong
softmax scale in one attention layer of a bf16 model), so thresholds alone mark it warn at most,
like the bf16 rounding of the last layers, and the first failing row lands on the logits or after
the texts part.

``JumpJudge`` compares each output row of a module inside the layer stack (``model.layers.17``,
``model.layers.17.self_attn``) with the same module's row in the previous layer at the same step
(same rank and output index): a row already beyond a warn limit (``threshold_warn``) whose relative
L2 error is ``jump_ratio`` times that row's or more becomes ``error_jump`` (fail), its reason
naming the ratio and the previous layer. Rows are judged as they stream past in execution order,
so the previous layer's row of a step has always been seen; rows after the texts part
(``diverged``) ran on other inputs and are never judged. ``jump_ratio`` None or 0 turns it off.

This module imports nothing heavy: ``compare/options.py`` takes its default from here.
"""

from __future__ import annotations

from typing import Any

from llmflow.compare.codes import Code
from llmflow.compare.thresholds import finite_or_none
from llmflow.errors import UserError
from llmflow.structure import layer_index, module_type

#: The metric whose growth from layer to layer is judged: the error of the whole tensor, relative
#: to the golden's norm, so layers whose outputs differ in scale compare fairly.
JUMP_METRIC = "relative_euclidean_distance"

#: The default ``jump_ratio``, from fp32-vs-bf16 compares: a clean run's largest ratio among rows
#: beyond a warn limit was 1.4 for layer outputs and 3.8 for a layer's sub-modules (SmolLM2-135M,
#: every module dumped) and 1.2 for tiny llama, qwen2, gemma2 and gpt2 models; a faulty layer's
#: 4.4 to 43 (the demo's layer 17: 9.7 to 12.5 at every decode step before the texts part).
JUMP_RATIO = 5.0

_WARN = Code.THRESHOLD_WARN.value


def check_jump_ratio(value: Any, where: str) -> float | None:
    """``value`` as a jump ratio: None or 0 (off), else a number above 1; UserError naming ``where``."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1 \
            or finite_or_none(value) is None:
        raise UserError(f"{where}: expected 0 (off) or a ratio above 1, got {value!r}")
    return float(value)


class JumpJudge:
    """Marks the rows whose error jumps over the previous layer's (``judge``, row by row, in
    execution order)."""

    def __init__(self, ratio: float | None) -> None:
        self.ratio = ratio
        # (step, rank, module type, kind, index) -> (layer, error, name) of the last row seen
        self._last: dict[tuple[Any, ...], tuple[int, float, str]] = {}

    def judge(self, levels: tuple[str, ...], row: dict[str, Any]) -> None:
        """Record ``row``'s error (a module's output: ``levels`` holds ``module``); turn it into an
        ``error_jump`` fail when it jumps."""
        # (an input row repeats the previous module's output; an API op's error was not measured
        # against a clean run's: neither is judged)
        if not self.ratio or "module" not in levels or row.get("kind") != "output":
            return
        name = row.get("name")
        layer = layer_index(name) if isinstance(name, str) else None
        error = finite_or_none(row.get(JUMP_METRIC))
        if layer is None or error is None or not isinstance(name, str):
            return
        key = (row.get("step"), row.get("rank"), module_type(name), row.get("kind"), row.get("index"))
        previous = self._last.get(key)
        self._last[key] = (layer, error, name)
        if previous is None or previous[0] != layer - 1 or row.get("diverged") or row.get("code") != _WARN:
            return
        _, before, before_name = previous
        # (a previous error of 0 is no measure to grow from: the first inexact layer of an
        # otherwise bit-exact target passes a small error on to the next, from nothing)
        if before <= 0 or error < self.ratio * before:
            return
        jump = f"error jump: {JUMP_METRIC} {error:.3g} is {error / before:.3g}x the previous layer's " \
               f"({before_name}: {before:.3g}; jump_ratio {self.ratio:g})"
        row.update(verdict="fail", code=Code.ERROR_JUMP.value,
                   reason="; ".join(filter(None, [jump, str(row.get("reason") or "")])))
