"""Module calls kept for replay: the inputs a golden module saw and the outputs it gave.

A ``Call`` is one module call: positional and keyword inputs, outputs by the dump's output index
(``"0"``, ``"1.0"``). Calls come from a golden dump in module mode (``calls_from_dump``) or from an
in-memory capture of a golden run (``CallRecorder``, ``capture_calls``).

A KV cache is an input like any other at a decode step: the state the module reads. An in-memory
capture keeps it as a ``CacheSnapshot`` (the cache as the module found it, shared until used);
replaying a module turns the snapshot into a private copy in the replaying side's dtype and device
(``cast_inputs``), so the target's attention runs on the golden past keys and values and appends
its own new ones, as its decode kernel does. A dump holds no cache contents: at the prefill step
a recorded cache is empty and becomes None; at a decode step it marks the call not replayable
(the bisect re-runs the golden model in memory instead). Any other input that cannot be rebuilt
marks the call not replayable, with the reason.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmflow.formats.base import DumpReader, Entry
from llmflow.structure import is_cache

SIMPLE_TYPES = ("NoneType", "bool", "int", "float", "str")


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


def is_cache_type(pytype: str | None) -> bool:
    """Does a dump's recorded type name denote a KV cache (``DynamicCache``, ``StaticCache`` ...)?"""
    return bool(pytype) and pytype.endswith("Cache")  # type: ignore[union-attr]


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
        if self.idx is not None and getattr(module, "layer_idx", None) == self.idx:
            out = copy.copy(self.cache)
            out.layers = list(self.cache.layers)
            out.layers[self.idx] = _cast_object(copy.deepcopy(self.cache.layers[self.idx]), device, dtype)
            return out
        return _cast_object(copy.deepcopy(self.cache), device, dtype)


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


def cast_inputs(value: Any, device: torch.device, dtype: torch.dtype, module: nn.Module | None = None,
                caches: list[Any] | None = None) -> Any:
    """Golden inputs for a replay on ``device`` in ``dtype``: tensors moved (floating ones cast),
    cache snapshots materialised as private copies for ``module`` (appended to ``caches``, to read
    back what the module wrote into them); plain values unchanged."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, CacheSnapshot):
        made = value.materialize(module, device, dtype)
        if caches is not None:
            caches.append(made)
        return made
    if isinstance(value, tuple):
        return tuple(cast_inputs(v, device, dtype, module, caches) for v in value)
    if isinstance(value, list):
        return [cast_inputs(v, device, dtype, module, caches) for v in value]
    if isinstance(value, dict):
        return {k: cast_inputs(v, device, dtype, module, caches) for k, v in value.items()}
    return value


def _written_len(cache: Any, idx: int) -> int | None:
    """How many positions layer ``idx`` of a cache holds (its own count: a static layer's buffer
    is longer than what it holds)."""
    layers = (cache.cache if isinstance(cache, CacheSnapshot) else cache).layers
    count = getattr(layers[idx], "get_seq_length", None)
    try:
        return int(count()) if callable(count) else None
    except Exception:  # an uninitialised layer refuses: it holds nothing
        return 0


def written_kv(before: CacheSnapshot | Any, after: CacheSnapshot | Any, idx: int) -> torch.Tensor | None:
    """The keys and values a module wrote into layer ``idx`` of a cache (``before`` and ``after``
    the call: snapshots or cache objects), concatenated along the last dimension: the positions
    between the layer's lengths before and after (appended by a dynamic cache, written in place
    into a static one, the newest ones of a sliding window); None for another cache layout."""
    def kv(c: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        return c.layer_kv(idx) if isinstance(c, CacheSnapshot) else layer_kv(c, idx)
    a = kv(after)
    n0, n1 = _written_len(before, idx), _written_len(after, idx)
    if a is None or n0 is None or n1 is None or n1 <= n0:
        return None
    keys, values = a
    held = keys.shape[-2]
    where = slice(n0, n1) if held >= n1 else slice(held - (n1 - n0), held)
    return torch.cat([keys[..., where, :], values[..., where, :]], dim=-1)


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


# -- calls from a dump ----------------------------------------------------------------------------
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
    indexes are ``"0"``, ``"1.0"``; keyword ones ``"kw:name"``, ``"kw:name.0"``. A KV cache, by
    keyword or by position, is empty at the prefill step (None); at a decode step its contents
    are not in the dump and the call is not replayable from it.
    """
    call = Call(name, module_type)
    pos: dict[str, Any] = {}
    kw: dict[str, Any] = {}
    for index, value in inputs:
        if isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], torch.Tensor):
            json_value, pytype = value
            if pytype in SIMPLE_TYPES or pytype is None:
                value = json_value
            elif is_cache_type(pytype) and step == 0:
                value = None  # the prefill step starts with an empty cache
            elif is_cache_type(pytype):
                call.reason = (f"input {index} is a KV cache ({pytype}) whose contents a dump does not "
                               "hold; a decode step is replayed from a golden re-run")
                value = None
            else:
                call.reason = f"input {index} is an opaque {pytype}"
                value = None
        if index.startswith("kw:"):
            _set_path(kw, index[3:].split("."), value)
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


# -- calls captured in memory ---------------------------------------------------------------------
class _Opaque:
    """An input that is neither a tensor, a plain value nor a cache: replay cannot rebuild it."""

    def __init__(self, value: Any):
        self.type = type(value).__name__


def _keep(value: Any, layer_idx: int | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
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


class CallRecorder:
    """Records the first call of every selected module of a model, in memory, while ``active``.

    The in-memory twin of a golden module dump at one step: inputs (caches as snapshots) and
    outputs are detached CPU copies. ``model`` may be a sub-module (a decoder layer) whose path
    in the whole model is ``prefix``.
    """

    def __init__(self, model: nn.Module, select: Callable[[str, nn.Module], bool], prefix: str = ""):
        self.calls: dict[str, Call] = {}
        self.active = True
        self._handles: list[Any] = []
        for sub, module in model.named_modules():
            name = f"{prefix}.{sub}" if prefix and sub else (sub or "")
            if name and name != prefix and select(name, module):
                self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.active or name in self.calls:
                return
            idx = getattr(module, "layer_idx", None)
            a, k = list(_keep(args, idx)), {key: _keep(v, idx) for key, v in kwargs.items()}
            self.calls[name] = Call(name, type(module).__name__, a, k, reason=_opaque_reason(a, k))
        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            call = self.calls.get(name)
            if self.active and call is not None and not call.outputs:
                call.outputs = {k: v.detach().cpu() for k, v in flatten_outputs(out).items()}
                cache = next((v for v in (*args, *kwargs.values()) if is_cache(v)), None)
                if cache is not None:
                    call.cache_after = CacheSnapshot(cache, getattr(module, "layer_idx", None))
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> CallRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@torch.no_grad()
def capture_calls(model: nn.Module, run: Callable[[], Any], *, select: Callable[[str, nn.Module], bool],
                  prefix: str = "") -> dict[str, Call]:
    """Record the first call of every selected module while ``run()`` executes (in memory)."""
    with CallRecorder(model, select, prefix) as rec:
        run()
    return rec.calls
