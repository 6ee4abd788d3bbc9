"""Fault injection for Llama-style models, usable as a workflow ``patch`` / ``target_patch``.

Each fault mimics a real porting bug at one known module, so the bisect recipe can be checked
against ground truth:

=====================  =========================================================================
name                   what it breaks (in decoder layer N)
=====================  =========================================================================
scale_down_proj        ``mlp.down_proj`` output multiplied by 0.5 (a wrong dequant/scale factor)
wrong_eps              ``post_attention_layernorm`` epsilon 1e-6 -> 0.5 (a wrong config value)
wrong_act              ``mlp.act_fn`` SiLU -> ReLU (a wrong activation kernel)
noisy_q_proj           ``self_attn.q_proj`` output + 5% Gaussian noise (a flaky/low-precision kernel)
wrong_rope             ``self_attn`` container: rotary sin negated (a fused-attention bug, no leaf)
=====================  =========================================================================

Reference them as ``plugins/example_faults.py:<name>_layer_<N>``, e.g.
``llmflow run workflows/llama2_bisect.yaml \
--set target_patch=plugins/example_faults.py:scale_down_proj_layer_22``
(relative to the workflow file: ``../plugins/example_faults.py:...`` from ``workflows/``).
Any layer number works (module ``__getattr__`` builds the patch on demand); the functions
``make_fault(name, layer)`` and the FAULTS table are the programmatic way in.

Every patch is a callable ``patch(model) -> None`` that modifies the model in place before it is
moved to the target dtype/device, so hooks and attributes survive ``.to(...)``. The noise uses its
own seeded generator: the same patch gives the same fault every run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Patch = Callable[[nn.Module], None]


def _layer(model: nn.Module, index: int) -> nn.Module:
    """Decoder layer ``index`` of a Llama-style model (the module named ``*.layers.<index>``)."""
    for name, module in model.named_modules():
        if name == f"layers.{index}" or name.endswith(f".layers.{index}"):
            return module
    raise ValueError(f"example_faults: the model has no decoder layer {index}")


def scale_down_proj(layer: int, factor: float = 0.5) -> Patch:
    def patch(model: nn.Module) -> None:
        down = _layer(model, layer).mlp.down_proj
        down.register_forward_hook(lambda _m, _args, out: out * factor)
    return patch


def wrong_eps(layer: int, eps: float = 0.5, norm: str = "post_attention_layernorm") -> Patch:
    def patch(model: nn.Module) -> None:
        module = getattr(_layer(model, layer), norm)
        attr = "variance_epsilon" if hasattr(module, "variance_epsilon") else "eps"
        setattr(module, attr, eps)
    return patch


def wrong_act(layer: int) -> Patch:
    def patch(model: nn.Module) -> None:
        _layer(model, layer).mlp.act_fn = nn.ReLU()
    return patch


def noisy_q_proj(layer: int, rel_std: float = 0.05, seed: int = 0) -> Patch:
    def patch(model: nn.Module) -> None:
        def add_noise(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            noise = torch.randn(out.shape, generator=gen, dtype=torch.float32)
            scale = rel_std * out.float().std()
            return out + (noise.to(out.device) * scale).to(out.dtype)
        _layer(model, layer).self_attn.q_proj.register_forward_hook(add_noise)
    return patch


def wrong_rope(layer: int) -> Patch:
    """Negate sin of the rotary embedding inside one attention: no leaf module is wrong, only the
    container's own computation, so the verdict must name ``self_attn`` and an op inside it."""
    def patch(model: nn.Module) -> None:
        def flip(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            pe = kwargs.get("position_embeddings")
            if pe is not None:
                kwargs = {**kwargs, "position_embeddings": (pe[0], -pe[1])}
            return args, kwargs
        _layer(model, layer).self_attn.register_forward_pre_hook(flip, with_kwargs=True)
    return patch


FAULTS: dict[str, Callable[..., Patch]] = {
    "scale_down_proj": scale_down_proj, "wrong_eps": wrong_eps, "wrong_act": wrong_act,
    "noisy_q_proj": noisy_q_proj, "wrong_rope": wrong_rope,
}

#: the module each fault breaks, relative to its decoder layer (what a verdict should name)
FAULT_MODULES = {
    "scale_down_proj": "mlp.down_proj", "wrong_eps": "post_attention_layernorm",
    "wrong_act": "mlp.act_fn", "noisy_q_proj": "self_attn.q_proj", "wrong_rope": "self_attn",
}


def make_fault(name: str, layer: int) -> Patch:
    """The patch of fault ``name`` at decoder layer ``layer``."""
    if name not in FAULTS:
        raise ValueError(f"example_faults: unknown fault {name!r} (known: {', '.join(FAULTS)})")
    return FAULTS[name](layer)


_NAME_RE = re.compile(r"^(?P<fault>[a-z_]+?)_layer_(?P<layer>\d+)$")


def __getattr__(attr: str) -> Patch:
    """``scale_down_proj_layer_22`` and friends, built on demand (PEP 562)."""
    m = _NAME_RE.match(attr)
    if m and m.group("fault") in FAULTS:
        return make_fault(m.group("fault"), int(m.group("layer")))
    raise AttributeError(attr)


# the names the docs and tests use, spelled out so they are greppable
scale_down_proj_layer_1 = scale_down_proj(1)
scale_down_proj_layer_22 = scale_down_proj(22)
wrong_eps_layer_1 = wrong_eps(1)
wrong_act_layer_1 = wrong_act(1)
noisy_q_proj_layer_1 = noisy_q_proj(1)
