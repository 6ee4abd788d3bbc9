"""The demo target's planted bug: a decode-attention kernel with the wrong softmax scale.

The model spec ``plugins/demo_bug.py:smollm2_with_planted_bug`` (the default target of
``workflows/llama2_bisect.yaml``) is the embedded SmolLM2 with this bug applied. It is a model
callable like any user's (``file.py:callable``): llmflow's model loading knows nothing of the demo,
and a user who sets ``target_model`` to a model of their own never gets the bug.

The bug is one that ports really ship: the kernel that attends one new token to the KV cache
(paged attention, in ATB and vLLM terms) computes its softmax scale from the model's hidden size,
1/sqrt(576), instead of the head size, 1/sqrt(64), in one decoder layer. The prefill runs another
kernel (flash attention) and is right, so the first token is right and the numbers drift from the
first decode step on: the kind of fault a prefill-only replay cannot see. The bisect should name
``model.layers.17.self_attn`` at a decode step, and its ``scaled_dot_product_attention`` op.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

LAYER = 17
DESCRIPTION = (f"The demo target carries a planted bug: the decode-attention kernel of layer {LAYER} "
               "takes its softmax scale from the hidden size instead of the head size "
               "(plugins/demo_bug.py)")


class _WrongScale(TorchFunctionMode):
    """Inside the attention's forward: scaled_dot_product_attention with the hidden-size scale."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.scale = 1.0 / math.sqrt(hidden_size)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            kwargs["scale"] = self.scale
        return func(*args, **kwargs)


def apply(model: nn.Module) -> None:
    """Plant the bug in ``model`` (SmolLM2: 30 Llama layers, hidden 576, 9 heads of 64)."""
    attention = model.model.layers[LAYER].self_attn
    hidden = model.config.hidden_size
    active: list[Any] = []

    def enter(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden_states = args[0] if args else kwargs["hidden_states"]
        if hidden_states.shape[-2] == 1:  # one new token: the decode kernel
            mode = _WrongScale(hidden)
            mode.__enter__()
            active.append(mode)

    def leave(_m: nn.Module, _args: tuple, _kwargs: dict, _out: Any) -> None:
        if active:
            active.pop().__exit__(None, None, None)

    attention.register_forward_pre_hook(enter, with_kwargs=True)
    attention.register_forward_hook(leave, with_kwargs=True, always_call=True)


def smollm2_with_planted_bug() -> tuple[nn.Module, Any]:
    """The demo's target: the embedded SmolLM2 with the bug applied, and its tokenizer."""
    from llmflow.models import load_model

    loaded = load_model("smollm2")
    apply(loaded.model)
    return loaded.model, loaded.tokenizer


smollm2_with_planted_bug.note = DESCRIPTION  # type: ignore[attr-defined]  (the console and verdict say it)
