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

That pairing holds only where the target computes the module with the golden's ops, give or take
inserted ones (a hook, a cast, injected noise) and one op swapped for another of the same output
shape (``silu`` -> ``relu``). A re-implemented module (a fused or hand-written attention, with its
own rotary embedding and cache handling) runs other ops, in other counts and shapes: pairing them
by name would compare unrelated tensors. ``comparability`` aligns the two sequences by (API,
output shape) and finds the first golden op the target has no counterpart for; from there on
the op level is *not comparable*: the verdict says so and lists the target's ops around that
point instead of naming an op. An overflow needs no pairing: ``first_overflow_op`` is the first
target op whose output holds NaN or +Inf while its inputs hold none.
"""

from __future__ import annotations

import difflib
import math
from statistics import median
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from llmflow.dtypes import OP_ERROR_FLOOR, dtype_name
from llmflow.dump.memory import Call, OpCall, OpRecorder
from llmflow.localize.calls import cast_inputs
from llmflow.localize.own_error import own_error
from llmflow.localize.rank import DEFAULT_RATIO_THRESHOLD, first_jump
from llmflow.results.verdict import OpLevel, OpRef, OpRow, OverflowOp


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
    """Pairs (golden, target) in execution order; None on the side that lacks the op. By name; where
    names pair fewer than half the golden's ops and (API, output shape) pair more, by those: a
    target that wraps or renames the module's children (``mlp.inner.gate_proj``) runs the golden's
    ops under other names."""
    by_name = _aligned(golden, target, lambda c: c.name)
    named = sum(g is not None and t is not None for g, t in by_name)
    if 2 * named >= len(golden):
        return by_name
    by_signature = _aligned(golden, target, _op_signature)
    return by_signature if sum(g is not None and t is not None for g, t in by_signature) > named else by_name


def _aligned(golden: list[OpCall], target: list[OpCall],
             key: Any) -> list[tuple[OpCall | None, OpCall | None]]:
    """``align_ops`` by one key: equal keys pair, and a run of others of the same length on both
    sides pairs by position (an op swapped for another)."""
    sm = difflib.SequenceMatcher(a=[key(c) for c in golden], b=[key(c) for c in target], autojunk=False)
    pairs: list[tuple[OpCall | None, OpCall | None]] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            pairs.extend(zip(golden[i1:i2], target[j1:j2], strict=True))
        else:
            pairs.extend((g, None) for g in golden[i1:i2])
            pairs.extend((None, t) for t in target[j1:j2])
    return pairs


def compare_ops(golden: list[OpCall], target: list[OpCall], *, target_dtype: torch.dtype,
                ratio: float = DEFAULT_RATIO_THRESHOLD,
                own_error_only: bool = False) -> tuple[list[OpRow], str | None]:
    """One row per aligned op and the name of the first bad op (None when nothing stands out).
    ``own_error_only``: name an op only for its own error (no raw-error jump, no first odd op),
    for a stretch of ops that is followed by ops that cannot be paired."""
    rows: list[OpRow] = []
    last_golden: dict[tuple[int, ...], torch.Tensor] = {}
    for g, t in align_ops(golden, target):
        row = OpRow(name=(t or g).name, golden_api=g.api if g else None, target_api=t.api if t else None,
                    raw=None, iso=None, status="only in golden")
        if g is not None:
            last_golden[tuple(g.output.shape)] = g.output
        if g is not None and t is not None:
            row.status = "matched" if g.api == t.api else "different api"
            row.raw = own_error(g.output, t.output)["rel_l2"] if g.output.shape == t.output.shape else None
            row.iso = _iso(t, g)
        elif t is not None:
            row.status = "only in target"
            same = last_golden.get(tuple(t.output.shape))  # the value this op rewrites, if any
            row.raw = own_error(same, t.output)["rel_l2"] if same is not None else None
        rows.append(row)
    floor = OP_ERROR_FLOOR.get(dtype_name(target_dtype), 4e-3)
    iso_rows = [r for r in rows if r.iso is not None]
    for r in rows:
        others = [o.iso for o in iso_rows if o is not r]  # leave-one-out, as for modules
        r.iso_typical = max(median(others) if others else 0.0, floor)
        r.iso_score = r.iso / r.iso_typical if r.iso is not None else None
    for r in rows:
        if r.iso_score is not None and r.iso_score >= ratio:
            return rows, r.name
    if own_error_only:
        return rows, None
    paired = [r for r in rows if r.status != "only in golden"]
    jump = first_jump([r.raw for r in paired], ratio=ratio, floor=floor)
    if jump is not None:
        return rows, paired[jump].name
    odd = next((r for r in rows if r.status != "matched"), None)
    return rows, odd.name if odd else None


def paired_op(golden: list[OpCall], target: list[OpCall], name: str) -> tuple[OpCall | None, OpCall | None]:
    """The (golden, target) ops ``compare_ops`` compared for the op ``name``: aligned, or for an
    op only the target runs, the last golden op before it with its output shape (the value it
    rewrites)."""
    last_golden: dict[tuple[int, ...], OpCall] = {}
    for g, t in align_ops(golden, target):
        if g is not None:
            last_golden[tuple(g.output.shape)] = g
        op = t if t is not None else g
        if op is not None and op.name == name:
            if g is None and t is not None:
                g = last_golden.get(tuple(t.output.shape))
            return g, t
    return None, None


def _kept(x: torch.Tensor, max_elements: int) -> tuple[torch.Tensor, bool]:
    """A CPU copy of ``x``: whole up to ``max_elements`` elements, else an evenly strided sample
    of its flattened elements (True: sampled)."""
    x = x.detach().to("cpu")
    if x.numel() <= max_elements:  # a copy of its own: tensors saved together must not share storage
        return x.clone(memory_format=torch.contiguous_format), False
    sample = x.reshape(-1)[::math.ceil(x.numel() / max_elements)]
    return sample.clone(memory_format=torch.contiguous_format), True


def op_tensors(golden: OpCall | None, target: OpCall | None, *,
               max_bytes_per_side: int = 64 << 20) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """The tensors of one op pair to keep: ``golden.output.0``, ``target.output.0`` and, when
    they fit beside the output in ``max_bytes_per_side``, each side's tensor inputs
    (``golden.input.0`` ... in call order). An output over the budget is kept as a strided sample,
    the same elements on both sides. Returns (key -> tensor, the sampled keys, notes in words)."""
    tensors: dict[str, torch.Tensor] = {}
    sampled: list[str] = []
    notes: list[str] = []
    calls = {"golden": golden, "target": target}
    widest = max((c.output.element_size() for c in calls.values() if c is not None), default=1)
    max_elements = max_bytes_per_side // widest
    for side, call in calls.items():
        if call is None:
            notes.append(f"the {side} side has no counterpart of this op")
            continue
        out, was_sampled = _kept(call.output, max_elements)
        tensors[f"{side}.output.0"] = out
        if was_sampled:
            sampled.append(f"{side}.output.0")
            every = math.ceil(call.output.numel() / max_elements)
            notes.append(f"{side}.output.0: {call.output.numel():,} elements over {max_bytes_per_side >> 20} "
                         f"MiB: every {every}th element kept, flattened")
        inputs = [x for x in tree_flatten((call.args, call.kwargs))[0] if isinstance(x, torch.Tensor)]
        room = max_bytes_per_side - out.numel() * out.element_size()
        if sum(x.numel() * x.element_size() for x in inputs) <= room:
            tensors.update({f"{side}.input.{i}": _kept(x, x.numel())[0] for i, x in enumerate(inputs)})
        elif inputs:
            notes.append(f"the {side} op's inputs are not kept: over {max_bytes_per_side >> 20} MiB "
                         "with its output")
    return tensors, sampled, notes


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _op_signature(call: OpCall) -> tuple[str, tuple[int, ...]]:
    return call.api, tuple(call.output.shape)


def _fits(golden: OpCall, target: OpCall) -> bool:
    """Can these two ops stand in the same slot: the same output shape, or the same API giving
    the same number of elements in another layout (an attention kernel that folds GQA groups
    into the query length when it is given a mask)?"""
    return golden.output.shape == target.output.shape or (
        golden.api == target.api and golden.output.numel() == target.output.numel())


def _swapped_in_place(golden: list[OpCall], target: list[OpCall]) -> bool:
    """Do these golden ops pair with target ops that fit their slots (``_fits``): every op of a
    same-length run (``silu`` -> ``relu``), or, with ops inserted between them, each with the
    same API?"""
    if len(golden) == len(target):
        return all(_fits(g, t) for g, t in zip(golden, target, strict=True))
    swapped, j = 0, 0
    for g in golden:
        while j < len(target) and not _fits(g, target[j]):
            j += 1
        if j == len(target):
            return False
        swapped += target[j].api != g.api
        j += 1
    return swapped == 0


def comparability(golden: list[OpCall], target: list[OpCall], *, context: int = 4) -> OpLevel:
    """Whether the target computes the module with the golden's ops (see the module docstring).

    The target may insert ops anywhere, swap an op for another of the same output shape in its
    slot (``_swapped_in_place``) and do a run of golden ops with one op giving their result.
    Where not comparable, ``first_difference`` is the golden op (name, api, shape) the target has no
    counterpart for, ``*_ops_paired`` how many ops of each side come before it (they pair), and
    the ``*_ops_around`` lists hold up to ``context`` ops either side of that point on each side
    (name, api, output shape)."""
    sm = difflib.SequenceMatcher(a=[_op_signature(c) for c in golden], b=[_op_signature(c) for c in target],
                                 autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag in ("equal", "insert"):
            continue  # the same op and shape, or ops only the target runs (a hook, a cast)
        if tag == "replace" and _swapped_in_place(golden[i1:i2], target[j1:j2]):
            continue
        if tag == "replace" and j2 - j1 == 1 and _fits(golden[i2 - 1], target[j1]):
            continue  # golden ops done by one target op giving their result (GELU's formula -> relu)
        g = golden[i1]
        first = _ref(g)
        around = [_ref(c) for c in target[max(j1 - context, 0):j2 + context]]
        theirs = ", ".join(f"{c.api} {c.shape}" for c in around[:2 * context])
        reason = (f"the target computes this module with other ops than the golden: the golden's "
                  f"{g.name} ({g.api} -> {first.shape}) has no counterpart in the target, which runs "
                  f"{theirs or 'nothing'} there; ops after that point cannot be paired, so no op is named")
        return OpLevel(comparable=False, reason=reason, first_difference=first,
                       golden_ops_paired=i1, target_ops_paired=j1,
                       golden_ops_around=[_ref(c) for c in golden[max(i1 - context, 0):i2 + context]
                                          ][:2 * context + 1],
                       target_ops_around=around[:2 * context + 1])
    return OpLevel(comparable=True, golden_ops_paired=len(golden), target_ops_paired=len(target))


def _ref(call: OpCall) -> OpRef:
    return OpRef(name=call.name, api=call.api, shape=_shape(call.output))


def _holds_overflow(value: Any) -> bool:
    """Does any floating tensor in ``value`` hold NaN or +Inf? (-Inf is how masks are written.)"""
    for x in tree_flatten(value)[0]:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            if bool(torch.isnan(x).any()) or bool(torch.isposinf(x).any()):
                return True
    return False


def first_overflow_op(ops: list[OpCall]) -> OpCall | None:
    """The first op whose output holds NaN or +Inf while its tensor inputs hold none: where an
    overflow starts (``exp`` of a large score, a product past the dtype's range)."""
    for call in ops:
        if _holds_overflow(call.output) and not _holds_overflow((call.args, call.kwargs)):
            return call
    return None


def overflow_detail(call: OpCall) -> OverflowOp:
    """What ``first_overflow_op`` found, for the verdict: name, api, counts and the input's range."""
    out = call.output.detach().float()
    inputs = [x for x in tree_flatten((call.args, call.kwargs))[0]
              if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()]
    finite_max = max((float(x.detach().float().masked_fill(~torch.isfinite(x), 0).abs().max())
                      for x in inputs), default=math.nan)
    return OverflowOp(name=call.name, api=call.api, dtype=dtype_name(call.output.dtype),
                      nan=int(torch.isnan(out).sum()), inf=int(torch.isinf(out).sum()), numel=out.numel(),
                      input_max_abs=finite_max)
