"""Precheck one API dump without a golden: replay every recorded op on the CPU and judge its output.

Each API call of the dump (``<module>/<api>.<n>``, inputs, scalars and outputs recorded by the
recorder's API mode) is rebuilt (``llmflow.dump.arguments``) and run twice on the CPU:

  reference: floating inputs (and floating dtype arguments) in float64: the op's exact result;
  benchmark: the inputs as recorded, in the dump's own dtype: what a correct implementation of
             that dtype achieves on these very inputs.

The target's recorded output is judged by its error against the reference *relative to* the
benchmark's error (msprobe's api_accuracy_checker compares an NPU with a GPU the same way; here the
CPU plays the GPU, so no second device is needed). Per output kind:

  integer / bool / index outputs  bit-exact against the benchmark;
  floating outputs                ``ratio`` = rel-L2 error / max(benchmark rel-L2 error, u), where
                                  u is the dtype's unit roundoff; fail above ``fail_ratio`` (4),
                                  warn above 2; also fail when the largest absolute error is more
                                  than ``4 * fail_ratio`` times the benchmark's (one bad element);
  small values (msprobe's rule)   elements with |ref| < small (1e-3 half types, 1e-6 fp32) are
                                  judged by absolute error > atol (1e-5 / 1e-9): the share of such
                                  errors must not exceed twice the benchmark's (+0.1%);
  thousandth ratio (msprobe)      for fp16/fp32/fp64 outputs: the share of elements with relative
                                  error < 0.001 must reach 0.999 when the benchmark's does;
  NaN/Inf                         a non-finite target element where reference and benchmark are
                                  finite fails.

Not checked, with the reason: random calls (dropout in training, sampling), calls whose inputs
were not captured (statistics-only, outputs-only dumps, a parameter argument without
``dump_weight``), inputs a dump cannot hold, and APIs with no CPU implementation or registered
reference (``llmflow.checks.references``). The dump is streamed: one call's tensors at a time.

``--perturb`` (``perturb=True``): each floating call is rerun in float64 on its inputs perturbed
by their dtype's unit roundoff (x * (1 + u * r), r = +-1 seeded); a call whose output moves more than
``perturb_ratio`` times as much as its inputs (relative L2) is flagged: ill-conditioned on these
inputs, a golden-free warning beside the verdict (msprobe's free_benchmark idea).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from llmflow.checks.op_call import OpCall, load_outputs
from llmflow.checks.precheck_atb import atb_calls
from llmflow.checks.precheck_msprobe import msprobe_call
from llmflow.checks.precheck_options import (
    DEFAULT_FAIL_RATIO,
    DEFAULT_WARN_RATIO,
    PrecheckOptions,
)
from llmflow.checks.references import is_random, resolve, unit_roundoff
from llmflow.compare.metrics import EPS
from llmflow.dtypes import SMALL_VALUE, SMALL_VALUE_ATOL, dtype_name
from llmflow.dump.arguments import Unrebuildable, decode_value, rebuild_arguments
from llmflow.dump.memory import flatten_outputs
from llmflow.formats.atb import AtbDumpReader
from llmflow.formats.base import DumpReader, Entry, api_of
from llmflow.formats.msprobe import MsprobeDumpReader

COLUMNS = ("rank", "step", "order", "name", "record", "module", "api", "output", "status", "ratio", "error",
           "benchmark_error", "max_abs_error", "benchmark_max_abs_error", "small_value_err_ratio",
           "one_thousandth_err_ratio", "dtype", "shape", "implementation", "perturb_ratio", "perturb_flag",
           "reason")


# -- reading calls from a dump ----------------------------------------------------------------------
def iter_calls(reader: DumpReader) -> Iterator[OpCall]:
    """The dump's API calls in model order (rank, step, order), one at a time, tensors loaded
    for that call only. A ``Parameter`` argument is loaded from the dump's weights by name; an
    msprobe dump's calls are rebuilt from its dump.json records (``precheck_msprobe``), an ATB
    dump's leaf operations from its tensors and model json (``precheck_atb``)."""
    if isinstance(reader, AtbDumpReader):
        yield from atb_calls(reader)
        return
    build = _call
    if isinstance(reader, MsprobeDumpReader):
        def build(reader: DumpReader, entries: list[Entry], _weights: dict[str, Entry]) -> OpCall:
            return msprobe_call(reader, entries)  # type: ignore[arg-type]
    weights: dict[str, Entry] = {}
    group: list[Entry] = []
    for e in reader.entries():
        if e.kind == "weight":
            weights[e.name] = e
        elif e.level == "api" and e.step >= 0:
            if group and (e.name != group[0].name or e.step != group[0].step or e.rank != group[0].rank
                          or (e.kind == "input" and group[-1].kind == "output")):
                yield build(reader, group, weights)
                group = []
            group.append(e)
    if group:
        yield build(reader, group, weights)


def _call(reader: DumpReader, entries: list[Entry], weights: dict[str, Entry]) -> OpCall:
    first = entries[0]
    call = OpCall(first.name, api_of(first.name), first.rank, first.step, first.order)
    inputs = [e for e in entries if e.kind == "input"]
    outputs = [e for e in entries if e.kind == "output"]
    if not inputs:
        call.reason = "inputs not captured (dumped with tensor_part 1?)"
    elif not outputs:
        call.reason = "output not captured (dumped with tensor_part 0?)"
    leaves: list[tuple[str, Any]] = []
    for e in inputs:
        value: Any = None
        if e.is_tensor and e.has_data:
            value = reader.load(e)
        elif e.is_tensor:
            call.reason = call.reason or (f"input {e.index} recorded as statistics only (dump with "
                                          "data_mode tensor)")
        elif e.pytype == "Parameter":
            param = e.extra.get("param")
            weight = weights.get(param) if isinstance(param, str) else None
            if weight is None or not weight.has_data:
                call.reason = call.reason or f"parameter input {e.index} ({param or 'unnamed'}) {NO_WEIGHT}"
            else:
                value = reader.load(weight)
        else:
            try:
                value = decode_value(e.value, e.pytype)
            except Unrebuildable as exc:
                call.reason = call.reason or f"input {e.index} is {exc}, which a dump cannot hold"
        leaves.append((e.index, value))
    if call.reason is None:
        call.args, call.kwargs = rebuild_arguments(leaves)
        load_outputs(call, outputs, reader, "no output tensor recorded")
    return call


# -- running a call -------------------------------------------------------------------------------
def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def as_float64(value: Any) -> Any:
    """Arguments for the reference run: floating tensors and floating dtype arguments in float64
    (``x.to(torch.bfloat16)`` becomes the identity: the reference never rounds)."""
    if isinstance(value, torch.dtype):
        return torch.float64 if value.is_floating_point else value
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(as_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: as_float64(v) for k, v in value.items()}
    return value


#: ``Tensor.__iadd__`` and its kin write into their first argument, as ``add_`` does
_IN_PLACE_OPERATOR = re.compile(
    r"__i(add|sub|mul|truediv|floordiv|mod|pow|matmul|and|or|xor|lshift|rshift)__")


def writes_inputs(api: str, kwargs: dict[str, Any]) -> bool:
    """Does this call write into a tensor it was given? In-place APIs (``add_``, ``__iadd__``,
    ``__setitem__``), ``inplace=True`` (``F.relu``) and an ``out=`` argument do; the replay then
    runs on copies."""
    return ((api.endswith("_") and not api.endswith("__")) or api == "__setitem__"
            or _IN_PLACE_OPERATOR.fullmatch(api) is not None or "out" in kwargs
            or kwargs.get("inplace") is True)


def run_call(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any],
             copy: bool = True) -> dict[str, torch.Tensor]:
    """The op's outputs by the dump's output index. ``copy``: on private copies of its inputs (an
    op that writes into them must not change the next run's inputs); without, on the inputs."""
    if copy:
        args, kwargs = _map_tensors((args, kwargs), lambda t: t.clone())
    with torch.no_grad():
        return flatten_outputs(fn(*args, **kwargs))


# -- judging --------------------------------------------------------------------------------------
@dataclass
class Judged:
    """One output's numbers and verdict."""

    status: str  # pass, warn, fail
    ratio: float
    numbers: dict[str, Any]
    reasons: list[str]


@dataclass
class _Reference:
    """One output's float64 reference, flat, with what every comparison against it reuses."""

    values: torch.Tensor
    finite: torch.Tensor | None  # None: every element is finite
    magnitude: torch.Tensor  # |values|
    norm: float  # the L2 norm of the finite values

    @classmethod
    def of(cls, ref: torch.Tensor) -> _Reference:
        values = ref.reshape(-1).to(torch.float64)
        finite = torch.isfinite(values)
        if bool(finite.all()):
            return cls(values, None, values.abs(), float(torch.linalg.vector_norm(values)))
        kept = values[finite]
        return cls(values, finite, values.abs(), float(torch.linalg.vector_norm(kept)))


def _errors(ref: _Reference, out: torch.Tensor, small: float, atol: float) -> dict[str, float]:
    """``out`` against the reference over the elements finite on both sides: rel-L2 error
    (compare's relative_euclidean_distance), largest absolute error, the share of elements with
    relative error < 0.001 (compare's one_thousandth_err_ratio: |ref| <= eps counts as exact), the
    share of small reference values (|ref| < ``small``) missed by more than ``atol``, and how many
    more NaN/Inf ``out`` has than the reference (``bad``)."""
    values = out.reshape(-1).to(torch.float64)
    out_finite = torch.isfinite(values)
    out_all_finite = bool(out_finite.all())
    ref_bad = 0 if ref.finite is None else int((~ref.finite).sum())
    bad = (0 if out_all_finite else int((~out_finite).sum())) - ref_bad
    a, magnitude, g_norm = ref.values, ref.magnitude, ref.norm
    if not out_all_finite:
        keep = out_finite if ref.finite is None else out_finite & ref.finite
        a, magnitude, values = a[keep], magnitude[keep], values[keep]
        g_norm = float(torch.linalg.vector_norm(a))
    elif ref.finite is not None:
        a, magnitude, values = a[ref.finite], magnitude[ref.finite], values[ref.finite]
    n = a.numel()
    if n == 0:
        return {"error": math.nan, "max_abs": math.nan, "thousandth": math.nan, "small": 0.0, "bad": bad}
    diff = values - a
    distance = diff.abs()
    d_norm = float(torch.linalg.vector_norm(diff))
    if g_norm > EPS:
        error = d_norm / g_norm
    else:
        error = 0.0 if d_norm <= EPS else math.inf
    thousandth = int(((distance < 1e-3 * magnitude) | (magnitude <= EPS)).sum()) / n
    small_mask = magnitude < small
    n_small = int(small_mask.sum())
    small_share = int((small_mask & (distance > atol)).sum()) / n_small if n_small else 0.0
    return {"error": error, "max_abs": float(distance.max()), "thousandth": thousandth, "small": small_share,
            "bad": bad}


#: a warning row's words for an output the dtype itself cannot hold
OVERFLOWS = "overflows here"


def judge_output(target: torch.Tensor, bench: torch.Tensor | None, ref: torch.Tensor, *,
                 fail_ratio: float = DEFAULT_FAIL_RATIO, warn_ratio: float = DEFAULT_WARN_RATIO) -> Judged:
    """The target's output against the reference, relative to the benchmark (module docstring).
    ``bench`` None: not run, because the target equals the reference exactly (a pass)."""
    if tuple(target.shape) != tuple(ref.shape):
        return Judged("fail", math.inf, {}, [f"shape {list(target.shape)}, the op gives {list(ref.shape)}"])
    if bench is None:
        exact = {"error": 0.0, "max_abs_error": 0.0, "small_value_err_ratio": 0.0,
                 "one_thousandth_err_ratio": 1.0}
        return Judged("pass", 0.0, exact if target.is_floating_point() else {}, [])
    if not target.is_floating_point():
        same = bench.dtype == target.dtype and torch.equal(bench, target)
        return Judged("pass" if same else "fail", 0.0 if same else math.inf, {},
                      [] if same else [f"{int((bench != target).sum())} elements differ (bit-exact rule)"])
    dtype = target.dtype
    u = unit_roundoff(dtype)
    reference = _Reference.of(ref)
    if reference.values.numel() and reference.finite is not None and not bool(reference.finite.any()):
        return Judged("not checked", math.nan, {}, ["no finite value in the op's own result (its inputs "
                                                    "are already NaN/Inf)"])
    small, atol = SMALL_VALUE.get(dtype_name(dtype), 1e-6), SMALL_VALUE_ATOL.get(dtype_name(dtype), 1e-9)
    t, b = _errors(reference, target, small, atol), _errors(reference, bench, small, atol)
    reasons: list[str] = []
    if t["bad"] > max(b["bad"], 0):
        reasons.append(f"{t['bad']} NaN/Inf elements where the op gives finite values")
    err, b_err = t["error"], b["error"]
    finite_magnitude = (reference.magnitude if reference.finite is None
                        else reference.magnitude[reference.finite])
    scale = float(finite_magnitude.max()) if finite_magnitude.numel() else 0.0
    if scale == 0:  # an all-zero result: absolute error only
        err, b_err = t["max_abs"], b["max_abs"]
    ratio = _ratio(err, b_err, u)
    max_err, b_max = t["max_abs"], b["max_abs"]
    max_ratio = _ratio(max_err, b_max, u * scale)
    t_small, b_small = t["small"], b["small"]
    thousandth, b_thousandth = t["thousandth"], b["thousandth"]
    if ratio > fail_ratio:
        reasons.append(f"error {err:.3g} is {ratio:.3g}x the benchmark's {b_err:.3g}")
    if max_ratio > 4 * fail_ratio:
        reasons.append(f"largest absolute error {max_err:.3g} is {max_ratio:.3g}x the benchmark's "
                       f"{b_max:.3g}")
    if t_small > 2 * b_small + 1e-3:
        reasons.append(f"{t_small:.3%} of the small values (|x| < {small:g}) miss by more than {atol:g} "
                       f"(benchmark {b_small:.3%})")
    if u < 1e-3 and thousandth < 0.999 <= b_thousandth:
        reasons.append(f"thousandth ratio {thousandth:.4f} < 0.999 (benchmark {b_thousandth:.4f})")
    status = "fail" if reasons else "warn" if ratio > warn_ratio else "pass"
    if not reasons and t["bad"] > 0:  # faithful to the dtype, which itself overflows here: said, not failed
        status = "warn"
        reasons.append(f"{t['bad']} NaN/Inf elements where the float64 result is finite: {dtype_name(dtype)} "
                       f"{OVERFLOWS} (the benchmark in the same dtype does too)")
    numbers = {"error": err, "benchmark_error": b_err, "max_abs_error": max_err,
               "benchmark_max_abs_error": b_max, "small_value_err_ratio": t_small,
               "one_thousandth_err_ratio": thousandth}
    return Judged(status, ratio, numbers, reasons)


def equals_reference(target: torch.Tensor, ref: torch.Tensor) -> bool:
    """Is the target's output the reference itself, element for element (a copy, a view, a
    gather, an exact op)? Then no benchmark can say more: the output passes."""
    if tuple(target.shape) != tuple(ref.shape) or target.is_floating_point() != ref.is_floating_point():
        return False
    if not target.is_floating_point():
        return target.dtype == ref.dtype and torch.equal(target, ref)
    return torch.equal(target.to(torch.float64), ref.to(torch.float64))


def _ratio(err: float, bench_err: float, floor: float) -> float:
    if math.isnan(err):
        return math.inf
    denominator = max(bench_err if math.isfinite(bench_err) else 0.0, floor)
    if denominator == 0:
        return 0.0 if err == 0 else math.inf
    return err / denominator


def perturbation(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any],
                 reference: dict[str, torch.Tensor], seed: int = 0) -> float | None:
    """How much more the op's float64 output moves than its floating inputs when each of those is
    perturbed by its own dtype's unit roundoff (relative L2 both); None when nothing floats."""
    gen = torch.Generator().manual_seed(seed)
    moved = {"in": 0.0, "norm": 0.0}

    def perturb(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.numel() == 0:
            return t
        signs = torch.randint(0, 2, t.shape, generator=gen, dtype=torch.int8).to(torch.float64) * 2 - 1
        x = t.to(torch.float64)
        out = x * (1 + unit_roundoff(t.dtype) * signs)
        finite = torch.isfinite(x)  # (an Inf of a mask stays as it is)
        moved["in"] += float(((out - x)[finite] ** 2).sum())
        moved["norm"] += float((x[finite] ** 2).sum())
        return out

    p_args, p_kwargs = as_float64(_map_tensors((args, kwargs), perturb))
    if moved["norm"] == 0:
        return None
    try:
        out = run_call(fn, p_args, p_kwargs)
    except Exception:  # (the unperturbed run worked; a perturbed one that raises is not a number)
        return None
    in_change = math.sqrt(moved["in"] / moved["norm"])
    changes = []
    for index, ref in reference.items():
        if index in out and ref.is_floating_point() and out[index].shape == ref.shape:
            d = out[index].to(torch.float64) - ref.to(torch.float64)
            finite = torch.isfinite(d) & torch.isfinite(ref)
            norm = float(ref.to(torch.float64)[finite].norm())
            if norm > 0:
                changes.append(float(d[finite].norm()) / norm)
    return max(changes) / in_change if changes and in_change > 0 else None


# -- the precheck -----------------------------------------------------------------------------------
def check_call(call: OpCall,
               options: PrecheckOptions) -> tuple[list[dict[str, Any]], Callable[..., Any] | None]:
    """One call's rows and the function that replayed it. A call with one recorded output has one
    row; a call with several (``torch.topk``'s values and indices, ``torch.var_mean``) has one row
    per output, its ``output`` the output's index, each judged by its own kind's rule (floating
    values against the reference, integer indices bit-exact). Status pass/warn/fail/not checked."""
    row: dict[str, Any] = {"rank": call.rank, "step": call.step, "order": call.order, "name": call.name,
                           "record": call.record, "module": call.module, "api": call.api, "output": None,
                           "status": "not checked", "ratio": None, "reason": call.reason}
    first_out = next(iter(call.outputs.values()), None)
    if first_out is not None:
        row["dtype"] = dtype_name(first_out.dtype)
        row["shape"] = list(first_out.shape)
    if call.reason is not None:
        return [row], None
    if is_random(call.api, call.args, call.kwargs):
        row["reason"] = "random call: its output is drawn, not computed"
        return [row], None
    fn, where = resolve(call.api, call.args, options.references, call.function)
    row["implementation"] = where if fn is not None else None
    if fn is None:
        row["reason"] = where
        return [row], None
    copy = writes_inputs(call.api, call.kwargs) or where == "reference"  # (a user's code may write)
    try:
        ref = run_call(fn, as_float64(call.args), as_float64(call.kwargs), copy=copy)
        exact = all(i in ref and equals_reference(t, ref[i]) for i, t in call.outputs.items())
        bench = None if exact else run_call(fn, call.args, call.kwargs, copy=copy)
    except Exception as exc:  # an op the CPU refuses for these arguments is listed, not fatal
        row["reason"] = f"replay failed on the CPU: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return [row], fn
    rows = [_judge_row(row, index, target, bench, ref, options, per_output=len(call.outputs) > 1)
            for index, target in call.outputs.items()]
    judged_floating = [r for r, t in zip(rows, call.outputs.values(), strict=True)
                       if r["status"] != "not checked" and t.is_floating_point()]
    if options.perturb and judged_floating:
        factor = perturbation(fn, call.args, call.kwargs, ref)
        for r in judged_floating:
            r["perturb_ratio"] = factor
            r["perturb_flag"] = factor is not None and factor > options.perturb_ratio
    return rows, fn


def _judge_row(base: dict[str, Any], index: str, target: torch.Tensor, bench: dict[str, torch.Tensor] | None,
               ref: dict[str, torch.Tensor], options: PrecheckOptions, *, per_output: bool) -> dict[str, Any]:
    """The row of one recorded output: the call's ``base`` row with this output's numbers
    (``bench`` None: every output equals the reference, no benchmark was run)."""
    row = dict(base, dtype=str(target.dtype).removeprefix("torch."), shape=list(target.shape))
    if per_output:
        row["output"] = index
    if index not in ref or (bench is not None and index not in bench):
        row["reason"] = (f"the replay gives no output {index}" if per_output
                         else "the replay gives none of the recorded outputs")
        return row
    judged = judge_output(target, None if bench is None else bench[index], ref[index],
                          fail_ratio=options.fail_ratio,
                          warn_ratio=options.warn_ratio)
    reason = "; ".join(judged.reasons) or None
    if judged.status == "not checked":
        row["reason"] = reason
        return row
    row.update(judged.numbers, status=judged.status, ratio=judged.ratio, reason=reason)
    return row


STATUS_RANK = {"not checked": -1, "pass": 0, "warn": 1, "fail": 2}


def call_status(rows: list[dict[str, Any]]) -> str:
    """A call's status from its rows: the worst of them (fail > warn > pass > not checked)."""
    return max((r["status"] for r in rows), key=STATUS_RANK.__getitem__)


def call_label(row: dict[str, Any]) -> str:
    """A row's call as a user finds it: ``/silu.1 [Functional.silu.3.forward]`` where the dump
    names it otherwise (msprobe's L1 records carry no module), ``.../topk.0 output 1`` for one of
    a call's several outputs."""
    label = f"{row['name']} [{row['record']}]" if row.get("record") else str(row["name"])
    return f"{label} output {row['output']}" if row.get("output") is not None else label


DUMP_AGAIN = "dump the target again (or copy the dump whole), then llmflow precheck it"
#: how to make a dump precheck can judge whole, in the terms of the tool that made the dump
_API_DUMP = {
    "msprobe": "dump the target with msprobe at level L1, task tensor (config.json: {\"task\": \"tensor\", "
               "\"level\": \"L1\", \"tensor\": {\"data_mode\": [\"all\"]}}; a Linear's weight is an input "
               "of its API there)",
    "": "dump the target with DumpConfig(mode='api', data_mode='tensor', dump_weight=True) (llmflow run "
        "api_precheck does it)",
}


def _api_dump(reader: DumpReader) -> str:
    """How to dump what precheck needs, for the dump ``reader`` reads."""
    return _API_DUMP.get(reader.format, _API_DUMP[""])
#: why a call taking a module's weight was not checked (a dump made without dump_weight)
NO_WEIGHT = "not in the dump (dump with dump_weight)"


def _uncovered(rows: list[dict[str, Any]], reader: DumpReader) -> tuple[str, str] | None:
    """(what, next) where calls that decide the answer went unchecked though most calls were checked:
    a custom kernel's op (``mylib::op``: the code the port added, which no torch function stands
    for) or calls whose weights the dump lacks (every Linear of a dump made without dump_weight)."""
    unchecked = {(r.get("rank"), r.get("step"), r["name"], r.get("record")): r for r in rows
                 if r["status"] == "not checked"}.values()  # one per call
    custom = sorted({str(r["api"]) for r in unchecked if "::" in str(r["api"])})
    if custom:
        calls = sum(1 for r in unchecked if "::" in str(r["api"]))
        return (f"{calls} call(s) of custom ops were not checked ({', '.join(custom[:3])}): the kernels the "
                "port added, which no torch function stands for",
                f"give each a float64 reference: --reference {custom[0]}=file.py:func (or the entry-point "
                "group llmflow.references), then llmflow precheck the dump again")
    weightless = sum(1 for r in unchecked if NO_WEIGHT in str(r["reason"]))
    if weightless:
        return (f"{weightless} calls taking a module's weight (the matmuls) were not checked: the dump holds "
                "no weights", f"{_api_dump(reader)}, then llmflow precheck that dump")
    return None


def precheck(reader: DumpReader, options: PrecheckOptions | None = None,
             on_call: Callable[[OpCall, list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Check every API call of ``reader``'s dump. ``on_call(call, rows)`` sees each call's rows as
    it is judged (tensors still loaded: the repro writer uses it). Returns ``{"rows" (one per call,
    or per output of a call with several; ranked, worst first), "first_fail" (model order),
    "counts" (calls per api and status), "totals" (calls by their worst row), "perturbed" (flagged
    calls), "status" (pass/fail/inconclusive), "headline"}``."""
    options = options or PrecheckOptions()
    rows: list[dict[str, Any]] = []
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    first_fail: dict[str, Any] | None = None
    for call in iter_calls(reader):
        call_rows, _fn = check_call(call, options)
        if on_call is not None:
            on_call(call, call_rows)
        status = call_status(call_rows)
        counts[call.api][status] += 1
        totals[status] += 1
        if first_fail is None:
            first_fail = next((r for r in call_rows if r["status"] == "fail"), None)
        rows += call_rows
    calls = sum(totals.values())
    checked = calls - totals["not checked"]
    rows.sort(key=lambda r: (r["status"] == "not checked", -(r["ratio"] if r["ratio"] is not None
                                                              and not math.isnan(r["ratio"]) else 0.0)))
    perturbed = list(dict.fromkeys(r["name"] for r in rows if r.get("perturb_flag")))
    next_step = ""
    problems = reader.problems()
    damaged = (f"the dump cannot be trusted whole: {problems[0]}"
               + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")) if problems else ""
    if not calls:
        status = "inconclusive"
        headline = "precheck: the dump holds no API calls (precheck replays API calls)"
        next_step = f"{_api_dump(reader)}, then llmflow precheck that dump"
    elif totals["fail"]:
        status = "fail"
        headline = (f"precheck: {totals['fail']} of {checked} checked calls fail; first "
                    f"{call_label(first_fail)} (step {first_fail['step']}): {first_fail['reason']}")  # type: ignore[arg-type,index]
    elif checked < options.min_checked * calls:
        why = Counter(str(r["reason"]).split(" (")[0] for r in rows
                      if r["status"] == "not checked").most_common(1)
        status = "inconclusive"
        headline = (f"precheck: only {checked} of {calls} calls could be checked; most often: "
                    f"{why[0][0] if why else '?'}" + (f"; {damaged}" if damaged else ""))
        next_step = DUMP_AGAIN if damaged else (
            f"{_api_dump(reader)}, and give the ops without a CPU implementation a reference "
            "(--reference NAME=file.py:func); precheck.csv says why each call was not checked")
    elif damaged:  # (as a compare of a damaged dump never passes)
        status = "inconclusive"
        headline = f"precheck: {checked} of {calls} calls checked, none fails, but {damaged}"
        next_step = DUMP_AGAIN
    elif (uncovered := _uncovered(rows, reader)) is not None:
        status = "inconclusive"
        headline = f"precheck: {checked} of {calls} calls checked, none fails, but {uncovered[0]}"
        next_step = uncovered[1]
    else:
        status = "pass"
        headline = f"precheck: {checked} of {calls} calls checked, none fails ({totals['warn']} warn)"
        overflows = [r for r in rows if r["status"] == "warn" and OVERFLOWS in str(r["reason"])]
        if overflows:  # (a range problem of the dtype, not a kernel's: what the user must hear of first)
            first = min(overflows, key=lambda r: (r.get("rank") or 0, r.get("step") or 0,
                                                  r.get("order") or 0))
            headline += f"; first {call_label(first)} (step {first['step']}) overflows {first['dtype']}"
    if perturbed and status != "fail":
        headline += (f"; perturbation flags {len(perturbed)} ill-conditioned calls, first "
                     f"{perturbed[0]}")
    return {"rows": rows, "first_fail": first_fail, "counts": {k: dict(v) for k, v in sorted(counts.items())},
            "totals": {"calls": calls, "checked": checked, **{k: totals[k] for k in
                                                              ("pass", "warn", "fail", "not checked")}},
            "perturbed": perturbed, "status": status, "headline": headline, "next": next_step}
