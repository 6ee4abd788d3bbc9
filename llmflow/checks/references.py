"""Which function replays a dumped op on the CPU: the references registry.

A dump names an op by its API (``softmax``, ``linear``, ``npu_rms_norm``); the precheck runs that
API again on the CPU, once in float64 (the reference) and once in the dump's dtype (the benchmark).
``resolve`` finds the function, first match wins:

  1. a reference given for this run (``llmflow precheck --reference NAME=file.py:func``);
  2. a reference an installed package declares in the entry-point group ``llmflow.references``
     (``llmflow.plugins``): ``my_fused_op = "my_port.refs:my_fused_op"``;
  3. the built-in references below, for the torch_npu fused kernels a CPU has not;
  4. torch itself: ``torch.nn.functional.<api>``, ``torch.<api>``, then the ``Tensor`` method
     (functional first: ``F.embedding(input, weight)`` and ``torch.embedding(weight, input)`` take
     their arguments in different orders, and the model code calls the functional).

A dump comes from another machine, so it names what the precheck may call only among torch's
tensor ops: the functions torch routes through a function mode (``torch.overrides``' list and the
factory functions, what an API dump records), less the few that reach beyond their tensors
(``backward``, hooks, shared memory, pickling). ``torch.load``, ``torch.save``,
``torch.from_file`` or ``manual_seed``, named by a dump, are never called.

A reference takes the op's arguments exactly as the op does and returns its output (a tensor, or
a tuple whose leading elements are compared with the op's leading outputs). It must compute in
the dtype of the tensors it is given (float64 for the reference run) and should follow the
documented semantics, not one kernel's internals. Registering one for a custom kernel::

    # my_port/refs.py                               # pyproject.toml
    def my_fused_op(x, weight, eps=1e-6):            # [project.entry-points."llmflow.references"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
                                                     # my_fused_op = "my_port.refs:my_fused_op"

The built-in torch_npu references follow the torch_npu API documentation for the basic cases
(no dropout, no sparse modes, no quantisation); a call outside them raises and is listed as not
checked, with the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llmflow import plugins
from llmflow.errors import UserError
from llmflow.operators import tensor_method


class UnsupportedArguments(ValueError):
    """A built-in reference asked for a mode it does not compute (a layout, a sparse mask): the
    call is listed as not checked with this message, never judged against a wrong reference."""


GROUP = "llmflow.references"

#: APIs whose result is drawn at random: replaying them says nothing about the target's kernel
RANDOM_APIS = frozenset("""
    dropout dropout_ dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout native_dropout
    multinomial rand rand_like randn randn_like randint randint_like randperm bernoulli bernoulli_
    normal normal_ uniform_ exponential_ geometric_ cauchy_ log_normal_ random_ poisson rrelu
    gumbel_softmax npu_dropout npu_dropout_with_add_softmax
""".split())


def is_random(api: str, args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Is this call random? A dropout in eval mode (``training=False``) or with ``p=0`` is the
    identity, so it is not."""
    if api not in RANDOM_APIS:
        return False
    if "dropout" in api:
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        return bool(training) and p != 0
    return True


# -- built-in references of torch_npu fused kernels ---------------------------------------------
def _widened(x: torch.Tensor) -> torch.Tensor:
    """Half-precision inputs computed in float32, as the kernels do internally (float64 stays)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor,
                 epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_rms_norm``: (x * rsqrt(mean(x^2 over gamma's dims) + eps) * gamma, rstd)."""
    xf = _widened(x)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (xf * rstd * _widened(gamma)).to(x.dtype), rstd


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                   rotary_mode: str = "half") -> torch.Tensor:
    """``torch_npu.npu_rotary_mul``: x * cos + rotate_half(x) * sin (``rotary_mode="half"``)."""
    if rotary_mode != "half":
        raise UnsupportedArguments(f"npu_rotary_mul reference: rotary_mode {rotary_mode!r} (only 'half')")
    xf = _widened(x)
    return (xf * _widened(r1) + _rotate_half(xf) * _widened(r2)).to(x.dtype)


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch_npu.npu_swiglu``: split ``x`` in two halves along ``dim``: silu(a) * b."""
    a, b = _widened(x).chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """A query/key/value in ``layout`` (BSH, BSND, BNSD, SBH) as [batch, heads, seq, head_dim]."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3)
    raise UnsupportedArguments(f"attention reference: input_layout {layout!r} (BSH, BSND, BNSD, SBH)")


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = t.shape
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int, kv_heads: int,
               layout: str, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked where ``mask`` is true) v, grouped-query heads repeated."""
    q = _to_bnsd(_widened(query), layout, heads)
    k = _to_bnsd(_widened(key), layout, kv_heads)
    v = _to_bnsd(_widened(value), layout, kv_heads)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        m = mask.bool()
        while m.dim() < scores.dim():
            m = m.unsqueeze(0)
        scores = scores.masked_fill(m[..., -scores.shape[-2]:, -scores.shape[-1]:], float("-inf"))
    return _from_bnsd(torch.matmul(torch.softmax(scores, dim=-1), v), layout).to(query.dtype)


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                         input_layout: str, pse: torch.Tensor | None = None, padding_mask: Any = None,
                         atten_mask: torch.Tensor | None = None, scale: float = 1.0,
                         keep_prob: float = 1.0, actual_seq_qlen: Any = None, sparse_mode: int = 0,
                         **_ignored: Any) -> tuple[torch.Tensor]:
    """``torch_npu.npu_fusion_attention``, basic case: ``atten_mask`` true where masked out, no
    dropout (keep_prob 1), no positional bias, sparse_mode 0 or 1 (full mask). Its first output,
    the attention, is compared (the softmax statistics it also returns are layout-specific)."""
    if keep_prob != 1.0 or pse is not None or sparse_mode not in (0, 1) or actual_seq_qlen is not None:
        raise UnsupportedArguments("npu_fusion_attention reference: only keep_prob=1, no pse, sparse_mode "
                                  "0/1 and no variable-length sequences")
    kv_heads = head_num
    if input_layout in ("BSH", "SBH"):
        kv_heads = head_num * key.shape[-1] // query.shape[-1]
    elif input_layout in ("BSND", "BNSD"):
        kv_heads = key.shape[2 if input_layout == "BSND" else 1]
    return (_attention(query, key, value, head_num, kv_heads, input_layout, atten_mask, scale),)


def npu_incre_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                              padding_mask: Any = None, atten_mask: torch.Tensor | None = None,
                              pse_shift: Any = None, actual_seq_lengths: Any = None, num_heads: int = 1,
                              scale_value: float = 1.0, input_layout: str = "BSH",
                              num_key_value_heads: int = 0, **_ignored: Any) -> torch.Tensor:
    """``torch_npu.npu_incre_flash_attention`` (decode attention), basic case: a contiguous
    ``key``/``value`` (no block table, no quantisation), ``atten_mask`` true where masked out."""
    if pse_shift is not None or actual_seq_lengths is not None or any(
            _ignored.get(k) is not None for k in ("block_table", "antiquant_scale", "dequant_scale1")):
        raise UnsupportedArguments("npu_incre_flash_attention reference: only contiguous key/value, no "
                                  "pse_shift, actual_seq_lengths or quantisation")
    kv_heads = num_key_value_heads or num_heads
    return _attention(query, key, value, num_heads, kv_heads, input_layout, atten_mask, scale_value)


# -- built-in references of ATB operations ------------------------------------------------------
# An ATB operation is replayed from its dump: its intensors in order as the arguments and the
# ``param`` object of its node in the model json (msit llm dump --type model) as ``param``; each
# returns the operation's outtensors as a tuple, in the input's dtype (float64 for the reference
# run). The parameter names and defaults follow the ATB operation API (atb/infer_op_params.h), as
# msit's opcheck reads them; a mode outside the basic float cases raises UnsupportedArguments.
ATB = "atb"  # ``resolve(called=ATB)``: an ATB operation, replayed only by a reference


def _param(param: dict[str, Any], *path: str, default: Any = None) -> Any:
    node: Any = param
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def _atb_dtype(code: Any, like: torch.Tensor) -> torch.dtype:
    """An ATB/ACL dtype code (``outTensorType``, ``outDataType``) as torch's; -1/undefined: ``like``'s.
    The reference run keeps float64 where the op would round to another float."""
    from llmflow.formats.atb_bin import DTYPES

    if code is None or code == -1 or code not in DTYPES:
        return like.dtype
    dtype = DTYPES[code]
    return torch.float64 if like.dtype == torch.float64 and dtype.is_floating_point else dtype


def atb_linear(x: torch.Tensor, weight: torch.Tensor, *rest: torch.Tensor,
               param: dict[str, Any]) -> tuple[torch.Tensor]:
    """``LinearOperation``: x @ weight^T (``transposeB``, default true) + bias (``hasBias``)."""
    if x.dtype == torch.int8 or len(rest) > (1 if _param(param, "hasBias", default=False) else 0):
        raise UnsupportedArguments("LinearOperation reference: float inputs only (no quantisation scales)")
    a = _widened(x)
    if _param(param, "transposeA", default=False):
        a = a.transpose(-1, -2)
    w = _widened(weight)
    out = a @ (w.transpose(-1, -2) if _param(param, "transposeB", default=True) else w)
    if _param(param, "hasBias", default=False):
        out = out + _widened(rest[0])
    return (out.to(_atb_dtype(_param(param, "outDataType"), x)),)


def atb_rms_norm(x: torch.Tensor, gamma: torch.Tensor, *rest: torch.Tensor,
                 param: dict[str, Any]) -> tuple[torch.Tensor]:
    """``RmsNormOperation``, ``layerType`` 1 (RMS_NORM_NORM): x * rsqrt(mean(x^2) + epsilon) * gamma
    over gamma's dims; ``normParam.epsilon`` defaults to 1e-5 as ATB's does."""
    layer_type = _param(param, "layerType", default=1)
    if layer_type != 1 or _param(param, "normParam", "quantType", default=0) not in (0, None):
        raise UnsupportedArguments(f"RmsNormOperation reference: layerType 1 (norm) without quantisation "
                                   f"only, not layerType {layer_type}")
    epsilon = float(_param(param, "normParam", "epsilon", default=1e-5))
    return (npu_rms_norm(x, gamma, epsilon)[0],)


#: ElewiseOperation's ``elewiseType``: the element-wise function of its inputs
_ELEWISE: dict[int, Callable[..., torch.Tensor]] = {
    3: torch.cos, 4: torch.sin, 5: torch.neg, 7: torch.logical_not, 8: torch.add, 9: torch.mul,
    10: torch.div, 11: torch.logical_and, 12: torch.logical_or, 13: torch.lt, 14: torch.gt, 15: torch.sub,
    16: torch.eq, 20: torch.tanh,
}
_UNARY = {3, 4, 5, 7, 20}


def atb_elewise(*inputs: torch.Tensor, param: dict[str, Any]) -> tuple[torch.Tensor]:
    """``ElewiseOperation``: cast (1, to ``outTensorType``), muls (2, times ``mulsParam.varAttr``) and
    the element-wise functions of ``_ELEWISE``; comparisons and logical ops give int8, as ATB's do."""
    kind = _param(param, "elewiseType", default=0)
    x = inputs[0]
    if kind == 1:
        return (x.to(_atb_dtype(_param(param, "outTensorType"), x)),)
    if kind == 2:
        factor = _param(param, "mulsParam", "varAttr", default=_param(param, "varAttr", default=0.0))
        return ((_widened(x) * float(factor)).to(x.dtype),)
    if kind not in _ELEWISE:
        raise UnsupportedArguments(f"ElewiseOperation reference: elewiseType {kind} (known: 1, 2, "
                                   f"{', '.join(map(str, _ELEWISE))})")
    operands = inputs[:1] if kind in _UNARY else inputs[:2]
    out = _ELEWISE[kind](*(_widened(t) for t in operands))
    if out.dtype == torch.bool:
        return (out.to(torch.int8),)
    return (out.to(x.dtype),)


def atb_activation(x: torch.Tensor, *rest: torch.Tensor, param: dict[str, Any]) -> tuple[torch.Tensor]:
    """``ActivationOperation``: relu (1), gelu (2; ``geluMode`` 0 tanh, 1 exact), fast gelu (3),
    swish (4, ``scale``), log (5), swiglu forward (6, halves along ``dim``)."""
    kind = _param(param, "activationType", default=0)
    xf = _widened(x)
    if kind == 1:
        out = F.relu(xf)
    elif kind == 2:
        out = F.gelu(xf, approximate="tanh" if _param(param, "geluMode", default=0) == 0 else "none")
    elif kind == 3:
        out = xf * torch.exp(0.851 * (xf - xf.abs())) / (1 + torch.exp(-1.702 * xf.abs()))
    elif kind == 4:
        out = xf * torch.sigmoid(xf * float(_param(param, "scale", default=1.0)))
    elif kind == 5:
        out = torch.log(xf)
    elif kind == 6:
        return (npu_swiglu(x, int(_param(param, "dim", default=-1))),)
    else:
        raise UnsupportedArguments(f"ActivationOperation reference: activationType {kind} (known: 1-6)")
    return (out.to(x.dtype),)


def atb_softmax(x: torch.Tensor, *rest: torch.Tensor, param: dict[str, Any]) -> tuple[torch.Tensor]:
    """``SoftmaxOperation``: softmax over ``axes`` (one axis, or consecutive ones taken together)."""
    axes = sorted(a % x.dim() for a in (_param(param, "axes", default=None) or [-1]))
    if axes != list(range(axes[0], axes[-1] + 1)):
        raise UnsupportedArguments(f"SoftmaxOperation reference: axes {axes} are not consecutive")
    flat = _widened(x).flatten(axes[0], axes[-1])
    return (torch.softmax(flat, dim=axes[0]).reshape(x.shape).to(x.dtype),)


def atb_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *rest: torch.Tensor,
             param: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``RopeOperation``, ``rotaryCoeff`` 2 (rotate-half): q and k ([tokens, heads * head_dim]) each
    x * cos + rotate_half(x) * sin per head, cos and sin [tokens, head_dim]."""
    if _param(param, "rotaryCoeff", default=4) != 2:
        raise UnsupportedArguments(f"RopeOperation reference: rotaryCoeff {_param(param, 'rotaryCoeff')} "
                                   "(only 2, rotate-half)")
    head_dim = cos.shape[-1]
    c, s = _widened(cos).unsqueeze(-2), _widened(sin).unsqueeze(-2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = _widened(x).reshape(*x.shape[:-1], -1, head_dim)
        return (heads * c + _rotate_half(heads) * s).reshape(x.shape).to(x.dtype)
    return rotate(q), rotate(k)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` (a mixture-of-experts layer's
    experts in one call: rows ``offs[g-1]:offs[g]`` of a 2-D ``mat_a`` times ``mat_b[g]``; 3-D by
    3-D without ``offs``: a batched matmul), as one matmul per group, in the dtype it is given
    (torch's own kernel takes no float64). ``out_dtype`` is the kernel's storage, not the math."""
    del out_dtype
    if bias is not None:
        raise UnsupportedArguments("grouped_mm reference: a bias")
    if mat_a.dim() == 3 and mat_b.dim() == 3 and offs is None:
        return torch.bmm(mat_a, mat_b)
    if mat_a.dim() != 2 or mat_b.dim() != 3 or offs is None:
        raise UnsupportedArguments(f"grouped_mm reference: {mat_a.dim()}-D by {mat_b.dim()}-D"
                                   + ("" if offs is not None else " without offs"))
    out = mat_a.new_zeros(mat_a.shape[0], mat_b.shape[2])
    start = 0
    for group, end in enumerate(offs.tolist()):
        out[start:end] = mat_a[start:end] @ mat_b[group]
        start = end
    return out


#: ATB operation type -> its reference (the node's ``opType`` in the model json)
ATB_BUILTIN: dict[str, Callable[..., Any]] = {
    "LinearOperation": atb_linear, "RmsNormOperation": atb_rms_norm, "ElewiseOperation": atb_elewise,
    "ActivationOperation": atb_activation, "SoftmaxOperation": atb_softmax, "RopeOperation": atb_rope,
}

BUILTIN: dict[str, Callable[..., Any]] = {
    "npu_rms_norm": npu_rms_norm, "npu_rotary_mul": npu_rotary_mul, "npu_swiglu": npu_swiglu,
    "npu_fusion_attention": npu_fusion_attention, "npu_incre_flash_attention": npu_incre_flash_attention,
    "grouped_mm": grouped_mm, "_grouped_mm": grouped_mm,
    **ATB_BUILTIN,
}


# -- the registry ---------------------------------------------------------------------------------
def load_references(given: dict[str, str] | None = None,
                    base_dir: str | Path = ".") -> dict[str, Callable[..., Any]]:
    """API name -> reference for this run: ``given`` (name -> ``file.py:func``) over the installed
    ``llmflow.references`` entry points over the built-ins. A reference that is not callable is a
    ``UserError`` naming it."""
    found: dict[str, Callable[..., Any]] = dict(BUILTIN)
    for name, ref in plugins.find_group(GROUP).items():
        found[name] = ref.load()
    for name, ref in (given or {}).items():
        if not plugins.is_file_ref(ref):
            raise UserError(f"--reference {name}={ref}: expected NAME=path/to/file.py:function")
        found[name] = plugins.load_file_ref(ref, base_dir)
    for name, fn in found.items():
        if not callable(fn):
            raise UserError(f"reference {name!r}: {type(fn).__name__} is not callable")
    return found


#: where a dotted callable name (``"Tensor.__rsub__"``) looks its attribute up
OWNERS: dict[str, Any] = {"torch.nn.functional": F, "torch": torch, "Tensor": torch.Tensor}


# factory functions: a function mode sees them (an API dump records them), torch.overrides does not
# list them (they take no tensor)
_FACTORIES = ("arange", "range", "linspace", "logspace", "zeros", "ones", "full", "empty", "empty_strided",
              "eye", "tensor", "as_tensor", "asarray", "scalar_tensor", "tril_indices", "triu_indices",
              "rand", "randn", "randint", "randperm", "normal", "bartlett_window", "blackman_window",
              "hamming_window", "hann_window", "kaiser_window")
_BEYOND_TENSORS = frozenset({"backward", "register_hook", "register_post_accumulate_grad_hook",
                             "share_memory_", "module_load", "__reduce__", "__reduce_ex__", "__setstate__"})


@functools.lru_cache(maxsize=1)
def _tensor_ops() -> frozenset[Any]:
    """torch's functions a function mode sees: the ops an API dump can have recorded."""
    ops = {f for fns in torch.overrides.get_overridable_functions().values() for f in fns}
    return frozenset(ops | {getattr(torch, name) for name in _FACTORIES if hasattr(torch, name)})


def replayable(fn: Any) -> bool:
    """May a dump make the precheck call ``fn``? Only a torch tensor op (see the module docstring)."""
    try:
        return fn in _tensor_ops() and getattr(fn, "__name__", "") not in _BEYOND_TENSORS
    except TypeError:  # (unhashable: not one of torch's functions)
        return False


def lookup(dotted: str) -> Callable[..., Any] | None:
    """``torch.matmul``, ``torch.nn.functional.silu``, ``Tensor.__add__``: that torch op, or None
    (another owner, no such attribute, not a tensor op)."""
    owner, _, attr = dotted.rpartition(".")
    fn = getattr(OWNERS[owner], attr, None) if owner in OWNERS else None
    return fn if callable(fn) and replayable(fn) else None


def resolve(api: str, args: list[Any], references: dict[str, Callable[..., Any]],
            called: str | None = None) -> tuple[Callable[..., Any] | None, str]:
    """The function that replays ``api`` and where it came from (``"reference"``, ``"torch"``), or
    (None, why) when there is none. ``called``: the torch callable the dump says was called
    (``Tensor.__rsub__``: msprobe records the API group), used after the references. In-place
    APIs (``add_``) resolve like any other: their inputs are copied before every run."""
    if api in references:
        return references[api], "reference"
    if called == ATB:
        return None, (f"no reference for ATB op {api} (entry-point group {GROUP} or --reference "
                      f"{api}=file.py:func)")
    fn = lookup(called) if called is not None else None
    if fn is not None:
        return fn, called
    refused = None
    for owner, label in ((F, "torch.nn.functional"), (torch, "torch")):
        fn = getattr(owner, api, None)
        if callable(fn) and not isinstance(fn, type) and not isinstance(fn, torch.dtype):
            if replayable(fn):
                return fn, f"{label}.{api}"
            refused = refused or f"{label}.{api}"
    if args and isinstance(args[0], torch.Tensor):
        # a method, or an operator torch has no function for (``floordiv``, ``rdiv``: its dunder)
        for attr in (api, tensor_method(api)):
            method = getattr(torch.Tensor, attr, None) if attr else None
            if callable(method):
                if replayable(method):
                    return method, f"Tensor.{attr}"
                refused = refused or f"Tensor.{attr}"
    if refused:
        return None, (f"{refused} is not a tensor op: a dump cannot make the precheck call it (a reference "
                      f"for {api!r}: entry-point group {GROUP} or --reference {api}=file.py:func)")
    return None, (f"no CPU implementation of {api!r} in torch and no reference registered "
                  f"(entry-point group {GROUP} or --reference {api}=file.py:func)")


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of a floating dtype: the relative error of one correct rounding."""
    return float(torch.finfo(dtype).eps) / 2 if dtype.is_floating_point else 0.0

