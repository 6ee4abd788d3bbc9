"""Fault injection for any decoder family, usable as a workflow ``patch`` / ``target_patch``.

Each fault mimics a real porting bug at one known module, so a bisect can be checked against
ground truth. The decoder layer and its parts are found from the model's structure
(``llmflow.structure``), not from Llama's names, so every patch works on Llama, Qwen, Mistral,
Gemma, Phi, GPT-2, GPT-NeoX and the MoE families alike.

Prefill and decode (faults that act on every forward call):

=====================  =========================================================================
name                   what it breaks (in decoder layer N)
=====================  =========================================================================
scale_down_proj        the MLP's output projection scaled by 0.5 (a wrong dequant/scale factor);
                       in a mixture-of-experts layer, its shared expert's
per_tensor_int8        the MLP's output projection's input quantized to int8 with one scale for
                       the whole tensor where it should take one per token (a W8A8 kernel given
                       the wrong granularity): a token of massive activation sets the scale and
                       rounds the other tokens to zero; at a decode step the one token is its own
                       tensor, so this breaks the prefill alone
wrong_eps              the block's last norm: epsilon -> 0.5 (a wrong config value)
wrong_act              the MLP's activation -> ReLU (a wrong activation kernel); in a
                       mixture-of-experts layer, its shared expert's
noisy_q_proj           the attention's first projection + 5% Gaussian noise (a flaky kernel)
scale_attn_out         the attention's output scaled by 1.5 (a wrong output scale)
wrong_rope             the attention's rotary sin negated (a fused-attention bug, no leaf module)
scale_expert           MoE: one expert's (expert 1) output weights scaled by 1.5
scale_experts          MoE: every expert's output weights scaled by 1.1
wrong_router           MoE: the router's weights for expert 0 scaled by 4 (a wrong gate weight)
scale_layer_code       the decoder layer's own forward: its output scaled by 1.2 after its modules
                       ran (a residual add or a scale in the layer's code; no module is wrong)
hand_attention         the attention re-implemented with other ops, same math (no fault: the op
                       level is not comparable with the golden's)
hand_attention_mask    the same, its causal mask off by one (each query sees the next position)
hand_attention_overflow the same, its softmax without the max-subtraction (Inf/NaN in float16
                       wherever scores exceed ~11; see ``sharpen_attention`` for such scores)
=====================  =========================================================================

Decode only (the attention kernel that runs on one new token against the KV cache; the prefill
is untouched, as when a port's paged-attention kernel is wrong and its flash-attention is not):

=====================  =========================================================================
decode_attn_scale      the attention's output scaled by 3
decode_softmax_scale   softmax temperature wrong: scores scaled by 2.5 (a head-dim vs hidden-size
                       scale constant)
decode_rope_shift      rotary angles of the new token one position ahead
decode_cache_fp8       the new key and value stored through float8 (a cache written in a lower dtype)
decode_mask_oldest     the 4 oldest cached positions masked out
decode_layer_code      the decoder layer's output scaled by 1.2 at decode steps (its own code on
                       the decode path; no module is wrong)
=====================  =========================================================================

Outside the decoder layers (one module of the model; no layer number):

=====================  =========================================================================
scale_embedding        the input embedding's output scaled by 1.3 (an embedding scale applied
                       twice or dropped, as Gemma's sqrt(hidden) normaliser)
scale_final_norm       the final norm's output scaled by 1.5 (a final norm whose weight is read
                       as w where the model means 1 + w)
scale_lm_head          lm_head's output scaled by 1.3 (a wrong dequant scale of the output
                       projection)
=====================  =========================================================================

Every layer at once (a kernel, scale or weight conversion every layer's copy uses, the port bug
no layer-against-layer ranking can show): ``<name>_every_layer``, e.g. ``scale_down_proj_every_layer``.

Reference them as ``plugins/example_faults.py:scale_final_norm``, the others as
``plugins/example_faults.py:<name>_layer_<N>``, e.g.
``llmflow run workflows/llama2_bisect.yaml --set target_model=smollm2 \
--set target_patch=../plugins/example_faults.py:scale_down_proj_layer_22``
(relative to the workflow file). Any layer number works (module ``__getattr__`` builds the patch
on demand); ``make_fault(name, layer)`` and the FAULTS table are the programmatic way in.

Every patch is a callable ``patch(model) -> None`` that modifies the model in place before it is
moved to the target dtype/device, so hooks and attributes survive ``.to(...)``. The noise uses its
own seeded generator: the same patch gives the same fault every run.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from llmflow.structure import block_roles, find_cache, find_layer_stack

Patch = Callable[[nn.Module], None]


def _layer(model: nn.Module, index: int) -> tuple[str, nn.Module]:
    """Decoder layer ``index`` (its path and module), found from the model's structure."""
    stack = find_layer_stack(model)
    if stack is None or not 0 <= index < len(stack.layers):
        n = len(stack.layers) if stack else 0
        raise ValueError(f"example_faults: the model has no decoder layer {index} ({n} layers)")
    return stack.layers[index], dict(model.named_modules())[stack.layers[index]]


def part(model: nn.Module, index: int, role: str, which: int = 0) -> nn.Module:
    """The ``which``-th child of decoder layer ``index`` with ``role`` (attention, mlp, norm, moe,
    router, experts: see ``llmflow.structure.block_roles``)."""
    name, block = _layer(model, index)
    names = block_roles(block, name).get(role, [])
    if not names:
        raise ValueError(f"example_faults: layer {index} ({type(block).__name__}) has no {role}")
    return dict(model.named_modules())[names[which]]


def part_name(model: nn.Module, index: int, role: str, which: int = -1) -> str:
    """The module path ``part`` returns, relative to the decoder layer."""
    name, block = _layer(model, index)
    return block_roles(block, name).get(role, [])[which][len(name) + 1:]


def _projections(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Direct children that are matrix products (Linear, GPT-2's Conv1D, ...), in order."""
    return [(n, c) for n, c in module.named_children()
            if isinstance(getattr(c, "weight", None), torch.Tensor) and c.weight.dim() == 2
            and "norm" not in type(c).__name__.lower() and "embedding" not in type(c).__name__.lower()]


def _activation_name(module: nn.Module) -> str | None:
    """The direct child of ``module`` that is its activation function, or None."""
    for n, c in module.named_children():
        cls = type(c).__name__.lower()
        if "act" in n or any(w in cls for w in ("gelu", "silu", "relu", "activation", "tanh")):
            return n
    return None


def _activation(module: nn.Module) -> str:
    name = _activation_name(module)
    if name is None:
        raise ValueError(f"example_faults: no activation module in {type(module).__name__}")
    return name


def _dense_mlp(model: nn.Module, layer: int) -> tuple[str, nn.Module]:
    """The MLP every token of decoder layer ``layer`` runs through (its path and module): the
    layer's MLP, or in a mixture-of-experts block its shared expert (a child with projections and
    an activation of its own; the router and the routed experts have none). A block of routed
    experts alone has no such MLP: its faults are scale_expert, scale_experts and wrong_router."""
    base, block = _layer(model, layer)
    roles = block_roles(block, base)
    modules = dict(model.named_modules())
    if roles.get("mlp"):
        return roles["mlp"][0], modules[roles["mlp"][0]]
    for moe in roles.get("moe", []):
        for attr, child in modules[moe].named_children():
            if len(_projections(child)) >= 2 and _activation_name(child) is not None:
                return f"{moe}.{attr}", child
    if roles.get("moe"):
        raise ValueError(f"example_faults: layer {layer} ({type(block).__name__}) has no dense MLP: its "
                         "mixture of experts has no shared expert (its faults: scale_expert, scale_experts, "
                         "wrong_router)")
    raise ValueError(f"example_faults: layer {layer} ({type(block).__name__}) has no MLP module: its feed-"
                     "forward Linear layers sit in the layer itself (its faults: scale_attn_out, wrong_eps)")


def _first_tensor(out: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """The first tensor of a module's output, and how to put a replacement back."""
    if isinstance(out, torch.Tensor):
        return out, lambda t: t
    return out[0], lambda t: (t, *out[1:])


def _scale_output(module: nn.Module, factor: float, when: Callable[..., bool] | None = None) -> None:
    def hook(_m: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if when is not None and not when(args, kwargs):
            return None
        t, put = _first_tensor(out)
        return put(t * factor)
    module.register_forward_hook(hook, with_kwargs=True)


# -- faults on every call -------------------------------------------------------------------------
def scale_down_proj(layer: int, factor: float = 0.5) -> Patch:
    def patch(model: nn.Module) -> None:
        _scale_output(_projections(_dense_mlp(model, layer)[1])[-1][1], factor)
    return patch


def per_tensor_int8(layer: int) -> Patch:
    def quantize(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        scale = x.detach().abs().amax().clamp(min=1e-12) / 127  # one scale for every token
        return ((x / scale).round().clamp(-127, 127) * scale, *args[1:]), kwargs

    def patch(model: nn.Module) -> None:
        _projections(_dense_mlp(model, layer)[1])[-1][1].register_forward_pre_hook(quantize, with_kwargs=True)
    return patch


def _norm_name(model: nn.Module, layer: int) -> str:
    """The block's second norm (before the MLP) where it has two or more, else its only one."""
    base, block = _layer(model, layer)
    norms = block_roles(block, base).get("norm", [])
    if not norms:
        raise ValueError(f"example_faults: layer {layer} ({type(block).__name__}) has no norm")
    return norms[min(1, len(norms) - 1)]


def wrong_eps(layer: int, eps: float = 0.5) -> Patch:
    def patch(model: nn.Module) -> None:
        module = dict(model.named_modules())[_norm_name(model, layer)]
        attr = next(a for a in ("variance_epsilon", "eps", "epsilon") if hasattr(module, a))
        setattr(module, attr, eps)
    return patch


def wrong_act(layer: int) -> Patch:
    def patch(model: nn.Module) -> None:
        mlp = _dense_mlp(model, layer)[1]
        setattr(mlp, _activation(mlp), nn.ReLU())
    return patch


def noisy_q_proj(layer: int, rel_std: float = 0.05, seed: int = 0) -> Patch:
    def patch(model: nn.Module) -> None:
        def add_noise(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            noise = torch.randn(out.shape, generator=gen, dtype=torch.float32)
            scale = rel_std * out.float().std()
            return out + (noise.to(out.device) * scale).to(out.dtype)
        _projections(part(model, layer, "attention"))[0][1].register_forward_hook(add_noise)
    return patch


def scale_attn_out(layer: int, factor: float = 1.5) -> Patch:
    def patch(model: nn.Module) -> None:
        _scale_output(part(model, layer, "attention"), factor)
    return patch


def wrong_rope(layer: int) -> Patch:
    """Negate sin of the rotary embedding inside one attention: no leaf module is wrong, only the
    container's own computation, so the verdict must name the attention and an op inside it."""
    def patch(model: nn.Module) -> None:
        def flip(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            pe = kwargs.get("position_embeddings")
            if pe is not None:
                kwargs = {**kwargs, "position_embeddings": (pe[0], -pe[1])}
            return args, kwargs
        part(model, layer, "attention").register_forward_pre_hook(flip, with_kwargs=True)
    return patch


def _expert_weights(model: nn.Module, layer: int) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of every expert's output projection in layer ``layer``'s MoE: the
    last experts module that is not a shared expert (JetMoE's output_linear after its input_linear)."""
    name, block = _layer(model, layer)
    found = [n for n in block_roles(block, name).get("experts", []) if "shared" not in n.rsplit(".", 1)[-1]]
    if not found:
        raise ValueError(f"example_faults: layer {layer} ({type(block).__name__}) has no routed experts")
    experts = dict(model.named_modules())[found[-1]]
    for attr in ("down_proj", "weight"):  # fused: one [E, out, in] tensor (JetMoE's is its weight)
        if isinstance(getattr(experts, attr, None), torch.Tensor) and getattr(experts, attr).dim() == 3:
            return [(experts, attr)]
    return [(_projections(e)[-1][1], "weight") for e in experts.children()]


def scale_expert(layer: int, expert: int = 1, factor: float = 1.5) -> Patch:
    def patch(model: nn.Module) -> None:
        with torch.no_grad():
            found = _expert_weights(model, layer)
            if len(found) == 1:  # fused
                getattr(found[0][0], found[0][1])[expert].mul_(factor)
            else:
                found[expert][0].weight.mul_(factor)
    return patch


def scale_experts(layer: int, factor: float = 1.1) -> Patch:
    def patch(model: nn.Module) -> None:
        with torch.no_grad():
            for module, attr in _expert_weights(model, layer):
                getattr(module, attr).mul_(factor)
    return patch


def wrong_router(layer: int, expert: int = 0, factor: float = 4.0) -> Patch:
    def patch(model: nn.Module) -> None:
        with torch.no_grad():
            part(model, layer, "router").weight[expert].mul_(factor)
    return patch


# -- decode-only faults ---------------------------------------------------------------------------
def _hidden(args: tuple, kwargs: dict) -> torch.Tensor | None:
    h = args[0] if args else kwargs.get("hidden_states")
    return h if isinstance(h, torch.Tensor) else None


def _decoding(args: tuple, kwargs: dict) -> bool:
    """Is this attention call the decode kernel's: one new token (the prefill sees the prompt)?"""
    h = _hidden(args, kwargs)
    return h is not None and h.dim() >= 2 and h.shape[-2] == 1


def decode_attn_scale(layer: int, factor: float = 3.0) -> Patch:
    def patch(model: nn.Module) -> None:
        _scale_output(part(model, layer, "attention"), factor, when=_decoding)
    return patch


class _SoftmaxScale(TorchFunctionMode):
    """Scales the attention scores (the scale of scaled_dot_product_attention, or the input of a
    softmax) by ``factor``: a wrong temperature in the attention kernel."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            q = args[0]
            scale = kwargs.get("scale") or 1 / math.sqrt(q.shape[-1])
            kwargs["scale"] = scale * self.factor
        elif func in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax):
            args = (args[0] * self.factor, *args[1:])
        return func(*args, **kwargs)


def _around(module: nn.Module, enter: Callable[[tuple, dict], Any], leave: Callable[[Any], None]) -> None:
    """Run ``enter(args, kwargs)`` before each call of ``module`` and ``leave(token)`` after it."""
    tokens: list[Any] = []

    def pre(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens.append(enter(args, kwargs))

    def post(_m: nn.Module, _args: tuple, _kwargs: dict, _out: Any) -> None:
        if tokens:
            leave(tokens.pop())
    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True, always_call=True)


def decode_softmax_scale(layer: int, factor: float = 2.5) -> Patch:
    def patch(model: nn.Module) -> None:
        def enter(args: tuple, kwargs: dict) -> Any:
            if not _decoding(args, kwargs):
                return None
            mode = _SoftmaxScale(factor)
            mode.__enter__()
            return mode

        def leave(mode: Any) -> None:
            if mode is not None:
                mode.__exit__(None, None, None)
        _around(part(model, layer, "attention"), enter, leave)
    return patch


def _rotary(model: nn.Module) -> nn.Module:
    found = [m for m in model.modules() if "rotary" in type(m).__name__.lower()
             and isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        raise ValueError(f"example_faults: {type(model).__name__} has no rotary embedding")
    return found[0]


def decode_rope_shift(layer: int, positions: int = 1) -> Patch:
    """The new token's rotary angles ``positions`` ahead: cos/sin rotated by ``positions`` times
    each frequency (cos(a+b) = cos a cos b - sin a sin b; complex angles, Llama 4's, multiplied by
    the turn), as a kernel with an off-by-one cache position would compute them."""
    def patch(model: nn.Module) -> None:
        rotary = _rotary(model)

        def shift(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            pe = kwargs.get("position_embeddings")
            if pe is None or not _decoding(args, kwargs):
                return None
            if isinstance(pe, torch.Tensor) and pe.is_complex():  # Llama 4: each angle a unit complex number
                f = rotary.inv_freq.to(pe.device, torch.float32) * positions
                turn = torch.polar(torch.ones_like(f), f).to(pe.dtype)
                return args, {**kwargs, "position_embeddings": pe * turn}
            cos, sin = pe
            f = rotary.inv_freq.to(cos.device, torch.float32) * positions
            f = torch.cat([f, f])[: cos.shape[-1]]
            c, s = torch.cos(f).to(cos.dtype), torch.sin(f).to(cos.dtype)
            return args, {**kwargs, "position_embeddings": (cos * c - sin * s, sin * c + cos * s)}
        part(model, layer, "attention").register_forward_pre_hook(shift, with_kwargs=True)
    return patch


class _LossyCache:
    """A cache whose ``update`` stores the new keys and values through a lower dtype."""

    def __init__(self, cache: Any, dtype: torch.dtype):
        self._cache, self._dtype = cache, dtype

    def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        key, value = (x.to(self._dtype).to(x.dtype) for x in (key, value))
        return self._cache.update(key, value, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def decode_cache_fp8(layer: int) -> Patch:
    dtype = getattr(torch, "float8_e4m3fn", torch.bfloat16)

    def patch(model: nn.Module) -> None:
        def lossy(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            found = find_cache(args, kwargs)
            if found is None or not _decoding(args, kwargs):
                return None
            where, cache = found
            wrapped = _LossyCache(cache, dtype)
            if isinstance(where, int):
                return (*args[:where], wrapped, *args[where + 1:]), kwargs
            return args, {**kwargs, where: wrapped}
        part(model, layer, "attention").register_forward_pre_hook(lossy, with_kwargs=True)
    return patch


def decode_mask_oldest(layer: int, drop: int = 4) -> Patch:
    """The decode kernel masks the ``drop`` oldest cached positions (a wrong window start)."""
    def patch(model: nn.Module) -> None:
        def mask(m_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            found = find_cache(args, kwargs)
            h = _hidden(args, kwargs)
            if found is None or h is None or not _decoding(args, kwargs):
                return None
            old = kwargs.get("attention_mask")
            if isinstance(old, torch.Tensor) and old.dtype == torch.bool:  # True: attend
                m = old.clone()
                m[..., :drop] = False
            elif isinstance(old, torch.Tensor):  # additive
                m = old.clone()
                m[..., :drop] = torch.finfo(m.dtype).min
            else:  # no mask: every cached position plus the new token (a cache's default is layer 0)
                n = int(found[1].get_seq_length(getattr(m_, "layer_idx", 0))) + 1
                m = torch.zeros(h.shape[0], 1, 1, n, dtype=h.dtype, device=h.device)
                m[..., : min(drop, n - 1)] = torch.finfo(h.dtype).min
            return args, {**kwargs, "attention_mask": m}
        part(model, layer, "attention").register_forward_pre_hook(mask, with_kwargs=True)
    return patch


# -- a re-implemented attention ---------------------------------------------------------------
def _hand_attention_forward(mode: str) -> Callable[..., Any]:
    """A hand-written attention forward for the Llama-style attention modules (Llama, Qwen2,
    Mistral, ...: ``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``head_dim``, ``scaling``,
    ``layer_idx``), computed with other ops than transformers' own, as a port's fused kernel is:
    its own rotary embedding (halves instead of ``rotate_half``), its own GQA (``repeat_interleave``),
    its own causal mask from the cache length (the model's mask is not read), matmul and softmax.

    ``mode``: ``"exact"`` the same math; ``"naive_softmax"`` a softmax without the max-subtraction
    (``exp(s) / sum(exp(s))`` in the model's dtype: in float16 any score above ~11 overflows to
    Inf and the row becomes NaN); ``"mask_off_by_one"`` each query also sees the next position."""
    def forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: Any = None, past_key_values: Any = None, **kwargs: Any) -> Any:
        cache = past_key_values if past_key_values is not None else kwargs.get("past_key_value")
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, -1, self.head_dim).permute(0, 2, 1, 3)
        k = self.k_proj(hidden_states).view(b, n, -1, self.head_dim).permute(0, 2, 1, 3)
        v = self.v_proj(hidden_states).view(b, n, -1, self.head_dim).permute(0, 2, 1, 3)
        cos, sin = position_embeddings
        half = self.head_dim // 2
        c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        q, k = rotate(q), rotate(k)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        total = k.shape[-2]
        rows = torch.arange(total - n, total, device=q.device).unsqueeze(-1)
        cols = torch.arange(total, device=q.device)
        future = cols > rows + (1 if mode == "mask_off_by_one" else 0)
        scores = scores.masked_fill(future, float("-inf"))
        if mode == "naive_softmax":
            e = torch.exp(scores)
            weights = e / e.sum(dim=-1, keepdim=True)
        else:
            weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(weights, v).permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.o_proj(out), weights
    return forward


def hand_attention(layer: int | None, mode: str = "exact") -> Patch:
    """Replace the attention of decoder layer ``layer`` (None: of every layer) by the hand-written
    one (``_hand_attention_forward``)."""
    def patch(model: nn.Module) -> None:
        stack = find_layer_stack(model)
        n = len(stack.layers) if stack else 0
        for index in range(n) if layer is None else [layer]:
            attention = part(model, index, "attention")
            missing = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                       if not isinstance(getattr(attention, n, None), nn.Module)]
            if missing:  # a latent (DeepSeek) or fused (GPT-2's c_attn) attention has no such parts
                raise ValueError(f"example_faults: hand_attention re-implements Llama-style attention; "
                                 f"layer {index}'s {type(attention).__name__} has no {', '.join(missing)}")
            attention.forward = types.MethodType(_hand_attention_forward(mode), attention)
    return patch


def hand_attention_overflow(layer: int | None) -> Patch:
    return hand_attention(layer, "naive_softmax")


def hand_attention_mask(layer: int | None) -> Patch:
    return hand_attention(layer, "mask_off_by_one")


def scale_layer_code(layer: int, factor: float = 1.2) -> Patch:
    def patch(model: nn.Module) -> None:
        _scale_output(_layer(model, layer)[1], factor)
    return patch


def decode_layer_code(layer: int, factor: float = 1.2) -> Patch:
    def patch(model: nn.Module) -> None:
        _scale_output(_layer(model, layer)[1], factor, when=_decoding)
    return patch


def sharpen_attention(layer: int, factor: float = 14.0) -> Patch:
    """Scale layer ``layer``'s query and key projections by ``factor`` each: its attention scores
    grow by ``factor**2`` (a tiny model's scores of ~0.1 become the 17-24 a trained LLM reaches).
    A property of the model, for the golden and the target alike, not a fault."""
    def patch(model: nn.Module) -> None:
        projections = _projections(part(model, layer, "attention"))[:2]  # q, k (Llama order)
        with torch.no_grad():
            for _name, proj in projections:
                proj.weight.mul_(factor)
                if getattr(proj, "bias", None) is not None:
                    proj.bias.mul_(factor)
    return patch


# -- faults outside the decoder layers ------------------------------------------------------------
def final_norm(model: nn.Module) -> tuple[str, nn.Module]:
    """The model's last norm outside its decoder layers (``model.norm``, GPT-2's ``ln_f``)."""
    stack = find_layer_stack(model)
    norms = [(n, m) for n, m in model.named_modules()
             if n and "norm" in type(m).__name__.lower() and not any(True for _ in m.children())
             and (stack is None or stack.layer_of(n) is None)]
    if not norms:
        raise ValueError(f"example_faults: {type(model).__name__} has no norm outside its decoder layers")
    return norms[-1]


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def scale_embedding(model: nn.Module, factor: float = 1.3) -> None:
    _scale_output(model.get_input_embeddings(), factor)


def scale_final_norm(model: nn.Module, factor: float = 1.5) -> None:
    _scale_output(final_norm(model)[1], factor)


def scale_lm_head(model: nn.Module, factor: float = 1.3) -> None:
    # the output's hook, not the weight: a tied lm_head shares its weight with the embedding
    _scale_output(model.get_output_embeddings(), factor)


#: fault -> the full path of the module it breaks, for the faults outside the decoder layers
OUTSIDE_FAULTS: dict[str, tuple[Patch, Callable[[nn.Module], str]]] = {
    "scale_embedding": (scale_embedding, lambda m: _module_name(m, m.get_input_embeddings())),
    "scale_final_norm": (scale_final_norm, lambda m: final_norm(m)[0]),
    "scale_lm_head": (scale_lm_head, lambda m: _module_name(m, m.get_output_embeddings())),
}


FAULTS: dict[str, Callable[..., Patch]] = {
    "scale_down_proj": scale_down_proj, "per_tensor_int8": per_tensor_int8, "wrong_eps": wrong_eps,
    "wrong_act": wrong_act,
    "noisy_q_proj": noisy_q_proj, "scale_attn_out": scale_attn_out, "wrong_rope": wrong_rope,
    "scale_expert": scale_expert, "scale_experts": scale_experts, "wrong_router": wrong_router,
    "decode_attn_scale": decode_attn_scale, "decode_softmax_scale": decode_softmax_scale,
    "decode_rope_shift": decode_rope_shift, "decode_cache_fp8": decode_cache_fp8,
    "decode_mask_oldest": decode_mask_oldest, "scale_layer_code": scale_layer_code,
    "decode_layer_code": decode_layer_code,
    "hand_attention": hand_attention,
    "hand_attention_overflow": hand_attention_overflow, "hand_attention_mask": hand_attention_mask,
}

#: the module each fault breaks on Llama-named models, relative to its decoder layer
FAULT_MODULES = {
    "scale_down_proj": "mlp.down_proj", "wrong_eps": "post_attention_layernorm",
    "wrong_act": "mlp.act_fn", "noisy_q_proj": "self_attn.q_proj", "scale_attn_out": "self_attn",
    "wrong_rope": "self_attn",
}
#: decode-only faults: the verdict must name the layer's attention and a step > 0
DECODE_FAULTS = ("decode_attn_scale", "decode_softmax_scale", "decode_rope_shift", "decode_cache_fp8",
                 "decode_mask_oldest")


def faulty_module(model: nn.Module, name: str, layer: int) -> str:
    """The full path of the module fault ``name`` breaks in ``model`` (any family)."""
    base, _ = _layer(model, layer)
    if name in ("scale_layer_code", "decode_layer_code"):
        return base
    if name in ("scale_down_proj", "per_tensor_int8"):
        path, mlp = _dense_mlp(model, layer)
        return f"{path}.{_projections(mlp)[-1][0]}"
    if name == "wrong_act":
        path, mlp = _dense_mlp(model, layer)
        return f"{path}.{_activation(mlp)}"
    if name == "wrong_eps":
        return _norm_name(model, layer)
    if name == "noisy_q_proj":
        att = part(model, layer, "attention")
        return f"{base}.{part_name(model, layer, 'attention', 0)}.{_projections(att)[0][0]}"
    if name in ("scale_expert", "scale_experts"):
        return f"{base}.{part_name(model, layer, 'experts', 0)}"
    if name == "wrong_router":
        return f"{base}.{part_name(model, layer, 'router', 0)}"
    return f"{base}.{part_name(model, layer, 'attention', 0)}"


def make_fault(name: str, layer: int) -> Patch:
    """The patch of fault ``name`` at decoder layer ``layer``."""
    if name not in FAULTS:
        raise ValueError(f"example_faults: unknown fault {name!r} (known: {', '.join(FAULTS)})")
    return FAULTS[name](layer)


def every_layer(name: str) -> Patch:
    """The patch of fault ``name`` in every decoder layer of the model it is given."""
    make_fault(name, 0)  # an unknown name fails here, not when the model is patched

    def patch(model: nn.Module) -> None:
        stack = find_layer_stack(model)
        if stack is None:
            raise ValueError("example_faults: no decoder layer stack in this model")
        for index in range(len(stack.layers)):
            make_fault(name, index)(model)

    return patch


_NAME_RE = re.compile(r"^(?P<fault>[a-z0-9_]+?)_(?:layer_(?P<layer>\d+)|every_layer)$")


def __getattr__(attr: str) -> Patch:
    """``scale_down_proj_layer_22``, ``scale_down_proj_every_layer`` and friends, built on demand
    (PEP 562)."""
    m = _NAME_RE.match(attr)
    if m and m.group("fault") in FAULTS:
        fault, layer = m.group("fault"), m.group("layer")
        return make_fault(fault, int(layer)) if layer is not None else every_layer(fault)
    raise AttributeError(attr)


# the names the docs and tests use, spelled out so they are greppable
scale_down_proj_layer_1 = scale_down_proj(1)
scale_down_proj_layer_22 = scale_down_proj(22)
wrong_eps_layer_1 = wrong_eps(1)
wrong_act_layer_1 = wrong_act(1)
noisy_q_proj_layer_1 = noisy_q_proj(1)
