"""Module calls for replay: built from a dump, and turned into a replay's inputs.

A ``Call`` (``llmflow.dump.memory``) is one module call: positional and keyword inputs, outputs by
the dump's output index (``"0"``, ``"1.0"``). Calls come from a golden dump in module mode
(``calls_from_dump`` here) or from the recorder's memory sink during a golden run
(``llmflow.dump.memory.CallRecorder``, ``capture_calls``).

A KV cache is an input like any other at a decode step: the state the module reads. An in-memory
capture keeps it as a ``CacheSnapshot`` (the cache as the module found it, shared until used);
replaying a module turns the snapshot into a private copy in the replaying side's dtype and device
(``cast_inputs``), so the target's attention runs on the golden past keys and values and appends
its own new ones, as its decode kernel does. A dump holds no cache contents: at the prefill step
a recorded cache is empty, and becomes the empty cache a caller gives (``golden.prefill_cache``,
so an attention's cache write can be measured there too), else None; at a decode step it marks
the call not replayable (the bisect re-runs the golden model in memory instead). Any other input
that cannot be rebuilt marks the call not replayable, with the reason.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from llmflow.dump.arguments import Unrebuildable, decode_value, is_cache_type, rebuild_arguments
from llmflow.dump.memory import CacheSnapshot, Call, layer_kv
from llmflow.formats.base import DumpReader, Entry


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


def cache_class(model: nn.Module, kind: str) -> type | None:
    """The KV-cache class named ``kind`` (the type name a dump records) that a module re-run step
    after step from recorded inputs can be given empty, to fill with its own calls: transformers'
    ``DynamicCache``, or a subclass of it that the model's family defines beside its modeling code
    (MiniMax's keeps its linear-attention states in a list of its own). None for any other kind."""
    from transformers import DynamicCache

    if kind == "DynamicCache":
        return DynamicCache
    for cls in type(model).__mro__:
        found = getattr(sys.modules.get(cls.__module__), kind, None)
        if isinstance(found, type) and issubclass(found, DynamicCache):
            return found
    return None


def fresh_cache(model: nn.Module, kind: str = "DynamicCache") -> Any:
    """An empty cache of ``kind`` (see ``cache_class``; a ``DynamicCache`` where the model defines
    no such kind) for a module re-run step after step from recorded inputs, filled by its own
    calls; laid out by the model's config where the class takes one (the sliding-window layers of
    Gemma-2, Mistral ..., the linear-attention and convolution layers of the hybrid families)."""
    from transformers import DynamicCache

    cls = cache_class(model, kind) or DynamicCache
    config = getattr(model, "config", None)
    try:
        return cls(config=config) if config is not None else cls()
    except TypeError:  # a family's own cache built without a config (MiniMax's)
        return cls()


def _written_len(cache: Any, idx: int) -> int | None:
    """How many positions layer ``idx`` of a cache holds (its own count: a static layer's buffer
    is longer than what it holds)."""
    layers = (cache.cache if isinstance(cache, CacheSnapshot) else cache).layers
    if idx >= len(layers):  # a cache that adds its layers as they first write (MiniMax's): none yet
        return 0
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


# -- calls from a dump ----------------------------------------------------------------------------
def build_call(name: str, inputs: Iterable[tuple[str, Any]], outputs: Iterable[tuple[str, Any]],
               *, step: int = 0, module_type: str | None = None, cache: Any = None) -> Call:
    """A Call from ``(index, value)`` pairs as the dump writes them.

    ``value`` is a tensor, or a ``(json_value, pytype)`` pair for a non-tensor input. Positional
    indexes are ``"0"``, ``"1.0"``; keyword ones ``"kw:name"``, ``"kw:name.0"``. A KV cache, by
    keyword or by position, is empty at the prefill step (None); at a decode step its contents
    are not in the dump and the call is not replayable from it, unless ``cache`` is given: a cache
    object the caller keeps filled (a decoder layer re-run step after step from its dumped inputs
    writes its own keys and values into it), or at the prefill an empty ``CacheSnapshot`` (each
    run of the call writes into a private copy), passed where the dump recorded one.
    """
    call = Call(name, module_type)
    leaves: list[tuple[str, Any]] = []
    for index, value in inputs:
        if isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], torch.Tensor):
            json_value, pytype = value
            if is_cache_type(pytype) and cache is not None:
                value = cache
            elif is_cache_type(pytype) and step == 0:
                value = None  # the prefill step starts with an empty cache
            elif is_cache_type(pytype):
                call.reason = (f"input {index} is a KV cache ({pytype}) whose contents a dump does not "
                               "hold; a decode step is replayed from a golden re-run")
                value = None
            else:
                try:
                    value = decode_value(json_value, pytype)
                except Unrebuildable:
                    call.reason = f"input {index} is an opaque {pytype}"
                    value = None
        leaves.append((index, value))
    call.args, call.kwargs = rebuild_arguments(leaves)
    call.outputs = {i: v for i, v in outputs if isinstance(v, torch.Tensor)}
    if not call.outputs and call.reason is None:
        call.reason = "no output tensor recorded"
    return call


#: why a module call without recorded inputs cannot be replayed
NO_INPUTS = "no inputs recorded (dump with tensor_part 2)"


def first_call(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """A module's input and output entries at one step, of its first call only (a module called
    twice in one step: its inputs before its first output; each output index once)."""
    first_out = min((e.order for e in entries if e.kind == "output"), default=None)
    ins = [e for e in entries if e.kind == "input" and (first_out is None or e.order < first_out)]
    seen: set[str] = set()
    outs = [e for e in entries if e.kind == "output" and not (e.index in seen or seen.add(e.index))]
    return ins, outs


def entry_value(reader: DumpReader, e: Entry) -> Any:
    """What ``build_call`` takes for an input entry: its tensor, or ``(json_value, pytype)``."""
    if e.is_tensor:
        return reader.load(e) if e.has_data else (None, "statistics-only tensor")
    return (e.value, e.pytype)


def calls_from_dump(reader: DumpReader, step: int = 0, rank: int = 0,
                    names: set[str] | None = None, cache: Any = None) -> Iterator[Call]:
    """The module calls a dump recorded at ``step`` (module level, inputs and outputs), one at a
    time in execution order, tensors loaded lazily per call. ``names`` restricts which; ``cache``
    stands for a recorded KV cache (``build_call``)."""
    groups: dict[str, list[Entry]] = {}
    for e in reader.entries():
        if e.step == step and e.rank == rank and e.level == "module" and (names is None or e.name in names):
            groups.setdefault(e.name, []).append(e)
    for name, entries in groups.items():
        if not any(e.kind == "input" for e in entries):
            yield Call(name, entries[0].module_type, reason=NO_INPUTS)
            continue
        ins, outs = first_call(entries)
        call = build_call(name, [(e.index, entry_value(reader, e)) for e in ins],
                          [(e.index, reader.load(e)) for e in outs if e.is_tensor and e.has_data],
                          step=step, module_type=entries[0].module_type, cache=cache)
        if any(e.is_tensor and not e.has_data for e in ins):
            call.reason = "inputs dumped as statistics only (dump with data_mode tensor)"
        yield call
