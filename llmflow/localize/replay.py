"""Isolation replay: run each module of the TARGET model on the GOLDEN inputs; its own error.

Comparing two dumps module by module measures *inherited* error: a decoder layer's output is
mostly the residual stream, which carries every upstream rounding, so a fault deep in the stack
drowns in accumulated noise. Replaying a module on the golden model's inputs to that same module
(cast to the target's dtype/device, a KV cache included at a decode step) and comparing with the
golden output measures only what that module adds itself. That is what ``rank.py`` ranks. The
golden calls come from ``calls.py`` (a dump or an in-memory capture).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from llmflow.dump.memory import CacheSnapshot, Call, flatten_outputs
from llmflow.localize import moe
from llmflow.localize.calls import cast_inputs, written_kv
from llmflow.localize.own_error import own_error
from llmflow.structure import LayerStack, layer_of


def is_branch(name: str, module: nn.Module | None = None, stack: LayerStack | None = None) -> bool:
    """True for the modules isolation replay looks at: every module *inside* a decoder layer
    (attention, MLP, norms, projections, activations), and leaf modules outside the layer stack
    (final norm, lm_head). Decoder layers themselves are skipped: their output is mostly the
    residual stream, so their own error says little."""
    layer = layer_of(name, stack)
    if layer is not None:
        return name != layer
    return module is None or not any(True for _ in module.children())


@torch.no_grad()
def replay_call(module: nn.Module, call: Call, *, device: torch.device, dtype: torch.dtype,
                context: dict[str, Call] | None = None) -> dict[str, Any]:
    """Run ``module`` on the call's golden inputs (cast to ``dtype`` on ``device``); one row with
    the own-error metrics of output ``"0"`` (or the first recorded output).

    ``context`` holds the golden calls of the same layer: an MoE block is replayed with the golden
    routing taken from its router's call (``moe.replay_moe_block``)."""
    row: dict[str, Any] = {"name": call.name, "module_type": call.module_type or type(module).__name__}
    if not call.replayable:
        row.update(replayable=False, reason=call.reason)
        return row
    facts = None
    caches: list[Any] = []
    try:
        forced = moe.replay_moe_block(module, call.name, call, context or {}, device=device, dtype=dtype)
        if forced is not None:
            out, facts = forced
        else:
            out = module(*cast_inputs(call.args, device, dtype, module, caches),
                         **cast_inputs(call.kwargs, device, dtype, module, caches))
    except Exception as exc:  # a module that refuses the rebuilt inputs is reported, not fatal
        row.update(replayable=False, reason=f"replay failed: {type(exc).__name__}: {str(exc)[:160]}")
        return row
    flat = flatten_outputs(out)
    index = "0" if "0" in call.outputs else sorted(call.outputs)[0]
    if index not in flat:
        row.update(replayable=False, reason=f"replay gave no output {index}")
        return row
    row.update(replayable=True, output=index, **own_error(call.outputs[index], flat[index]))
    moe.add_expert_error(row, module, call, call.outputs[index], flat[index])
    choice = moe.choice_error(call.outputs, flat) if index == "0" else None
    if choice is not None:  # a router that also chooses: its choice is its own work too
        row["routing_weights"] = choice["detail"]
        # its two parts kept apart: each is measured against the golden router's own (rounding.py)
        row["logits_rel_l2"], row["routing_weights_rel_l2"] = row["rel_l2"], choice["rel_l2"]
        if choice["rel_l2"] > row["rel_l2"]:  # its error is the choice's (rank.py reads l2 first)
            row["rel_l2"] = choice["rel_l2"]
            row.pop("l2", None)
    kv = _cache_write_error(module, call, caches)
    if kv is not None:
        row["kv_cache_rel_l2"] = kv
    if facts is not None:
        row["routing"] = "golden"
        own = flatten_outputs(facts["own_routing_output"]).get(index)
        if own is not None:
            row["own_routing_rel_l2"] = own_error(call.outputs[index], own)["rel_l2"]
        row["routing_flips"] = facts["flips"]
    return row


def _cache_write_error(module: nn.Module, call: Call, caches: list[Any]) -> float | None:
    """rel_l2 of the keys and values the replayed module appended to its KV cache, against what
    the golden module appended: a cache written wrong (a lower dtype, a wrong rotary position on
    the keys) shows here even where the step's own output hides it."""
    idx = getattr(module, "layer_idx", None)
    before = next((v for v in (*call.args, *call.kwargs.values()) if isinstance(v, CacheSnapshot)), None)
    if not isinstance(idx, int) or before is None or call.cache_after is None or len(caches) != 1:
        return None
    golden, target = written_kv(before, call.cache_after, idx), written_kv(before, caches[0], idx)
    if golden is None or target is None or golden.shape != target.shape:
        return None
    return own_error(golden, target)["rel_l2"]


def replay_modules(model: nn.Module, calls: Iterable[Call] | dict[str, Call], *, device: torch.device,
                   dtype: torch.dtype, select: Callable[[str, nn.Module], bool] = is_branch,
                   stack: LayerStack | None = None,
                   advance: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Isolation replay of every selected module of ``model`` that has a recorded call.

    Calls arrive layer by layer (a dump in execution order, or one layer recomputed at a time);
    each is replayed with its layer's other calls as context. Returns one row per module
    (``replay_call``); modules with no call are skipped.
    """
    rows: list[dict[str, Any]] = []
    modules = dict(model.named_modules())

    def flush(group: dict[str, Call]) -> None:
        for call in group.values():
            module = modules.get(call.name)
            if module is None or not select(call.name, module):
                continue
            rows.append(replay_call(module, call, device=device, dtype=dtype, context=group))
            if advance is not None:
                advance()

    group: dict[str, Call] = {}
    current: str | None = None
    for call in calls.values() if isinstance(calls, dict) else calls:
        layer = layer_of(call.name, stack) or call.name
        if layer != current and group:
            flush(group)
            group = {}
        current = layer
        group.setdefault(call.name, call)
    flush(group)
    return rows
