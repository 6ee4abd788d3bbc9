"""Isolation replay: run each module of the TARGET model on the GOLDEN inputs; its own error.

Comparing two dumps module by module measures *inherited* error: a decoder layer's output is
mostly the residual stream, which carries every upstream rounding, so a fault deep in the stack
drowns in accumulated noise. Replaying a module on the golden model's inputs to that same module
(cast to the target's dtype/device) and comparing with the golden output measures only what that
module adds itself. That is what ``rank.py`` ranks.

A ``Call`` is one recorded module call: positional and keyword inputs, outputs. Calls come from a
golden dump in module mode (``calls_from_dump``) or from an in-memory capture (``capture_calls``).
Opaque inputs (a KV-cache object) are replaced by None at step 0, where the cache is empty;
anything else that cannot be rebuilt marks the call not replayable, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmflow.formats.base import DumpReader, Entry
from llmflow.localize.rank import layer_of

SIMPLE_TYPES = ("NoneType", "bool", "int", "float", "str")
#: keyword inputs that hold a cache object: empty (None) in the prefill step
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache", "kv_cache")
#: module types (class names) replayed besides every module inside a decoder layer
CONTAINER_WORDS = ("attn", "attention", "mlp", "ffn", "feed_forward", "moe", "experts")


@dataclass
class Call:
    """One module call: inputs to replay it, outputs to compare against.

    ``args``/``kwargs`` hold tensors (golden, CPU) or plain values; ``outputs`` maps an output
    index (``"0"``, ``"1.0"``) to a tensor. ``reason`` is set when the call cannot be replayed.
    """

    name: str
    module_type: str | None = None
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    reason: str | None = None

    @property
    def replayable(self) -> bool:
        return self.reason is None and bool(self.outputs)


def is_branch(name: str, module: nn.Module | None = None) -> bool:
    """True for the modules isolation replay looks at: every module *inside* a decoder layer
    (attention, MLP, norms, projections, activations), and leaf modules outside the layer stack
    (final norm, lm_head). Decoder layers themselves are skipped: their output is mostly the
    residual stream, so their own error says little."""
    layer = layer_of(name)
    if layer is not None:
        return name != layer
    return module is None or not any(True for _ in module.children())


def _set_path(root: dict[str, Any], parts: list[str], value: Any) -> None:
    node = root
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _freeze(node: Any) -> Any:
    """Nested dicts keyed "0", "1", ... -> tuples (the structure the module was called with);
    dicts with other keys stay dicts."""
    if isinstance(node, dict):
        if all(k.isdigit() for k in node):
            return tuple(_freeze(node[k]) for k in sorted(node, key=int))
        return {k: _freeze(v) for k, v in node.items()}
    return node


def build_call(name: str, inputs: Iterable[tuple[str, Any]], outputs: Iterable[tuple[str, Any]],
               *, step: int = 0, module_type: str | None = None) -> Call:
    """A Call from ``(index, value)`` pairs as the dump writes them.

    ``value`` is a tensor, or a ``(json_value, pytype)`` pair for a non-tensor input. Positional
    indexes are ``"0"``, ``"1.0"``; keyword ones ``"kw:name"``, ``"kw:name.0"``.
    """
    call = Call(name, module_type)
    pos: dict[str, Any] = {}
    kw: dict[str, Any] = {}
    for index, value in inputs:
        if isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], torch.Tensor):
            json_value, pytype = value
            kwname = index[3:].split(".", 1)[0] if index.startswith("kw:") else None
            if pytype in SIMPLE_TYPES or pytype is None:
                value = json_value
            elif step == 0 and kwname in CACHE_KWARGS:
                value = None  # the prefill step starts with an empty cache
            else:
                call.reason = f"input {index} is an opaque {pytype}"
                value = None
        if index.startswith("kw:"):
            parts = index[3:].split(".")
            _set_path(kw, parts, value)
        else:
            _set_path(pos, index.split("."), value)
    call.args = list(_freeze(pos)) if pos else []
    call.kwargs = {k: _freeze(v) for k, v in kw.items()}
    call.outputs = {i: v for i, v in outputs if isinstance(v, torch.Tensor)}
    if not call.outputs and call.reason is None:
        call.reason = "no output tensor recorded"
    return call


def calls_from_dump(reader: DumpReader, step: int = 0, rank: int = 0,
                    names: set[str] | None = None) -> Iterator[Call]:
    """The module calls a dump recorded at ``step`` (module level, inputs and outputs), one at a
    time in execution order, tensors loaded lazily per call. ``names`` restricts which."""
    groups: dict[str, list[Entry]] = {}
    for e in reader.entries():
        if e.step == step and e.rank == rank and e.level == "module" and (names is None or e.name in names):
            groups.setdefault(e.name, []).append(e)
    for name, entries in groups.items():
        if not any(e.kind == "input" for e in entries):
            yield Call(name, entries[0].module_type, reason="no inputs recorded (dump with tensor_part 2)")
            continue
        first_out = min((e.order for e in entries if e.kind == "output"), default=None)
        # a module called twice in one step: keep the first call (inputs before its outputs)
        ins = [e for e in entries if e.kind == "input" and (first_out is None or e.order < first_out)]
        outs = [e for e in entries if e.kind == "output"]
        seen: set[str] = set()
        outs = [e for e in outs if not (e.index in seen or seen.add(e.index))]

        def value(e: Entry) -> Any:
            if e.is_tensor:
                return reader.load(e) if e.has_data else (None, "statistics-only tensor")
            return (e.value, e.pytype)

        call = build_call(name, [(e.index, value(e)) for e in ins],
                          [(e.index, reader.load(e)) for e in outs if e.is_tensor and e.has_data],
                          step=step, module_type=entries[0].module_type)
        if any(e.is_tensor and not e.has_data for e in ins):
            call.reason = "inputs dumped as statistics only (dump with data_mode tensor)"
        yield call


def _cast(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast(v, device, dtype) for v in value)
    if isinstance(value, list):
        return [_cast(v, device, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast(v, device, dtype) for k, v in value.items()}
    return value


def flatten_outputs(out: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"0": t}`` for a tensor, ``{"0": a, "1": b}`` for a tuple, ``"1.0"`` nested: the dump's
    output indexing, so replayed outputs line up with recorded ones."""
    if isinstance(out, torch.Tensor):
        return {prefix or "0": out}
    flat: dict[str, torch.Tensor] = {}
    if isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            flat.update(flatten_outputs(v, f"{prefix}.{i}" if prefix else str(i)))
    elif hasattr(out, "to_tuple"):  # transformers ModelOutput
        flat.update(flatten_outputs(out.to_tuple(), prefix))
    return flat


def own_error(golden: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """The error metrics ranking and charts use (computed in float64, on CPU).

    rel_l2: ||t - g|| / ||g||, the ranking key (scale-free, robust to a few outliers);
    max_abs: max |t - g|; max_rel: max |t - g| / max |g|; cos_dist: 1 - cosine similarity.
    """
    g = golden.detach().to("cpu", torch.float64).reshape(-1)
    t = target.detach().to("cpu", torch.float64).reshape(-1)
    if g.shape != t.shape:
        return {"rel_l2": math.inf, "max_abs": math.inf, "max_rel": math.inf, "cos_dist": math.inf}
    d = t - g
    gn = float(g.norm())
    tiny = 1e-30
    cos = float(torch.dot(g, t) / max(gn * float(t.norm()), tiny)) if g.numel() else 1.0
    return {"rel_l2": float(d.norm()) / max(gn, tiny),
            "max_abs": float(d.abs().max()) if d.numel() else 0.0,
            "max_rel": float(d.abs().max()) / max(float(g.abs().max()), tiny) if d.numel() else 0.0,
            "cos_dist": max(0.0, 1.0 - cos)}


@torch.no_grad()
def replay_call(module: nn.Module, call: Call, *, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Run ``module`` on the call's golden inputs (cast to ``dtype`` on ``device``); one row with
    the own-error metrics of output ``"0"`` (or the first recorded output)."""
    row: dict[str, Any] = {"name": call.name, "module_type": call.module_type or type(module).__name__}
    if not call.replayable:
        row.update(replayable=False, reason=call.reason)
        return row
    try:
        out = module(*_cast(call.args, device, dtype), **_cast(call.kwargs, device, dtype))
    except Exception as exc:  # a module that refuses the rebuilt inputs is reported, not fatal
        row.update(replayable=False, reason=f"replay failed: {type(exc).__name__}: {str(exc)[:160]}")
        return row
    flat = flatten_outputs(out)
    index = "0" if "0" in call.outputs else sorted(call.outputs)[0]
    if index not in flat:
        row.update(replayable=False, reason=f"replay gave no output {index}")
        return row
    row.update(replayable=True, output=index, **own_error(call.outputs[index], flat[index]))
    return row


def replay_modules(model: nn.Module, calls: Iterable[Call] | dict[str, Call], *, device: torch.device,
                   dtype: torch.dtype, select: Callable[[str, nn.Module], bool] = is_branch,
                   advance: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Isolation replay of every selected module of ``model`` that has a recorded call.

    Returns one row per module (``replay_call``); modules with no call are skipped.
    """
    rows = []
    modules = dict(model.named_modules())
    for call in calls.values() if isinstance(calls, dict) else calls:
        name = call.name
        module = modules.get(name)
        if module is None or not select(name, module):
            continue
        rows.append(replay_call(module, call, device=device, dtype=dtype))
        if advance is not None:
            advance()
    return rows


@torch.no_grad()
def capture_calls(model: nn.Module, run: Callable[[], Any], *,
                  select: Callable[[str, nn.Module], bool] = is_branch, prefix: str = "") -> dict[str, Call]:
    """Record the first call of every selected module while ``run()`` executes (in memory).

    The in-memory twin of a golden module dump at one step. ``model`` may be a sub-module (a
    decoder layer) whose path in the whole model is ``prefix``. Inputs and outputs are detached
    CPU copies.
    """
    calls: dict[str, Call] = {}
    handles = []

    def pre(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name in calls:
                return
            calls[name] = Call(name, type(module).__name__, list(_detach(args)),
                               {k: _detach(v) for k, v in kwargs.items() if k not in CACHE_KWARGS})
        return hook

    def post(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            call = calls.get(name)
            if call is not None and not call.outputs:
                call.outputs = {k: v.detach().cpu() for k, v in flatten_outputs(out).items()}
        return hook

    for sub, module in model.named_modules():
        name = f"{prefix}.{sub}" if prefix and sub else (sub or "")
        if name and name != prefix and select(name, module):
            handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return calls


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, (type(None), bool, int, float, str)):
        return value
    return None  # opaque objects (caches) are dropped, as the dump-based path does at step 0
