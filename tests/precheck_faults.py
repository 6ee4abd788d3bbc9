"""Model patches for the precheck tests: ported kernels with one wrong op, as ``file.py:callable``.

A real port's fused kernel is one torch call (``torch.ops.npu.npu_rms_norm``) that API mode
records once, under its API name. ``kernel(name, impl)`` makes a Python function behave the same
way: it hands itself to the active torch function modes, so the dump records one call named
``name`` whose output is whatever ``impl`` computed.

* ``lossy_silu``: layer 1's MLP activation is a silu kernel whose sigmoid keeps 3 mantissa bits.
* ``lossy_torch_silu``: the same wrong kernel behind torch's own ``F.silu`` (a torch function
  mode answers layer 1's silu), so a tool that wraps torch's API (msprobe) records it as silu.
* ``rms_norm_without_eps``: layer 1's input RMSNorm is a fused ``rms_norm`` kernel that leaves
  eps out: x * rsqrt(mean(x^2)) * w. Its error is about eps / (2 mean(x^2)), so it shows only
  where the hidden states are small: the tests use models built with ``init=0.002`` (weights and
  embeddings of std 0.002, mean(x^2) ~ 4e-6 against the config's rms_norm_eps 1e-6: ~10% off,
  where bf16 rounds to 0.4%).
* ``bf16_accumulating_linear``: layer 1's ``down_proj`` is a linear kernel that multiplies in fp32
  but keeps its running sum in bf16, rounded after each chunk of ``K_CHUNK`` products along K.
* ``shifted_softmax``: layer 1's attention runs eager and adds 1000 to its softmax input (the
  same result in exact arithmetic; overflow-prone, ill-conditioned inputs), torch's softmax.
* ``naive_softmax``: the same, through an fp16 softmax kernel without max-subtraction (exp
  overflows above ~11).
* ``ops_softmax``: layer 1's attention softmax written from torch ops (exp, sum, div) without
  the max-subtraction, its inputs shifted by +20: exp overflows float16 itself (not a kernel's fault).
* ``custom_norm``: every RMSNorm is a custom kernel ``my_rms_norm`` (correct), which torch does
  not know: the precheck needs ``my_rms_norm_reference`` registered.
* ``operator_model`` (a model, not a patch): Python operators with a number on either side and
  factories given empty sequences; ``reversed_rsub`` ports its ``0.5 - x`` as a kernel that
  subtracts the wrong way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

FAULT_LAYER = 1


def kernel(name: str, impl: Any) -> Any:
    def op(*args: Any, **kwargs: Any) -> Any:
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        if has_torch_function(tensors):
            return handle_torch_function(op, tensors, *args, **kwargs)
        return impl(*args, **kwargs)
    op.__name__ = op.__qualname__ = name
    return op


def _lossy_silu(x: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(x.float()).to(torch.float8_e4m3fn).float()
    return (x.float() * sig).to(x.dtype)


silu_kernel = kernel("silu", _lossy_silu)


class _LossySiLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_kernel(x)


def lossy_silu(model: nn.Module) -> None:
    model.model.layers[FAULT_LAYER].mlp.act_fn = _LossySiLU()


def _forward_under(module: nn.Module, mode: Callable[[], TorchFunctionMode]) -> None:
    """``module``'s forward runs with a fresh ``mode()`` answering its torch calls."""
    forward = module.forward

    def under(*args: Any, **kwargs: Any) -> Any:
        with mode():
            return forward(*args, **kwargs)
    module.forward = under


class _SiluAnswers(TorchFunctionMode):
    """Every ``silu`` under this mode is computed by the lossy kernel."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "silu":
            return _lossy_silu(args[0])
        return func(*args, **kwargs)


def lossy_torch_silu(model: nn.Module) -> None:
    _forward_under(model.model.layers[FAULT_LAYER].mlp.act_fn, _SiluAnswers)


def _rms_norm_without_eps(x: torch.Tensor, normalized_shape: tuple[int, ...],
                          weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    dims = tuple(range(-len(normalized_shape), 0))
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True))  # eps left out
    return (y * weight.float() if weight is not None else y).to(x.dtype)


rms_norm_kernel = kernel("rms_norm", _rms_norm_without_eps)


def rms_norm_without_eps(model: nn.Module) -> None:
    norm = model.model.layers[FAULT_LAYER].input_layernorm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    norm.forward = lambda x: rms_norm_kernel(x, (x.shape[-1],), norm.weight, eps)


K_CHUNK = 4


def _linear_bf16_accumulation(x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    acc = torch.zeros((*x.shape[:-1], weight.shape[0]), dtype=torch.bfloat16)
    for k in range(0, x.shape[-1], K_CHUNK):
        partial = x[..., k:k + K_CHUNK].float() @ weight[:, k:k + K_CHUNK].float().T
        acc = (acc.float() + partial).to(torch.bfloat16)  # the running sum rounded to bf16
    out = acc.float() + bias.float() if bias is not None else acc.float()
    return out.to(x.dtype)


linear_kernel = kernel("linear", _linear_bf16_accumulation)


def bf16_accumulating_linear(model: nn.Module) -> None:
    proj = model.model.layers[FAULT_LAYER].mlp.down_proj
    proj.forward = lambda x: linear_kernel(x, proj.weight, proj.bias)


def _naive_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None,
                   **_: Any) -> torch.Tensor:
    e = torch.exp(x.to(torch.float16))  # no max-subtraction, in fp16
    return (e / e.sum(dim=dim, keepdim=True)).to(dtype or x.dtype)


softmax_kernel = kernel("softmax", _naive_softmax)


class _ShiftedSoftmax(TorchFunctionMode):
    """Softmax inputs shifted by +1000 (the result is the same in exact arithmetic: overflow-prone
    inputs a kernel must subtract the max from), optionally through the naive kernel."""

    def __init__(self, naive: bool):
        super().__init__()
        self.naive = naive

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "softmax":
            return func(*args, **kwargs)
        shifted = (args[0] + 1000.0, *args[1:])
        return softmax_kernel(*shifted, **kwargs) if self.naive else func(*shifted, **kwargs)


def _shift_softmax(model: nn.Module, naive: bool) -> None:
    model.config._attn_implementation = "eager"
    _forward_under(model.model.layers[FAULT_LAYER].self_attn, lambda: _ShiftedSoftmax(naive))


class _OpsSoftmax(TorchFunctionMode):
    """A softmax written from torch ops (exp, sum, div) without the max-subtraction, on inputs
    shifted by +20: exp overflows float16 (not float64) where the dtype itself cannot hold it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "softmax":
            return func(*args, **kwargs)
        dim, dtype = kwargs.get("dim", args[1] if len(args) > 1 else -1), kwargs.get("dtype")
        e = torch.exp(args[0] + 20.0)
        return (e / e.sum(dim=dim, keepdim=True)).to(dtype or args[0].dtype)


def ops_softmax(model: nn.Module) -> None:
    model.config._attn_implementation = "eager"
    _forward_under(model.model.layers[FAULT_LAYER].self_attn, _OpsSoftmax)


def shifted_softmax(model: nn.Module) -> None:
    _shift_softmax(model, naive=False)


def naive_softmax(model: nn.Module) -> None:
    _shift_softmax(model, naive=True)


def my_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


norm_kernel = kernel("my_rms_norm", my_rms_norm_reference)


def custom_norm(model: nn.Module) -> None:
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            module.forward = (lambda m, e: lambda x: norm_kernel(x, m.weight, e))(module, eps)


# -- calls with several outputs: topk, sort, max(dim), var_mean ---------------------------------------
def _coarse_topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True,
                 **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k kernel that ranks on its input rounded to 3 mantissa bits (fp8 e4m3): where two
    router probabilities round alike it picks the lower index, so it may select the wrong expert;
    the values it returns are the input's at the indices it picked."""
    coarse = x.to(torch.float8_e4m3fn).to(x.dtype)
    indices = torch.topk(coarse, k, dim=dim, largest=largest, sorted=sorted).indices
    return torch.return_types.topk((x.gather(dim, indices), indices))


topk_kernel = kernel("topk", _coarse_topk)


class _TopkAnswers(TorchFunctionMode):
    """Every ``topk`` under this mode is computed by the coarse kernel."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "topk":
            return topk_kernel(*args, **kwargs)
        return func(*args, **kwargs)


def coarse_router_topk(model: nn.Module) -> None:
    """Layer 1's mixture-of-experts block picks its experts with the coarse top-k kernel."""
    _forward_under(model.model.layers[FAULT_LAYER].mlp, _TopkAnswers)


def _sort_with_swapped_indices(x: torch.Tensor, dim: int = -1, descending: bool = False,
                               **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A sort kernel whose values are right but whose indices of the first two places are swapped."""
    values, indices = torch.sort(x, dim=dim, descending=descending)
    swapped = indices.clone()
    swapped.narrow(dim, 0, 1).copy_(indices.narrow(dim, 1, 1))
    swapped.narrow(dim, 1, 1).copy_(indices.narrow(dim, 0, 1))
    return torch.return_types.sort((values, swapped))


sort_kernel = kernel("sort", _sort_with_swapped_indices)


class SortingModel(nn.Module):
    """A user's model whose forward calls ops with several outputs: ``topk``, ``sort``,
    ``max(dim)`` and ``var_mean``; ``self.sort`` is the sort kernel (torch's unless patched)."""

    def __init__(self, vocab: int = 300, hidden: int = 32, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.sort = torch.sort

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        top, top_index = torch.topk(h, 4, dim=-1)
        ordered, order = self.sort(h, dim=-1, descending=True)
        largest, where = h.max(dim=-1, keepdim=True)
        var, mean = torch.var_mean(h, dim=-1, keepdim=True)
        spread = top.sum(-1, keepdim=True) - ordered[..., :1]
        mixed = (h - mean) * torch.rsqrt(var + 1e-5) + largest * spread
        mixed = mixed + (top_index.sum(-1, keepdim=True) + order[..., :1] + where).to(h.dtype) * 1e-3
        return self.head(mixed)


def sorting_model() -> tuple[nn.Module, Any]:
    from llmflow.models import ByteTokenizer

    return SortingModel(), ByteTokenizer()


def swapped_sort_indices(model: nn.Module) -> None:
    model.sort = sort_kernel


def _reversed_rsub(x: torch.Tensor, other: Any) -> torch.Tensor:
    return x - other  # (``other - x`` is right)


rsub_kernel = kernel("__rsub__", _reversed_rsub)


class OperatorModel(nn.Module):
    """A user's model whose forward uses Python operators with a number on the left (``1 - x``,
    ``2 / x``, ``2 ** x``, ``3 // x``, ``5 % x``: the reflected dunders) and on the right
    (``x // 2``, ``x % 3``), a bitwise ``&`` of masks, and factories given empty sequences
    (``torch.tensor([])``, ``torch.zeros(())``); ``self.rsub`` computes ``0.5 - x`` (torch's own
    ``Tensor.__rsub__`` unless patched)."""

    def __init__(self, vocab: int = 300, hidden: int = 32, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.rsub = torch.Tensor.__rsub__

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        positive = h.abs() + 1
        y = (1.0 - h) + 2.0 / positive + 2.0 ** h + 3 // positive + 5 % positive + h // 2 + h % 3
        keep = (h > -1.5) & (h < 1.5)
        y = y * keep + torch.zeros(()) + torch.tensor([], dtype=h.dtype).sum() + self.rsub(h, 0.5)
        return self.head(y)


def operator_model() -> tuple[nn.Module, Any]:
    from llmflow.models import ByteTokenizer

    return OperatorModel(), ByteTokenizer()


def reversed_rsub(model: nn.Module) -> None:
    model.rsub = rsub_kernel
