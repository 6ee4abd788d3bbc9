"""msModelSlim checkpoints: their quantization description, their dequantization, and the model
of one, built so that its quantized Linear layers compute as the Ascend kernels do.

``checks/weights.py`` reads these to compare a quantized checkpoint with its float one, weight by
weight; ``models.load_model`` reads them to run one (``install_quantized_linears``), so that the
bisect can replay a quantized port against its float golden and name the layers whose
quantization costs most. The layout (msModelSlim 26.1's, checked against its output) is described
in ``checks/weights.py``.

How each weight type runs:

* W8A16, W4A16 (weight-only): the Linear keeps a float weight, ``(weight - offset) * scale``; the
  device's weight-quantized matmul dequantizes to the activations' dtype before it multiplies too.
* W8A8, W8A8S (static): activations quantized per tensor, ``x8 = clamp(round(x / input_scale +
  input_offset), -128, 127)``, the integer matmul accumulated exactly with ``quant_bias`` (which
  holds the float bias and the offset's correction), scaled by ``deq_scale``: the scale the
  device applies, not ``input_scale * weight_scale`` (the weight check tells where they differ).
* W8A8_DYNAMIC: activations quantized per token, symmetric (``s = max|x| / 127``), times the
  dequantized weight, plus the float bias.
* W8A8_MIX: dynamic for a call that holds more than one position (a prefill), static otherwise
  (msModelSlim's prefill/decode mix).

Rounding is torch's (half to even), the integer accumulation exact (float64 holds every int32
sum), the scales float32 as the device keeps them. What the emulation cannot show is a fault of
the device's own kernels: for that, dump the device and bisect its dumps (``dump_bisect``).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from llmflow.errors import UserError
from llmflow.safetensors_files import SafetensorsFiles, holder_of

log = logging.getLogger(__name__)

#: weight types whose Linear layers run with a dequantized float weight
WEIGHT_ONLY = {"W8A16": 8, "W4A16": 4}
#: weight types whose Linear layers quantize their activations too, and how
ACTIVATION_QUANT = {"W8A8": "static", "W8A8S": "static", "W8A8_DYNAMIC": "dynamic", "W8A8_MIX": "mix"}
#: a static activation quantization that rounds this share of an input's nonzero values to its zero
#: point loses that input (its scale was calibrated on far larger values): said in ``explain``
ZERO_POINT_SHARE = 0.5
#: deq_scale and input_scale * weight_scale agree to float32 rounding in an honest checkpoint
DEQ_SCALE_RTOL = 1e-4
#: the tensors msModelSlim stores beside a quantized weight
LINEAR_COMPANIONS = ("weight_scale", "weight_offset", "deq_scale", "quant_bias", "input_scale",
                     "input_offset")


@dataclass
class QuantConfig:
    """A parsed ``quant_model_description*.json``."""

    types: dict[str, str] = field(default_factory=dict)
    default: str | None = None
    group_size: int | None = None
    int4_packed: bool | None = None
    path: Path | None = None
    version: str | None = None  # "1.0.0": the ascendV1 save type (int4 packed two per byte)

    def type_of(self, name: str) -> str | None:
        return self.types.get(name, self.default)

    def renamed(self, rename: Callable[[str], str]) -> QuantConfig:
        """The same description under the names ``rename`` gives each tensor."""
        return replace(self, types={rename(k): v for k, v in self.types.items()})

    @classmethod
    def load(cls, path: Path) -> QuantConfig:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: not a readable quantization description ({exc})") from exc
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a JSON object mapping tensor names to quant types")
        group = data.get("group_size")
        cfg = path.parent / "config.json"  # some exports keep group_size in config.json only
        if group is None and cfg.is_file():
            try:
                group = (json.loads(cfg.read_text()).get("quantization_config") or {}).get("group_size")
            except (OSError, ValueError, AttributeError):
                group = None
        packed = data.get("int4_packed")
        types = {k: str(v).upper() for k, v in data.items() if isinstance(v, str) and "." in k}
        default = data.get("model_quant_type")
        version = data.get("version")
        return cls(types, str(default).upper() if default else None,
                   int(group) if isinstance(group, int) and group > 0 else None,
                   packed if isinstance(packed, bool) else None, path,
                   str(version) if isinstance(version, str) and version else None)


def find_quant_config(path: Path) -> Path | None:
    """The quant description next to a checkpoint: ``quant_model_description.json`` first."""
    folder = path if path.is_dir() else path.parent
    found = sorted(folder.glob("quant_model_description*.json"))
    exact = folder / "quant_model_description.json"
    return exact if exact in found else (found[0] if found else None)



def unpack_int4(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Two signed 4-bit values per byte, low nibble first -> int8, dimension ``dim`` doubled
    (index 2j from byte j's low nibble, 2j + 1 from its high one)."""
    if dim not in (-1, packed.dim() - 1):
        return unpack_int4(packed.transpose(dim, -1)).transpose(dim, -1).contiguous()
    b = packed.contiguous().view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    both = torch.stack([lo, hi], dim=-1)
    both = torch.where(both >= 8, both - 16, both).to(torch.int8)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def int4_packed_dim(stored: tuple[int, ...], scale: tuple[int, ...], quant: QuantConfig | None,
                    twin: tuple[int, ...] | None) -> int | None:
    """The dimension along which an int4 weight holds two values per byte, None when unpacked.

    ascendV1 (a description with a ``version``) packs along the input dimension when the scale
    has one column (per-channel, per-tensor) and along the output dimension otherwise
    (per-group); ``"int4_packed": true`` means the last dimension; without either, the float twin's
    shape tells (a stored dimension half the twin's)."""
    if quant is not None and quant.int4_packed is not None:
        return len(stored) - 1 if quant.int4_packed else None
    if quant is not None and quant.version:
        return len(stored) - 1 if not scale or scale[-1] == 1 else 0
    if twin is None or len(twin) != len(stored):
        return None
    halved = [d for d in range(len(stored)) if stored[d] * 2 == twin[d]
              and all(stored[e] == twin[e] for e in range(len(stored)) if e != d)]
    return halved[-1] if halved else None


def deq_scale_as_float(deq_scale: torch.Tensor) -> torch.Tensor:
    """msModelSlim's ``deq_scale`` as float32: an int64 holds a float32's bits (fp16 models), a
    floating tensor is the value itself (bf16 models)."""
    if deq_scale.dtype.is_floating_point:
        return deq_scale.to(torch.float32)
    return deq_scale.to(torch.int64).to(torch.int32).view(torch.float32)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, *,
               group_size: int | None = None) -> tuple[torch.Tensor, str]:
    """``(weight - offset) * scale`` in float32, broadcast per tensor, channel or group.

    Returns the tensor and the scheme's name; ``ValueError`` when the shapes do not fit.
    """
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    o = offset.to(torch.float32) if offset is not None else torch.zeros_like(s)
    if o.shape != s.shape and o.numel() != 1:
        raise ValueError(f"weight_offset shape {list(o.shape)} differs from weight_scale {list(s.shape)}")
    out_f = w.shape[0] if w.dim() else 1
    if s.numel() == 1:
        return (w - o.reshape(()) if o.numel() == 1 else w - o) * s.reshape(()), "per-tensor"
    if s.numel() == out_f and (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):
        view = (out_f,) + (1,) * (w.dim() - 1)
        return (w - o.reshape(view)) * s.reshape(view), "per-channel"
    if w.dim() == 2 and s.dim() == 2:
        if s.shape[0] != out_f and s.shape[1] == out_f:  # stored [n_groups, out]
            s, o = s.t(), o.t() if o.dim() == 2 else o
        n_groups, in_f = s.shape[1], w.shape[1]
        if s.shape[0] == out_f and in_f % n_groups == 0:
            g = in_f // n_groups
            if group_size is not None and group_size != g:
                raise ValueError(f"group size {g} (from scale shape {list(scale.shape)}) differs from "
                                 f"the config's group_size {group_size}")
            o = o.reshape(out_f, n_groups, 1) if o.numel() != 1 else o.reshape(())
            deq = (w.reshape(out_f, n_groups, g) - o) * s.reshape(out_f, n_groups, 1)
            return deq.reshape(out_f, in_f), f"per-group g={g}"
    raise ValueError(f"weight_scale shape {list(scale.shape)} fits neither per-tensor, per-channel nor "
                     f"per-group quantization of a weight of shape {list(weight.shape)}")


def _prefill(x: torch.Tensor) -> bool:
    """Whether a Linear layer's input holds more than one position ([batch, positions, features]):
    a prefill, where W8A8_MIX quantizes dynamically."""
    return x.dim() >= 2 and x.shape[-2] > 1


def _float32_bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor held as its int32 bits: ``Module.to(dtype)`` casts every floating buffer
    (a bf16 model would round its scales), never an integer one."""
    return t.to(torch.float32).contiguous().view(torch.int32)


class W8A8Linear(nn.Module):
    """A Linear layer of an msModelSlim W8A8 checkpoint (W8A8, W8A8S, W8A8_DYNAMIC, W8A8_MIX),
    computing as the Ascend int8 kernels do (see the module docstring). Its ``weight`` and
    ``quant_bias`` buffers are the checkpoint's integers under the checkpoint's names."""

    def __init__(self, qtype: str, weight: torch.Tensor, tensors: dict[str, torch.Tensor],
                 group_size: int | None):
        super().__init__()
        self.qtype, self.mode = qtype, ACTIVATION_QUANT[qtype]
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        self.register_buffer("weight", weight.to(torch.int8))
        static = self.mode in ("static", "mix")
        dynamic = self.mode in ("dynamic", "mix")
        needed = (("input_scale", "input_offset", "deq_scale", "quant_bias") if static else ()) + \
            (("weight_scale",) if dynamic else ())
        missing = [n for n in needed if n not in tensors]
        if missing:
            raise ValueError(f"{qtype} needs {', '.join(missing)} beside the weight")
        if static:
            self.register_buffer("quant_bias", tensors["quant_bias"].to(torch.int32).reshape(-1))
            self.register_buffer("input_scale_bits", _float32_bits(tensors["input_scale"].reshape(-1)))
            self.register_buffer("input_offset_bits", _float32_bits(tensors["input_offset"].reshape(-1)))
            self.register_buffer("deq_scale_bits", _float32_bits(deq_scale_as_float(tensors["deq_scale"])
                                                                 .reshape(-1)))
        weight_scale = tensors.get("weight_scale")  # (W8A8S stores none: its deq_scale is all there is)
        self.register_buffer("weight_scale_bits",
                             None if weight_scale is None else _float32_bits(weight_scale))
        if dynamic:
            offset = tensors.get("weight_offset")
            self.register_buffer("weight_offset_bits", None if offset is None else _float32_bits(offset))
            # the float bias is added after the dynamic matmul; the static one holds it in quant_bias
            bias = tensors.get("bias")
            self.register_buffer("bias_bits", None if bias is None else _float32_bits(bias.reshape(-1)))
            dequantize(self.weight, tensors["weight_scale"], offset, group_size=group_size)  # shapes fit

    def extra_repr(self) -> str:
        return f"{self.qtype}, in_features={self.in_features}, out_features={self.out_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        if self.mode == "dynamic" or (self.mode == "mix" and _prefill(x)):
            out = self._dynamic(rows)
        else:
            out = self._static(rows)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def explain(self, x: torch.Tensor) -> str | None:
        """What this layer's quantization does to input ``x``, in a sentence: how much of it the
        static activation quantization clips (a calibration that saw smaller values) or rounds to
        its zero point (one that saw far larger values), and whether
        ``deq_scale`` is the product of the scales it should be. None where neither applies."""
        rows = x.reshape(-1, self.in_features).to(device=self.weight.device, dtype=torch.float32)
        said = []
        if self.mode == "static" or (self.mode == "mix" and not _prefill(x)):
            scale = self.input_scale_bits.view(torch.float32)
            offset = self.input_offset_bits.view(torch.float32)
            level = rows / scale + offset
            clipped = int(((level < -128.5) | (level > 127.5)).sum())
            if clipped:
                said.append(f"its static activation quantization clips {clipped} of the input's "
                            f"{level.numel()} values ({clipped / level.numel():.2%})")
            if clipped and scale.numel() == 1 and offset.numel() == 1:  # (per tensor: one range)
                low, high = float((-128 - offset) * scale), float((127 - offset) * scale)
                said[-1] += (f": input_scale {float(scale):.4g} and input_offset {float(offset):.4g} cover "
                             f"[{low:.4g}, {high:.4g}], the input spans [{float(rows.min()):.4g}, "
                             f"{float(rows.max()):.4g}]")
            nonzero = int((rows != 0).sum())
            to_zero = int(((torch.round(level) == torch.round(offset)) & (rows != 0)).sum())
            if nonzero and to_zero >= ZERO_POINT_SHARE * nonzero:
                # the median magnitude: one massive value would carry the RMS and hide the many lost
                step, typical = float(scale.float().mean()), float(rows.abs().median())
                ratio = step / typical if typical > 0 else math.inf
                said.append(f"its static activation quantization rounds {to_zero / nonzero:.0%} of the "
                            f"input's nonzero values to its zero point: its step (input_scale {step:.4g}) "
                            f"is {ratio:.3g}x the input's median magnitude ({typical:.3g}), a calibration "
                            "that saw far larger values (such as one token's massive activation)")
            mismatch = self.deq_scale_mismatch()
            if mismatch:
                said.append(f"its {mismatch}")
        return "; ".join(said) or None

    def deq_scale_mismatch(self) -> str | None:
        """How this static layer's ``deq_scale`` differs from ``input_scale * weight_scale``, the
        product msModelSlim stores it as (``deq_scale is 10x input_scale x weight_scale in 64 of 64
        channels``); None where they agree to float32 rounding, or where there is nothing to
        compare (a dynamic layer, W8A8S without weight_scale, a per-group scale)."""
        weight_scale = self.weight_scale_bits
        if (self.mode == "dynamic" or weight_scale is None
                or weight_scale.numel() not in (1, self.out_features)):
            return None
        implied = self.input_scale_bits.view(torch.float32) * weight_scale.view(torch.float32).reshape(-1)
        ratio = self.deq_scale_bits.view(torch.float32) / implied.clamp_min(torch.finfo(torch.float32).tiny)
        off = (ratio - 1).abs() > DEQ_SCALE_RTOL
        if not bool(off.any()):
            return None
        worst = float(ratio[off][(ratio[off].log().abs()).argmax()])
        return (f"deq_scale is {worst:.4g}x input_scale x weight_scale in {int(off.sum())} of {off.numel()} "
                "channels (the device scales its output by deq_scale)")

    def account(self, x: torch.Tensor, golden: torch.Tensor) -> QuantAccount:
        """What this layer's own error on input ``x`` (the input its forward receives, after any
        pre-hook) against the float layer's ``golden`` output is made of: the clip of its static
        activation quantization, the rounding of its activations to int8, and the rest, its weight
        and bias against the float layer's, held up to what rounding the weights to int8 gives.
        Each part is the difference of this layer computed with and without it, so the parts
        are what the kernel's own steps do to this input."""
        rows = x.reshape(-1, self.in_features).to(device=self.weight.device, dtype=torch.float64)
        ref = golden.reshape(-1, self.out_features).to(device=self.weight.device, dtype=torch.float64)
        out = self.forward(x.to(torch.float32)).reshape(-1, self.out_features).to(torch.float64)
        weight = self.weight.to(torch.float64)
        clipped = 0
        if self.mode == "dynamic" or (self.mode == "mix" and _prefill(x)):
            scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
            offset = None if self.weight_offset_bits is None else self.weight_offset_bits.view(torch.float32)
            deq, _ = dequantize(self.weight, self.weight_scale_bits.view(torch.float32), offset,
                                group_size=self.group_size)
            bias = 0.0 if self.bias_bits is None else self.bias_bits.view(torch.float32).to(torch.float64)
            unclipped = out  # (a per-token scale covers its token: nothing clips)
            exact = rows @ deq.to(torch.float64).T + bias
            # the weight's int8 step per element: the dequantization of a weight of ones
            steps, _ = dequantize(torch.ones_like(self.weight), self.weight_scale_bits.view(torch.float32),
                                  None, group_size=self.group_size)
            expected = float(((rows ** 2) @ (steps.to(torch.float64) ** 2).T).sum()) / 12
        else:
            scale = self.input_scale_bits.view(torch.float32).to(torch.float64)
            offset = self.input_offset_bits.view(torch.float32).to(torch.float64)
            deq_scale = self.deq_scale_bits.view(torch.float32).to(torch.float64)
            bias = self.quant_bias.to(torch.float64)
            level = rows / scale + offset
            clipped = int(((level < -128.5) | (level > 127.5)).sum())
            unclipped = (torch.round(level) @ weight.T + bias) * deq_scale
            exact = (level @ weight.T + bias) * deq_scale
            # the weight the kernel computes with is weight x deq_scale / input_scale per output
            # channel: rounding a float weight to that grid errs by a uniform step/2 at most, whose
            # mean square is step^2 / 12 for each product it enters
            step = (deq_scale / scale).reshape(-1).expand(self.out_features)
            expected = float((rows ** 2).sum()) * float((step ** 2).sum()) / 12
        norm = float(ref.norm()) or math.inf
        return QuantAccount(error=float((out - ref).norm()) / norm,
                            clip=float((out - unclipped).norm()) / norm,
                            rounding=float((unclipped - exact).norm()) / norm,
                            weight=float((exact - ref).norm()) / norm,
                            weight_rounding=math.sqrt(expected) / norm, clipped=clipped,
                            values=rows.numel())

    def _static(self, rows: torch.Tensor) -> torch.Tensor:
        scale = self.input_scale_bits.view(torch.float32)
        offset = self.input_offset_bits.view(torch.float32)
        x8 = torch.clamp(torch.round(rows / scale + offset), -128, 127)
        # the device accumulates in int32: float64 holds every such sum exactly
        acc = x8.to(torch.float64) @ self.weight.to(torch.float64).T + self.quant_bias.to(torch.float64)
        return acc * self.deq_scale_bits.view(torch.float32).to(torch.float64)

    def _dynamic(self, rows: torch.Tensor) -> torch.Tensor:
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
        x8 = torch.clamp(torch.round(rows / scale), -128, 127)
        offset = None if self.weight_offset_bits is None else self.weight_offset_bits.view(torch.float32)
        weight, _ = dequantize(self.weight, self.weight_scale_bits.view(torch.float32), offset,
                               group_size=self.group_size)
        out = (x8.to(torch.float64) @ weight.to(torch.float64).T) * scale.to(torch.float64)
        if self.bias_bits is not None:
            out = out + self.bias_bits.view(torch.float32).to(torch.float64)
        return out


#: a static activation quantization calibrated on other prompts clips the few values of a new one
#: beyond what it saw (0.2-3% of a Linear layer's input on tiny Llama, Qwen2, Mistral and Phi3
#: checkpoints of msModelSlim): quantization doing what it does. One that clips more than this share
#: was calibrated on values far smaller than the model's (a range 8x too small clips 20% and more):
#: a calibration that does not fit, said as a fault
CLIP_EXPLAINED_SHARE = 0.1
#: a W8A8 layer's own error beyond its activation quantization, over what rounding its float weight
#: to the int8 grid gives (``QuantAccount.weight_ratio``), past which its weight, scale or bias is
#: wrong: an honest quantization's is 0.9-1.15x on tiny Llama, Qwen2, Mistral and Phi3 checkpoints
#: of msModelSlim (plain and smoothed), one int8 output channel negated 7-42x
WEIGHT_ROUNDING_LIMIT = 3.0


@dataclass
class QuantAccount:
    """A W8A8 Linear layer's own error on one input, relative to the float layer's output norm, and
    its parts (``W8A8Linear.account``)."""

    error: float  # the layer's output against the float layer's
    clip: float  # what its static activation quantization's clip changes
    rounding: float  # what rounding its (unclipped) activations to int8 changes
    weight: float  # the rest: its weight and bias against the float layer's
    weight_rounding: float  # what rounding the float weight to its int8 grid gives, on average
    clipped: int  # input values its static activation quantization clips
    values: int  # the input's values

    @property
    def weight_ratio(self) -> float:
        """The weight part over what int8 rounding of the weights gives: about 1 for an honest
        quantization, far more for a weight, scale or bias that is wrong."""
        if self.weight_rounding > 0:
            return self.weight / self.weight_rounding
        return 0.0 if self.weight == 0 else math.inf

    @property
    def clipped_share(self) -> float:
        return self.clipped / self.values if self.values else 0.0

    @property
    def weight_wrong(self) -> bool:
        """Whether the weight part is beyond what int8 rounding gives (``WEIGHT_ROUNDING_LIMIT``)."""
        return self.weight_ratio >= WEIGHT_ROUNDING_LIMIT

    @property
    def explained(self) -> bool:
        """Whether the quantization explains this error: the weight part within int8 rounding
        (``WEIGHT_ROUNDING_LIMIT``), and a clip no larger than a calibration on other prompts gives
        (``CLIP_EXPLAINED_SHARE``)."""
        return not self.weight_wrong and self.clipped_share <= CLIP_EXPLAINED_SHARE

    def words(self, counts: bool = True) -> str:
        """The parts in words: ``own error 0.0857: the clip of 15 of 1024 input values (1.46%) 0.08,
        int8 rounding of the activations 0.02, the weight 0.011 (1.1x its int8 rounding)``;
        ``counts``: with how many values clip (where ``explain`` does not say it beside)."""
        parts = []
        if self.clipped:
            parts.append(f"the clip of {self.clipped} of {self.values} input values "
                         f"({self.clipped_share:.2%}) {self.clip:.3g}" if counts else
                         f"the clip {self.clip:.3g}")
        parts.append(f"int8 rounding of the activations {self.rounding:.3g}")
        parts.append(f"the weight against the float one {self.weight:.3g} ({self.weight_ratio:.2g}x what "
                     "int8 rounding of the weight gives)")
        return f"own error {self.error:.3g}: " + ", ".join(parts)


class NormBias(nn.Module):
    """A norm msModelSlim's anti-outlier gave a bias (its ``NormBias``): ``module(x) + bias``. The
    smoothing divided the norm's weight by a per-channel scale the Linear layers reading it took
    on; ``unsmooth`` moves it back into them, so each module sees what the float model's sees."""

    def __init__(self, module: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.module = module
        self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.module(*args, **kwargs) + self.bias


@dataclass
class QuantizedLinears:
    """What ``install_quantized_linears`` did: the checkpoint tensors it read (the caller loads
    the rest) and the weight type of each Linear layer it made quantized."""

    read: set[str] = field(default_factory=set)
    layers: dict[str, str] = field(default_factory=dict)  # Linear layer name -> its weight type
    #: a Linear layer's name in the checkpoint, where it differs from the model's (an older layout)
    stored_names: dict[str, str] = field(default_factory=dict)
    smoothed: list[str] = field(default_factory=list)  # the norms anti-outlier gave a bias (NormBias)
    #: a static W8A8 layer whose deq_scale is not input_scale * weight_scale -> how it differs
    #: (``W8A8Linear.deq_scale_mismatch``): a checkpoint edited or written inconsistently
    deq_scale_mismatches: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """``28 W8A8``, ``2 W8A16, 26 W8A8``: the Linear layers of each weight type."""
        return ", ".join(f"{n} {t}" for t, n in sorted(Counter(self.layers.values()).items()))

    def inconsistency(self) -> str | None:
        """The sentence the load note adds where static layers' deq_scale is not the product of
        their scales: what runs (deq_scale, as on the device), and that the weight check shows it."""
        if not self.deq_scale_mismatches:
            return None
        name, how = next(iter(self.deq_scale_mismatches.items()))
        more = len(self.deq_scale_mismatches) - 1
        return (f"Its {name}{f' and {more} more Linear layer(s)' if more else ''} "
                f"{'store' if more else 'stores'} a deq_scale that is "
                f"not input_scale x weight_scale ({name}: {how}): the checkpoint is inconsistent; this "
                "emulation, as the device, computes with deq_scale, so the stored weight_scale is not what "
                "runs (llmflow run weight_check names each such layer).")


#: the per-expert Linear layers of a mixture of experts as transformers 4 names them (and
#: msModelSlim quantizes them one by one): ``<experts>.<e>.<name>.weight``
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")


class UnfusedExperts(nn.Module):
    """A fused experts module of transformers 5 (``gate_up_proj`` [E, 2I, H] and ``down_proj``
    [E, H, I], one forward over the routed tokens) as the Linear layers per expert a checkpoint
    quantized one by one holds (children ``0`` .. ``E-1``, each with ``gate_proj``, ``up_proj``,
    ``down_proj``), computing what the fused module computes in its eager form: each expert's
    SwiGLU on its tokens, times the routing weight, added up per token. Same inputs as the fused
    module (hidden states, top-k expert indices, top-k weights), so the golden's recorded call
    replays on it. ``names``: the gate, up and down projections' names (Mixtral's were ``w1``,
    ``w3``, ``w2`` in transformers 4)."""

    def __init__(self, fused: nn.Module, names: tuple[str, str, str] = EXPERT_LINEARS):
        super().__init__()
        gate_up, down = fused.gate_up_proj, fused.down_proj
        inter = down.shape[-1]
        self.count = gate_up.shape[0]
        self.names = names
        for e in range(self.count):
            expert = nn.Module()
            for name, weight in zip(names, (gate_up[e, :inter], gate_up[e, inter:], down[e]), strict=True):
                linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                                   dtype=weight.dtype)
                linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
                setattr(expert, name, linear)
            self.add_module(str(e), expert)
        self.act_fn = fused.act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.count):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            gate, up, down = (getattr(getattr(self, str(e)), name) for name in self.names)
            x = hidden_states[token]
            y = down(self.act_fn(gate(x)) * up(x))
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def plain_fused_experts(module: nn.Module) -> bool:
    """A transformers 5 experts module ``UnfusedExperts`` computes: SwiGLU experts with gate and up
    concatenated, not transposed, without biases."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
            and getattr(module, "has_gate", True) and not getattr(module, "has_bias", False)
            and not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True)
            and not getattr(module, "has_post_expert_norm", False) and hasattr(module, "act_fn"))


def unfuse_experts(model: nn.Module, stored: Callable[[str], bool]) -> list[str]:
    """Each fused experts module of ``model`` whose experts the checkpoint stores one by one
    (``stored("<experts>.0.gate_proj.weight")``) replaced by its ``UnfusedExperts``; returns their
    names. A fused module of another layout is left as it is (the caller refuses what it cannot
    fill)."""
    done = []
    for name, module in list(model.named_modules()):
        if isinstance(module, UnfusedExperts) or not stored(f"{name}.0.{EXPERT_LINEARS[0]}.weight"):
            continue
        if plain_fused_experts(module):
            parent, attr = holder_of(model, name)
            setattr(parent, attr, UnfusedExperts(module))
            done.append(name)
    return done


def checkpoint_renaming(model: nn.Module) -> Callable[[str], str] | None:
    """How this transformers renames a checkpoint's tensors as it loads ``model``: its renaming
    rules (Mixtral's ``block_sparse_moe.`` -> ``mlp.``), and the projections of each expert it
    fuses under the names ``UnfusedExperts`` gives them (Mixtral's ``w1``, ``w3``, ``w2`` ->
    ``gate_proj``, ``up_proj``, ``down_proj``). Read from transformers' own conversion tables, so
    a checkpoint of the older layout (msModelSlim quantizes a transformers 4 model, whose names
    it keeps) is renamed as ``from_pretrained`` renames its float twin (its legacy renamings, such
    as ``LayerNorm.gamma``, included). None where this transformers has no such tables:
    transformers 4 holds a checkpoint's own names."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings
    except ImportError:
        return None
    try:
        transforms = get_model_conversion_mapping(model)
    except (AttributeError, TypeError, ValueError) as exc:  # a transformers whose tables read otherwise
        log.warning("checkpoint names taken as stored: transformers' conversion tables unreadable (%s)", exc)
        return None
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    projections: dict[str, str] = {}  # an expert projection's stored name -> UnfusedExperts' name
    for t in transforms:
        if not isinstance(t, WeightConverter) or len(t.target_patterns) != 1:
            continue
        leaves = [m[1] for p in t.source_patterns if (m := re.search(r"experts\.\*\.(\w+)\.weight$", p))]
        operations = [type(o).__name__ for o in t.operations]
        if t.target_patterns[0].endswith("experts.gate_up_proj") and len(leaves) == 2 \
                and operations == ["MergeModulelist", "Concatenate"]:  # gate and up, in this order
            projections.update(zip(leaves, EXPERT_LINEARS[:2], strict=True))
        elif t.target_patterns[0].endswith("experts.down_proj") and len(leaves) == 1 \
                and operations == ["MergeModulelist"]:
            projections[leaves[0]] = EXPERT_LINEARS[2]
    projections = {k: v for k, v in projections.items() if k != v}
    if not renamings and not projections:
        return None
    leaf = re.compile(r"(\.experts\.\d+\.)(" + "|".join(map(re.escape, projections)) + r")\.") \
        if projections else None

    def rename(name: str) -> str:
        name = apply_renamings(name, renamings)
        return leaf.sub(lambda m: f"{m[1]}{projections[m[2]]}.", name, count=1) if leaf else name
    return rename


def install_quantized_linears(model: nn.Module, files: SafetensorsFiles, quant: QuantConfig
                              ) -> QuantizedLinears:
    """Each ``nn.Linear`` of ``model`` (built without weights) whose checkpoint weight is quantized
    made to compute as its weight type says (see the module docstring); UserError naming the tensor
    where a type cannot be run, or where a quantized tensor has no Linear layer to go to."""
    done = QuantizedLinears()
    where = files.directory
    unfuse_experts(model, lambda key: key in files)
    for name, module in list(model.named_modules()):
        key = f"{name}.weight"
        if not isinstance(module, nn.Linear) or key not in files:
            continue
        stored = files.stored_dtype(key)
        if stored is None or stored.is_floating_point:
            continue  # a float layer (msModelSlim keeps the ones it was told not to quantize)
        qtype = quant.type_of(key) or "W8A16"
        base = f"{name}."
        tensors = {c: files.read(base + c) for c in (*LINEAR_COMPANIONS, "bias") if base + c in files}
        try:
            if qtype in WEIGHT_ONLY:
                if "weight_scale" not in tensors:
                    raise ValueError("no weight_scale beside the integer weight")
                weight = files.read(key)
                if WEIGHT_ONLY[qtype] == 4:
                    dim = int4_packed_dim(tuple(weight.shape), tuple(tensors["weight_scale"].shape), quant,
                                          (module.out_features, module.in_features))
                    weight = unpack_int4(weight, dim) if dim is not None else weight
                deq, _ = dequantize(weight, tensors["weight_scale"], tensors.get("weight_offset"),
                                    group_size=quant.group_size)
                if tuple(deq.shape) != (module.out_features, module.in_features):
                    raise ValueError(f"dequantizes to {list(deq.shape)}, the layer is "
                                     f"[{module.out_features}, {module.in_features}]")
                module._parameters["weight"] = nn.Parameter(deq, requires_grad=False)
                read = {key, *(base + c for c in LINEAR_COMPANIONS if base + c in files)}
            elif qtype in ACTIVATION_QUANT:
                weight = files.read(key)
                if tuple(weight.shape) != (module.out_features, module.in_features):
                    raise ValueError(f"shape {list(weight.shape)}, the layer is "
                                     f"[{module.out_features}, {module.in_features}]")
                parent, attr = holder_of(model, name)
                linear = W8A8Linear(qtype, weight, tensors, quant.group_size)
                setattr(parent, attr, linear)
                mismatch = linear.deq_scale_mismatch()
                if mismatch is not None:
                    done.deq_scale_mismatches[files.stored_name(key).removesuffix(".weight")] = mismatch
                read = {key, *(base + c for c in (*LINEAR_COMPANIONS, "bias") if base + c in files)}
            else:
                raise UserError(f"{where}: {files.stored_name(key)} is quantized as {qtype}, which llmflow "
                                f"cannot run (it runs {', '.join([*WEIGHT_ONLY, *ACTIVATION_QUANT])}); "
                                "bisect the device's own dumps instead (dump_bisect)")
        except ValueError as exc:
            raise UserError(f"{where}: {files.stored_name(key)} ({qtype}): {exc}") from exc
        done.read |= read
        done.layers[name] = qtype
        if files.stored_name(key) != key:
            done.stored_names[name] = files.stored_name(key).removesuffix(".weight")
    _install_norm_biases(model, files, done)
    own = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in model.named_buffers(remove_duplicate=False)}
    left = sorted(n for n in files.stored if n not in done.read and n not in own)
    experts = next((n for n in left if ".experts." in n), None)
    if experts is not None:  # experts one by one, in a fused layout UnfusedExperts does not compute
        raise UserError(f"{where}: the checkpoint stores its MoE experts one by one "
                        f"({files.stored_name(experts)!r}, {len(left)} such tensor(s)), and this "
                        f"transformers' {type(model).__name__} fuses them in a layout llmflow cannot split "
                        "(it splits SwiGLU experts stored as gate_up_proj and down_proj, without biases); "
                        "bisect the device's own dumps instead (dump_bisect)")
    if left:
        described = quant.path.name if quant.path else "the description"
        raise UserError(f"{where}: the quantized tensor {files.stored_name(left[0])!r} "
                        f"({quant.types.get(left[0], 'no type')} in {described}) belongs to no Linear layer "
                        f"of the model ({len(left)} such tensor(s)): llmflow runs quantized Linear layers "
                        "only (not quantized KV caches, fused experts or convolutions); bisect the "
                        "device's own dumps instead (dump_bisect)")
    return done


def _install_norm_biases(model: nn.Module, files: SafetensorsFiles, done: QuantizedLinears) -> None:
    """Each norm stored as msModelSlim's anti-outlier leaves it (``N.module.weight``, the norm's
    own tensors; ``N.bias``, the bias it adds; ``N.weight``, a copy of the norm's weight) wrapped
    in a ``NormBias``. A bias the inner norm stores where the model's norm has none is added to
    the outer one (msModelSlim's norm adds both); a copy that differs from the weight is refused:
    which of the two the device reads is not known."""
    for name, module in list(model.named_modules()):
        inner = f"{name}.module."
        if not name or f"{inner}weight" not in files or module._parameters.get("weight") is None:
            continue
        if f"{name}.weight" in files and not torch.equal(files.read(f"{name}.weight").float(),
                                                         files.read(f"{inner}weight").float()):
            raise UserError(f"{files.directory}: {name}.weight and {inner}weight differ: an anti-outlier "
                            "norm stores its weight twice, and which one the device reads is not known")
        bias = files.read(f"{name}.bias").float() if f"{name}.bias" in files else \
            torch.zeros(module._parameters["weight"].shape)
        if f"{inner}bias" in files and module._parameters.get("bias") is None:
            bias = bias + files.read(f"{inner}bias").float()
            done.read.add(f"{inner}bias")
        parent, attr = holder_of(model, name)
        setattr(parent, attr, NormBias(module, bias))
        done.read |= {n for n in (f"{name}.weight", f"{name}.bias") if n in files}
        done.smoothed.append(name)


def unsmooth(model: nn.Module, golden_weights: dict[str, torch.Tensor], probe: Callable[[], torch.Tensor],
             tolerance: float) -> list[str]:
    """Move each ``NormBias``'s smoothing into the Linear layers that read it: the norm takes the
    float model's weight (``golden_weights``: norm name -> its weight) and no bias, each Linear
    layer reading it first computes ``x / s + bias`` (``s``: float weight over smoothed weight,
    per channel, measured by running the norm with each), so the model computes what it did while
    each module's input is the float model's. The readers are found by one ``probe`` forward
    (hooks: the very tensor a norm returns handed to a Linear); a second must give the same output
    as before within ``tolerance`` (relative L2), else nothing is changed. Returns the norms moved."""
    norms = {n: m for n, m in model.named_modules() if isinstance(m, NormBias) and n in golden_weights}
    if not norms:
        return []
    seen: dict[int, tuple[str, torch.Tensor]] = {}  # id of a norm's output -> (norm, the output kept alive)
    readers: dict[str, list[nn.Module]] = {n: [] for n in norms}

    def saw(name: str) -> Callable[..., None]:
        return lambda _m, _args, out: seen.__setitem__(id(out), (name, out))

    def read(module: nn.Module) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple) -> None:
            if args and id(args[0]) in seen and seen[id(args[0])][1] is args[0]:
                readers[seen[id(args[0])][0]].append(module)
        return hook

    hooks = [m.register_forward_hook(saw(n)) for n, m in norms.items()]
    hooks += [m.register_forward_pre_hook(read(m)) for m in model.modules()
              if isinstance(m, (nn.Linear, W8A8Linear))]
    try:
        with torch.no_grad():
            before = probe().float()
    finally:
        for h in hooks:
            h.remove()
    seen.clear()
    moved, undo = [], []
    for name, norm in norms.items():
        weight = norm.module._parameters["weight"]
        scale = _smoothing_scale(norm.module, golden_weights[name].to(weight.device, torch.float32))
        if scale is not None and bool(((scale - 1).abs() <= 1e-3).all()) and not bool(norm.bias.any()):
            moved.append(name)  # not smoothed (a norm before a float layer): nothing to move
            continue
        if scale is None or not readers[name]:
            continue
        inverse = (1 / scale).to(weight.dtype)
        shift = norm.bias.detach().clone()
        old_weight, old_bias = weight.data.clone(), norm.bias.data.clone()
        weight.data.copy_(golden_weights[name].to(weight.device, weight.dtype))
        norm.bias.data.zero_()
        handles = [m.register_forward_pre_hook(
            lambda _m, args, inverse=inverse, shift=shift: (args[0] * inverse + shift, *args[1:]))
            for m in dict.fromkeys(readers[name])]
        undo.append((weight, old_weight, norm.bias, old_bias, handles))
        moved.append(name)
    with torch.no_grad():
        after = probe().float()
    if float((after - before).norm() / before.norm().clamp_min(1e-30)) > tolerance:
        for weight, old_weight, bias, old_bias, handles in undo:  # not a pure rescaling: left as it was
            weight.data.copy_(old_weight)
            bias.data.copy_(old_bias)
            for h in handles:
                h.remove()
        return []
    return moved


def _smoothing_scale(norm: nn.Module, golden_weight: torch.Tensor) -> torch.Tensor | None:
    """Per channel, how much smaller the smoothed norm's output is than the float weight's (the
    norm run on one probe input with each weight, in float32); None where it is not one scale per
    channel (a norm that differs otherwise is not a smoothing)."""
    probe = copy.deepcopy(norm).float()
    x = torch.randn(8, golden_weight.shape[0], generator=torch.Generator().manual_seed(0))
    x = x.to(golden_weight.device)
    with torch.no_grad():
        smoothed = probe(x)
        probe._parameters["weight"].data.copy_(golden_weight)
        golden = probe(x)
    ratio = golden / smoothed
    scale = ratio.median(dim=0).values
    if not bool(torch.isfinite(scale).all()) or bool(((ratio - scale).abs() > 1e-3 * scale.abs()).any()):
        return None
    return scale
