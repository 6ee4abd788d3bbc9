"""Where the golden inputs of every module come from, as cheaply as possible.

Isolation replay needs, for each module, the golden model's inputs and output at the replay step.
Two sources, used per decoder layer:

  the golden dump itself, when it recorded the module (a full module-mode dump, tensor_part 2);
  the golden *decoder layer's* dumped inputs, re-run in memory through the golden model's layer
    (golden device and dtype, so bit-identical to what a full dump would have held) with every
    sub-module's call captured. The recipe dumps only the decoder layers' inputs and outputs, a
    few percent of a full module dump (the 1536-wide MLP intermediates dominate that), and lets
    the bisect recompute the rest layer by layer, never holding more than one layer in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from llmflow.formats.base import DumpReader
from llmflow.localize.rank import layer_of
from llmflow.localize.replay import Call, _cast, calls_from_dump, capture_calls


def golden_calls(reader: DumpReader, step: int, load_golden: Callable[[], Any],
                 stats: dict[str, int] | None = None) -> Iterator[Call]:
    """Every golden call at ``step``: the dumped ones, then for each dumped decoder layer whose
    sub-modules the dump lacks, the sub-module calls recomputed from the layer's inputs.

    ``load_golden()`` returns the golden LoadedModel (called only when a layer must be re-run).
    ``stats["recomputed_layers"]`` counts the layers re-run.
    """
    names = {e.name for e in reader.entries() if e.step == step and e.level == "module"}
    stats = stats if stats is not None else {}
    stats.setdefault("recomputed_layers", 0)
    for call in calls_from_dump(reader, step):
        yield call
        layer = call.name
        if layer_of(layer) != layer or not call.replayable:
            continue
        if any(n.startswith(layer + ".") for n in names):
            continue  # the dump has this layer's modules: nothing to recompute
        golden = load_golden()
        module = dict(golden.model.named_modules()).get(layer)
        if module is None:
            continue
        args, kwargs = _cast(call.args, golden.device, golden.dtype), _cast(call.kwargs, golden.device,
                                                                            golden.dtype)
        sub = capture_calls(module, lambda m=module, a=args, k=kwargs: m(*a, **k), prefix=layer)
        stats["recomputed_layers"] += 1
        yield from sub.values()


def golden_call(reader: DumpReader, step: int, name: str, load_golden: Callable[[], Any]) -> Call | None:
    """The golden call of one module: from the dump, else recomputed from its layer's inputs."""
    dumped = next(calls_from_dump(reader, step, names={name}), None)
    if dumped is not None and dumped.replayable:
        return dumped
    layer = layer_of(name)
    layer_call = next(calls_from_dump(reader, step, names={layer}), None) if layer else None
    if layer_call is None or not layer_call.replayable:
        return dumped
    golden = load_golden()
    module = dict(golden.model.named_modules())[layer]
    args = _cast(layer_call.args, golden.device, golden.dtype)
    kwargs = _cast(layer_call.kwargs, golden.device, golden.dtype)
    sub = capture_calls(module, lambda: module(*args, **kwargs), prefix=layer,
                        select=lambda n, _m: n == name)
    return sub.get(name, dumped)
