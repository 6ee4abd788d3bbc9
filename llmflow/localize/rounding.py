"""The target dtype's own rounding of one module: what tells a module that its dtype rounds more at
this input from one whose code is wrong.

The ranking (``rank.py``) compares a module's own error with the same module in the other layers.
A module whose input is unusual at this step rounds more than its peers in a lower dtype: an
attention whose scores are large (a family that does not scale them by 1/sqrt(head_dim), a layer
whose queries grow), a layer whose activations are larger. On a clean bf16 port such a module
stands out from its peers on rounding alone (3-6x on tiny Granite and Nemotron models). The golden
module itself, run in the target's dtype on the target's device on the same golden inputs, rounds
exactly as much; a fault in the target's code adds error beyond it. So a module that stands out is
named a fault only where its own error is ``ratio_threshold`` times that of the golden module run
so (``to_rounding``); one that is not is reported as sensitive to the dtype, not as a fault.

From a target dump (``isolate: target_dump``) the golden module, run on the target's recorded
inputs, is the reference; its rounding there is the same module cast to the dump's dtype on those
inputs (``target_dump.rounding_of``, on the golden's device). Where the two sides compute alike
(the same dtype on the same device), the golden module run so gives the golden output exactly: its
rounding is 0 and nothing is set aside. A module that routes tokens is checked with the golden
routing only (its own choice in the lower dtype may pick other experts: a discrete change).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from llmflow.dump.memory import Call
from llmflow.localize import moe
from llmflow.localize.own_error import ranked_l2
from llmflow.localize.replay import replay_call

#: the most candidates of one step checked against their golden module's rounding (each check is one
#: module replayed once more); past them the next candidate is named as the ranking gives it
ROUNDING_CHECKED = 8
#: a module whose parameters in the target's dtype take more than this is not copied for the check
#: (the experts of a large mixture of experts: tens of GB in one layer); its candidate stands as ranked
ROUNDING_COPY_LIMIT = 4 << 30
# the hook dictionaries a module carries: the copy gets empty ones (a streamed golden's hooks read
# the original layer's weights; a capture's hooks would record the copy's calls)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def cast_copy(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` as ``module.to(device, dtype)`` would make it (what ``load_model`` does
    to the target), made without first copying its weights in their own dtype, and without hooks."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(sub, attr, None)
            if hooks is not None:
                memo[id(hooks)] = type(hooks)()
    for p in module.parameters():
        data = p.detach().to(device=device, dtype=dtype if p.is_floating_point() else p.dtype)
        memo[id(p)] = nn.Parameter(data, requires_grad=False)
    for b in module.buffers():
        memo[id(b)] = b.detach().to(device=device, dtype=dtype if b.is_floating_point() else b.dtype)
    return copy.deepcopy(module, memo)


def copy_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """What ``cast_copy`` of ``module`` allocates for its floating parameters."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in module.parameters())


def rounding_row(golden_module: nn.Module, call: Call, *, device: torch.device, dtype: torch.dtype,
                 call_of: Any = None) -> dict[str, Any]:
    """``replay_call`` of the golden module cast to the target's ``dtype`` on its ``device``, on the
    golden ``call``: the row of own errors the dtype's rounding alone gives that module there. An
    MoE block is replayed with its golden routing (its router's call, from ``call_of``)."""
    context: dict[str, Call] = {call.name: call}
    router = moe.router_of(golden_module)
    if router is not None:  # its own routing in the lower dtype could pick other experts: not rounding
        routed = call_of(f"{call.name}.{router[0]}") if call_of is not None else None
        if routed is None:
            return {"name": call.name, "replayable": False, "reason": "no golden router call"}
        context[routed.name] = routed
    try:
        cast = cast_copy(golden_module, device, dtype)
        return replay_call(cast, call, device=device, dtype=dtype, context=context)
    except Exception as exc:  # (a device too full for the copy, a module that cannot be copied)
        return {"name": call.name, "replayable": False, "reason": f"{type(exc).__name__}: {str(exc)[:160]}"}


def to_rounding(candidate: dict[str, Any], rounding: dict[str, Any], *, kv_cache: bool) -> float | None:
    """How many times the golden module's own rounding (``rounding_row``) the candidate's own error
    is, measured alike (``_relative``; a KV cache write's ``kv_cache_rel_l2``); None where the golden
    module run so has no error (the two sides compute alike) or the replay gave none."""
    if not rounding.get("replayable") or rounding.get("routing_flips"):
        return None  # (an MoE block whose own routing in the lower dtype picks other experts)
    if rounding.get("routing_weights") is not None:  # a router that also chooses: its logits and
        # its weights where the experts agree, each against the golden router's own, the larger
        # ratio (the golden router rounds its weights as much where they are a discontinuous
        # function of the logits: PhiMoE's sparsemixer keeps the experts within a margin of the
        # best, and a near tie moves one across; its logits say whether they are the golden's)
        parts = [(candidate.get(key), rounding.get(key))
                 for key in ("logits_rel_l2", "routing_weights_rel_l2")]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for part in parts for v in part):
            return None
        # (a part with no error on either side says nothing; one the golden router has none of is
        # the target's own)
        ratios = [own / base if base > 0 else math.inf for own, base in parts if own > 0 or base > 0]
        return max(ratios) if ratios else None
    if candidate.get("expert_rel") is not None:  # its worst expert's tokens: the copy's worst may be
        return None  # another expert's, a larger baseline that would set a rare expert's fault aside
    if kv_cache:
        own, base = candidate.get("rel_l2"), rounding.get("kv_cache_rel_l2")
    else:
        own, base = _relative(candidate), _relative(rounding)
    if not isinstance(own, (int, float)) or not isinstance(base, (int, float)):
        return None
    if not math.isfinite(own) or not math.isfinite(base) or base <= 0:
        return None
    return own / base


def _relative(row: dict[str, Any]) -> Any:
    """A row's error as the ranking measures it (``ranked_l2`` over its golden norm), else its
    ``rel_l2`` (a router whose choice is its error)."""
    l2, norm = ranked_l2(row), row.get("norm")
    if isinstance(l2, float) and isinstance(norm, float) and norm > 0:
        return l2 / norm
    return row.get("rel_l2")
