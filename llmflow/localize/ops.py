"""Op level: replay the chosen module on both sides with every torch API call captured.

The module named by isolation replay is run on the same golden inputs twice: by the golden model
(golden device/dtype) and by the target model (target device/dtype, with its patch). The
recorder's memory sink (``OpRecorder``) keeps every top-level torch API call inside it, named as
the dump's API mode names it (``<module path>/<api>.<n>``), with its inputs and output. The two
call sequences are aligned (same names first; a different API in the same slot, e.g. ``silu`` -> ``relu``, is
paired by position) and each target op gets:

  raw: its output against the golden op's output (carries the error of earlier ops);
  iso: the *target's* op function run on the *golden* op's tensor inputs (cast like the target's),
       against the golden output: the op's own error. A wrong scalar (an epsilon) or a wrong
       function shows up here even when its inputs are fine.

The first bad op is the first (in target order) whose own error stands out from the module's
typical op error; failing that, the first raw-error jump; failing that, the first op the target
runs that the golden does not. Captures live in memory: replay needs the op callables, which a
dump on disk cannot hold.
"""

from __future__ import annotations

import difflib
from statistics import median
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from llmflow.dump.memory import Call, OpCall, OpRecorder
from llmflow.localize.calls import cast_inputs
from llmflow.localize.rank import DEFAULT_RATIO_THRESHOLD, first_jump
from llmflow.localize.replay import own_error

#: relative error a correct op shows in each target dtype (half an ulp-ish, times a margin)
DTYPE_FLOOR = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 4e-3, torch.float16: 5e-4}


@torch.no_grad()
def capture_ops(module: nn.Module, name: str, call: Call, *, device: torch.device,
                dtype: torch.dtype) -> list[OpCall]:
    """Run ``module`` (called ``name`` in its model) on ``call``'s inputs cast to ``dtype`` on
    ``device``, recording every torch API call with the innermost running sub-module's path."""
    args = cast_inputs(call.args, device, dtype, module)
    kwargs = cast_inputs(call.kwargs, device, dtype, module)
    return OpRecorder(module, name).run(*args, **kwargs)


def _iso(target: OpCall, golden: OpCall) -> float | None:
    """The target's op on the golden op's tensor inputs; its rel_l2 error, or None if the two
    calls' tensor inputs do not line up (count or shapes)."""
    t_flat, t_spec = tree_flatten((target.args, target.kwargs))
    g_tensors = [x for x in tree_flatten((golden.args, golden.kwargs))[0] if isinstance(x, torch.Tensor)]
    t_tensors = [x for x in t_flat if isinstance(x, torch.Tensor)]
    if len(g_tensors) != len(t_tensors) or any(
            a.shape != b.shape for a, b in zip(g_tensors, t_tensors, strict=True)):
        return None
    it = iter(g_tensors)
    mixed = [next(it).to(device=x.device, dtype=x.dtype) if isinstance(x, torch.Tensor) else x
             for x in t_flat]
    args, kwargs = tree_unflatten(mixed, t_spec)
    try:
        out = target.func(*args, **kwargs)
    except Exception:  # an op that refuses the substituted inputs has no isolated error
        return None
    out = out if isinstance(out, torch.Tensor) else next(
        (x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)), None)
    if out is None or out.shape != golden.output.shape:
        return None
    return own_error(golden.output, out)["rel_l2"]


def align_ops(golden: list[OpCall], target: list[OpCall]) -> list[tuple[OpCall | None, OpCall | None]]:
    """Pairs (golden, target) in execution order; None on the side that lacks the op."""
    sm = difflib.SequenceMatcher(a=[c.name for c in golden], b=[c.name for c in target], autojunk=False)
    pairs: list[tuple[OpCall | None, OpCall | None]] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            pairs.extend(zip(golden[i1:i2], target[j1:j2], strict=True))
        else:
            pairs.extend((g, None) for g in golden[i1:i2])
            pairs.extend((None, t) for t in target[j1:j2])
    return pairs


def compare_ops(golden: list[OpCall], target: list[OpCall], *, target_dtype: torch.dtype,
                ratio: float = DEFAULT_RATIO_THRESHOLD) -> tuple[list[dict[str, Any]], str | None]:
    """One row per aligned op and the name of the first bad op (None when nothing stands out)."""
    rows: list[dict[str, Any]] = []
    last_golden: dict[tuple[int, ...], torch.Tensor] = {}
    for g, t in align_ops(golden, target):
        row: dict[str, Any] = {"name": (t or g).name, "golden_api": g.api if g else None,
                               "target_api": t.api if t else None, "raw": None, "iso": None}
        if g is not None:
            last_golden[tuple(g.output.shape)] = g.output
        if g is not None and t is not None:
            row["status"] = "matched" if g.api == t.api else "different api"
            row["raw"] = own_error(g.output, t.output)["rel_l2"] if g.output.shape == t.output.shape else None
            row["iso"] = _iso(t, g)
        elif t is not None:
            row["status"] = "only in target"
            same = last_golden.get(tuple(t.output.shape))  # the value this op rewrites, if any
            row["raw"] = own_error(same, t.output)["rel_l2"] if same is not None else None
        else:
            row["status"] = "only in golden"
        rows.append(row)
    floor = DTYPE_FLOOR.get(target_dtype, 4e-3)
    iso_rows = [r for r in rows if r["iso"] is not None]
    for r in rows:
        others = [o["iso"] for o in iso_rows if o is not r]  # leave-one-out, as for modules
        r["iso_typical"] = max(median(others) if others else 0.0, floor)
        r["iso_score"] = r["iso"] / r["iso_typical"] if r["iso"] is not None else None
    for r in rows:
        if r["iso_score"] is not None and r["iso_score"] >= ratio:
            return rows, r["name"]
    jump = first_jump([r["raw"] for r in rows if r["status"] != "only in golden"], ratio=ratio, floor=floor)
    if jump is not None:
        return rows, [r for r in rows if r["status"] != "only in golden"][jump]["name"]
    odd = next((r for r in rows if r["status"] != "matched"), None)
    return rows, odd["name"] if odd else None
