"""The recorder's memory sinks: calls kept in memory for replay.

``CallRecorder`` keeps the first call of every selected module (a ``Call``: inputs, outputs, and
a KV cache as the module found and left it); ``OpRecorder`` keeps every torch API call inside
one module run (an ``OpCall``: the callable, its inputs as they were before it ran, its output).
Isolation replay, decode-step replay and op replay (``llmflow.localize``) consume them.

Inputs are kept with their structure (tuples, lists, dicts as the call had them) rather than as
the flat labelled leaves the disk dump writes: replay calls the module again, so the structure,
empty containers included, must come back exactly. Tensors are detached CPU copies; a KV cache
becomes a ``CacheSnapshot``; anything else that cannot be rebuilt marks the call not replayable.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from llmflow.dump.recorder import Recorder, Select, Sink
from llmflow.structure import is_cache


@dataclass
class Call:
    """One module call: inputs to replay it, outputs to compare against.

    ``args``/``kwargs`` hold tensors (golden, CPU), plain values or ``CacheSnapshot``s; ``outputs``
    maps an output index (``"0"``, ``"1.0"``) to a tensor. ``reason`` is set when the call cannot
    be replayed.
    """

    name: str
    module_type: str | None = None
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    reason: str | None = None
    cache_after: CacheSnapshot | None = None  # the KV cache as the module left it (what it wrote)

    @property
    def replayable(self) -> bool:
        return self.reason is None and bool(self.outputs)


class CacheSnapshot:
    """A KV cache as a module found it when it was called.

    For a transformers ``Cache`` and a module that names its layer (``layer_idx``), that layer is
    deep-copied (a static cache writes its tensors and position counter in place, so a shared
    reference would show later steps' writes) and the others are shallow copies; any other cache
    is deep-copied whole. ``materialize`` gives a private copy for one replay, in the replaying
    side's dtype and device.
    """

    def __init__(self, cache: Any, layer_idx: int | None = None):
        self.type = type(cache).__name__
        layers = getattr(cache, "layers", None)
        ok = isinstance(layers, list) and isinstance(layer_idx, int) and 0 <= layer_idx < len(layers)
        # a cache that keeps state beside its layers (MiniMax's linear-attention states in a list of
        # its own) would share that state with later steps' writes: copied whole
        ok = ok and not _holds_tensors({k: v for k, v in vars(cache).items() if k != "layers"})
        self.idx = layer_idx if ok else None
        if self.idx is not None:
            snap = copy.copy(cache)
            snap.layers = [copy.copy(layer) for layer in layers]
            snap.layers[self.idx] = copy.deepcopy(layers[self.idx])
            self.cache = snap
        else:
            self.cache = copy.deepcopy(cache)

    def layer_kv(self, idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``idx``'s keys and values, where the cache keeps them as ``layers[idx].keys``."""
        return layer_kv(self.cache, idx)

    def materialize(self, module: nn.Module | None, device: torch.device, dtype: torch.dtype) -> Any:
        if self.idx is not None and cache_layer_index(module) == self.idx:
            out = copy.copy(self.cache)
            out.layers = list(self.cache.layers)
            out.layers[self.idx] = _cast_object(copy.deepcopy(self.cache.layers[self.idx]), device, dtype)
            return out
        return _cast_object(copy.deepcopy(self.cache), device, dtype)


def _holds_tensors(value: Any, depth: int = 0) -> bool:
    """Does ``value`` (a dict, list or tuple of them, nested a few levels) hold a tensor?"""
    if isinstance(value, torch.Tensor):
        return True
    if depth > 3:
        return False
    if isinstance(value, dict):
        return any(_holds_tensors(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v, depth + 1) for v in value)
    return False


def cache_layer_index(module: nn.Module | None) -> int | None:
    """The KV-cache layer ``module`` reads and writes: its ``layer_idx`` (an attention), else the one
    its sub-modules name when they agree (a decoder layer holding one attention); None for a module
    that names none (it gets the whole cache)."""
    if module is None:
        return None
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int):
        return idx
    inner = {m.layer_idx for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int)}
    return inner.pop() if len(inner) == 1 else None


def layer_kv(cache: Any, idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``cache.layers[idx]``'s keys and values (a transformers cache layer), or None."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not 0 <= idx < len(layers):
        return None
    keys, values = getattr(layers[idx], "keys", None), getattr(layers[idx], "values", None)
    if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() >= 2:
        return keys, values
    return None


def _cast_object(obj: Any, device: torch.device, dtype: torch.dtype, depth: int = 0) -> Any:
    """Move the tensors held in ``obj`` (its attributes, lists of them, objects in those lists) to
    ``device``, floating ones to ``dtype``; attributes recording a dtype or device follow. In place
    where ``obj`` has attributes; returns the result."""
    if isinstance(obj, torch.Tensor):
        obj = obj.to(device)
        return obj.to(dtype) if obj.is_floating_point() else obj
    if depth > 5:
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_object(v, device, dtype, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return {k: _cast_object(v, device, dtype, depth + 1) for k, v in obj.items()}
    if not hasattr(obj, "__dict__") or isinstance(obj, (type, nn.Module)):
        return obj
    for key, value in list(vars(obj).items()):
        if isinstance(value, torch.dtype) and value.is_floating_point:
            setattr(obj, key, dtype)
        elif isinstance(value, torch.device):
            setattr(obj, key, device)
        else:
            setattr(obj, key, _cast_object(value, device, dtype, depth + 1))
    return obj


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


class _Opaque:
    """An input that is neither a tensor, a plain value nor a cache: replay cannot rebuild it."""

    def __init__(self, value: Any):
        self.type = type(value).__name__


def host_copy_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, in memory of its own: no later in-place op of the model changes it
    (Falcon's layer adds the attention into its MLP's output: ``mlp_output += attention_output``).
    ``cpu()`` copies a device tensor but returns a host tensor itself."""
    t = t.detach()
    return t.clone() if t.device.type == "cpu" else t.cpu()


def _keep(value: Any, layer_idx: int | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        return host_copy_of(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_keep(v, layer_idx) for v in value)
    if isinstance(value, dict):
        return {k: _keep(v, layer_idx) for k, v in value.items()}
    if isinstance(value, (type(None), bool, int, float, str, torch.dtype, torch.device)):
        return value
    if is_cache(value):
        return CacheSnapshot(value, layer_idx)
    return _Opaque(value)


def _opaque_reason(args: Any, kwargs: dict[str, Any]) -> str | None:
    stack: list[tuple[str, Any]] = [(str(i), a) for i, a in enumerate(args)]
    stack += [(f"kw:{k}", v) for k, v in kwargs.items()]
    while stack:
        where, v = stack.pop()
        if isinstance(v, _Opaque):
            return f"input {where} is an opaque {v.type}"
        if isinstance(v, (tuple, list)):
            stack += [(f"{where}.{i}", x) for i, x in enumerate(v)]
        elif isinstance(v, dict):
            stack += [(f"{where}.{k}", x) for k, x in v.items()]
    return None


class CallRecorder(Sink):
    """Records the first call of every selected module of a model, in memory, while ``active``.

    The in-memory twin of a golden module dump at one step. ``model`` may be a sub-module (a
    decoder layer) whose path in the whole model is ``prefix``. A sink of its own ``Recorder``;
    with ``steps`` that recorder calls ``begin_step``/``end_step`` around each call of ``model``.
    """

    def __init__(self, model: nn.Module, select: Select, prefix: str = "", *, steps: bool = False):
        self.calls: dict[str, Call] = {}
        self.active = True
        self._recorder = Recorder(model, select, prefix=prefix, sink=self, steps=steps)

    def module_inputs(self, name: str, mtype: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if name in self.calls:
            return
        idx = cache_layer_index(module)
        a, k = list(_keep(args, idx)), {key: _keep(v, idx) for key, v in kwargs.items()}
        self.calls[name] = Call(name, mtype, a, k, reason=_opaque_reason(a, k))

    def module_output(self, name: str, mtype: str, module: nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None:
        call = self.calls.get(name)
        if call is None or call.outputs:
            return
        call.outputs = {k: host_copy_of(v) for k, v in flatten_outputs(output).items()}
        cache = next((v for v in (*args, *kwargs.values()) if is_cache(v)), None)
        if cache is not None:
            call.cache_after = CacheSnapshot(cache, cache_layer_index(module))

    def close(self) -> None:
        self._recorder.remove()

    def __enter__(self) -> CallRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@torch.no_grad()
def capture_calls(model: nn.Module, run: Callable[[], Any], *, select: Select,
                  prefix: str = "") -> dict[str, Call]:
    """Record the first call of every selected module while ``run()`` executes (in memory)."""
    with CallRecorder(model, select, prefix) as rec:
        run()
    return rec.calls


# -- op calls -------------------------------------------------------------------------------------
@dataclass
class OpCall:
    name: str  # "<module>/<api>.<n>"
    api: str
    func: Callable
    args: tuple
    kwargs: dict
    output: torch.Tensor


def _snapshot(value: Any) -> Any:
    flat, spec = tree_flatten(value)
    return tree_unflatten([x.detach().clone() if isinstance(x, torch.Tensor) else x for x in flat], spec)


class OpRecorder(Sink):
    """Records every torch API call returning a tensor while one module runs, named like the
    dump's API mode (``<module path>/<api>.<n>``), inputs copied before the op runs (an in-place
    op would change them)."""

    def __init__(self, module: nn.Module, name: str):
        self.calls: list[OpCall] = []
        self._inputs: tuple[tuple, dict] = ((), {})
        self._module = module
        self._recorder = Recorder(module, lambda _n, _m: False, ops=True, prefix=name, sink=self)

    def run(self, *args: Any, **kwargs: Any) -> list[OpCall]:
        """Call the module on ``args``/``kwargs``; the op calls it made."""
        try:
            with self._recorder.recording_ops():
                self._module(*args, **kwargs)
        finally:
            self._recorder.remove()
        return self.calls

    def op_inputs(self, name: str, api: str, func: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self._inputs = (_snapshot(args), _snapshot(kwargs))

    def op_output(self, name: str, api: str, func: Callable[..., Any], output: Any) -> None:
        first = output if isinstance(output, torch.Tensor) else next(
            (x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)), None)
        if first is not None:
            args, kwargs = self._inputs
            self.calls.append(OpCall(name, api, func, args, kwargs, first.detach().clone()))
