"""Compare two sets of weights tensor by tensor: float vs quantized checkpoint, checkpoint vs
checkpoint, or a dump's ``dump_weight`` output vs a checkpoint.

Sources (``open_weights``): a safetensors file, a directory of shards (every ``*.safetensors``, or
exactly the shards a ``*.safetensors.index.json`` names), or a dump directory with weight entries.
Tensors are read one at a time through ``safe_open`` (memory-mapped), so memory stays bounded by
the largest tensor pair, whatever the checkpoint size.

Quantized weights (msModelSlim's conventions, as its 26.1 writes them; checked against its output):

* ``quant_model_description*.json`` (auto-detected next to the weights) maps tensor names to a
  type; ``model_quant_type`` is the default. The ``ascendV1`` save type writes
  ``quant_model_description.json`` with ``"version": "1.0.0"`` (and ``"group_size"`` for per-group
  schemes); ``safe_tensor`` writes ``quant_model_description_<type>.json`` without a version.
  Weight types dequantized: W8A16, W8A8, W8A8_DYNAMIC, W8A8_MIX, W8A8S (int8) and W4A16 (int4).
  FLOAT tensors are compared as they are. The sparse-compressed types (W8A8SC, W16A16SC: the
  weight squeezed to a byte stream with ``.index``/``.info`` tensors) are reported as such, one row
  per weight, their ``.index``/``.info`` consumed; any other type (W4A8 two-level scales ...) is
  reported as ``unsupported``, never skipped.
* ``X.weight`` (integer) with ``X.weight_scale`` and optional ``X.weight_offset`` (zero when absent)
  dequantizes to ``(weight - offset) * scale`` (asymmetric schemes store a non-zero offset). The
  scale's shape picks the scheme: one element per-tensor; ``[out]`` or ``[out, 1]`` per-channel;
  ``[out, n_groups]`` (or ``[n_groups, out]``) per-group along the input dimension, group size
  ``in / n_groups`` (checked against the description's ``group_size`` when it gives one). W8A8S
  stores no ``weight_scale``: its scale is ``deq_scale / input_scale``. An integer weight with a
  scale but no description entry is treated as int8 (int4 if the description's default says W4,
  or if one of its dimensions is half its float twin's: int4 two per byte).
* W8A8 also stores ``deq_scale`` (``input_scale * weight_scale``: the scale the int8 matmul
  applies, float32 bits held in an int64 unless the model is bf16), ``input_scale``,
  ``input_offset`` and ``quant_bias``; where ``deq_scale`` disagrees with ``input_scale *
  weight_scale`` the device computes with another weight than the one dequantized here, and the
  tensor fails (``scale_mismatch``); so it does where ``quant_bias`` is not ``round(bias /
  deq_scale) - input_offset * sum_k weight`` (``bias`` the float one stored beside it, or zero).
* int4 is stored one value per int8 (``safe_tensor``) or two per byte, low nibble first, signed
  (``ascendV1``, ``"int4_packed": true``, or a stored dimension half the float twin's). ``ascendV1``
  packs a per-channel weight (scale ``[out, 1]``) along the input dimension (``[out, in/2]``) and a
  per-group one along the output dimension (``[out/2, in]``: rows 2j and 2j+1 share byte row j).
* Companion tensors (``weight_scale``, ``weight_offset``, ``deq_scale``, ``quant_bias``,
  ``input_scale``, ``input_offset`` and the W4A8 ones) are consumed, and counted in the summary.

Anti-outlier (smoothed) checkpoints: msModelSlim divides a norm's weight by a per-channel scale
and multiplies the input columns of the Linear layers reading it by the same scale (the norm then
stored as ``N.module.weight``, with ``N.bias``, ``N.module.bias`` and a copy ``N.weight``). Each
such scale is the golden norm's weight over the target's (``smoothing_scales``); a Linear weight
of the same layer whose input columns carry one (the difference shrinks ``SMOOTHING_GAIN`` times
once it is divided out) is compared as the float layer it stands for (``smoothing`` names the
norm), and the norm passes, saying where its scale went. The scale is the norm's own, never fitted
to the layer, so a fault in the layer is not divided out with it.

Siblings: a tensor in a decoder layer is also judged against the same role in the other layers
(``model.layers.*.mlp.up_proj.weight``). Honest rounding errs alike in every layer; a tensor whose
relative distance is ``sibling_ratio`` (the bisect's ratio) times the median of its siblings fails
(``sibling_outlier``), even when its own precision's limits would only warn: a whole layer's scale
off by 25% (relative distance 0.25) sits under int8's fail limit, and 38x its siblings. Int4
rounding alone is a relative distance of ~0.1, so there the same fault is told by the second
measure, ``scale_error``: the worst output channel's gain error, which rounding hardly moves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmflow.compare.thresholds import finite_or_none
from llmflow.dtypes import DTYPE_OF_SAFETENSORS_CODE, dtype_name
from llmflow.errors import UserError
from llmflow.quantized import (
    DEQ_SCALE_RTOL,
    QuantConfig,
    deq_scale_as_float,
    dequantize,
    find_quant_config,
    int4_packed_dim,
    unpack_int4,
)
from llmflow.results.checks import WeightCompareBlock, WeightProblem, WorstWeight
from llmflow.structure import DEFAULT_RATIO_THRESHOLD, layer_of, module_type

COMPANIONS = ("weight_scale", "weight_offset", "deq_scale", "quant_bias", "input_scale", "input_offset",
              "weight_scale_second", "weight_offset_second", "scale_bias")
DEQUANT_BITS = {"W8A8": 8, "W8A8S": 8, "W8A8_DYNAMIC": 8, "W8A8_MIX": 8, "W8A16": 8, "W4A16": 4}
#: msModelSlim's sparse-compressed types: the weight is a compressed byte stream with an ``.index``
#: and an ``.info`` tensor beside it, decodable only by its compression tool.
COMPRESSED = ("W8A8SC", "W16A16SC")
COMPRESSED_COMPANIONS = ("index", "info")
#: Row codes of the weight check beyond the compare's (``llmflow.compare.codes``).
SIBLING_OUTLIER, SCALE_MISMATCH = "sibling_outlier", "scale_mismatch"


class Checkpoint:
    """A safetensors checkpoint: a file, a directory of shards, or a shard index."""

    kind = "checkpoint"

    def __init__(self, path: str | Path, quant: QuantConfig | None = None):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self.quant = quant
        self.files: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        for shard in _shards(self.path):
            try:
                with safe_open(str(shard), framework="pt") as f:
                    keys = list(f.keys())
            except (SafetensorError, OSError) as exc:
                raise UserError(f"{shard}: unreadable safetensors file ({exc})") from exc
            for k in keys:
                if k in self.files:
                    raise UserError(f"{self.path}: tensor {k!r} is in two shards: {self.files[k].name} "
                                    f"and {shard.name}")
                self.files[k] = shard

    def _handle(self, key: str) -> Any:
        from safetensors import safe_open

        shard = self.files[key]
        if shard not in self._handles:
            self._handles.clear()  # shards are visited in order: one open file at a time
            self._handles[shard] = safe_open(str(shard), framework="pt", device="cpu")
        return self._handles[shard]

    def keys(self) -> list[str]:
        return list(self.files)

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def meta(self, key: str) -> tuple[tuple[int, ...], str]:
        sl = self._handle(key).get_slice(key)
        return tuple(sl.get_shape()), DTYPE_OF_SAFETENSORS_CODE.get(sl.get_dtype(), sl.get_dtype())

    def get(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)


def _shards(path: Path) -> list[Path]:
    if path.is_file() and path.name.endswith(".index.json"):
        return _index_shards(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise UserError(f"{path}: not a safetensors file (convert .bin checkpoints to safetensors; "
                            "llmflow never unpickles)")
        return [path]
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        return sorted({s for index in indexes for s in _index_shards(index)})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}: no *.safetensors files here")
    return files


def _index_shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{index}: not a safetensors shard index (no weight_map: {exc})") from exc
    shards = sorted({index.parent / str(f) for f in weight_map.values()})
    for s in shards:
        if not s.is_file():
            raise UserError(f"{index}: shard {s.name} is missing")
    return shards


class DumpWeights:
    """The weights a dump recorded with ``dump_weight`` (entries of kind ``weight``)."""

    kind = "dump"
    quant = None

    def __init__(self, path: str | Path):
        from llmflow.formats import open_dump

        self.path = Path(path)
        self.reader = open_dump(self.path)
        self.by_name = {e.name: e for e in self.reader.entries() if e.kind == "weight"}
        if not self.by_name:
            raise UserError(f"{self.path}: this dump holds no weights (dump with dump_weight: true)")

    def keys(self) -> list[str]:
        return list(self.by_name)

    def __contains__(self, key: str) -> bool:
        return key in self.by_name

    def meta(self, key: str) -> tuple[tuple[int, ...], str]:
        e = self.by_name[key]
        return tuple(e.shape or ()), dtype_name(e.dtype)

    def get(self, key: str) -> torch.Tensor:
        return self.reader.load(self.by_name[key])


def open_weights(path: str | Path, quant_config: str | Path | None = None) -> Checkpoint | DumpWeights:
    """A weight source for a checkpoint or a dump path; the quant description is auto-detected."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such checkpoint or dump")
    is_ckpt = p.is_file() or any(p.glob("*.safetensors")) or any(p.glob("*.safetensors.index.json"))
    if not is_ckpt:
        return DumpWeights(p)
    qpath = Path(quant_config) if quant_config else find_quant_config(p)
    if qpath is not None and not qpath.is_file():
        raise UserError(f"quant_config: no such file {qpath}")
    return Checkpoint(p, QuantConfig.load(qpath) if qpath else None)


@dataclass
class Plan:
    """How to materialize one logical tensor of a source as float."""

    key: str
    qtype: str | None = None  # None: plain tensor
    problem: str | None = None  # set: cannot be materialized (the reason)
    guessed: bool = False  # qtype not from a description: int8 assumed (``with_twin`` may see int4)

    def with_twin(self, stored: tuple[int, ...], twin: tuple[int, ...]) -> Plan:
        """This plan, or W4A16 where its type was guessed and the stored weight has one dimension
        half its float twin's (int4 two per byte: an ascendV1 checkpoint without its description)."""
        if not self.guessed or DEQUANT_BITS.get(self.qtype or "") != 8:
            return self
        if int4_packed_dim(stored, (), None, twin) is None:
            return self
        return Plan(self.key, "W4A16", guessed=True)


def plan_source(src: Checkpoint | DumpWeights) -> tuple[dict[str, Plan], int]:
    """Logical tensors of a source (companions consumed) and the number of companions."""
    keys = src.keys()
    present = set(keys)
    quant = src.quant
    plans: dict[str, Plan] = {}
    companions = 0
    smoothed = {k[: -len(".module.weight")] for k in keys if k.endswith(".module.weight")}
    for key in keys:
        suffix = key.rsplit(".", 1)[-1]
        qtype = quant.type_of(key) if quant else None
        if suffix in COMPANIONS or (suffix in COMPRESSED_COMPANIONS and qtype in COMPRESSED) or \
                _norm_bias_part(key, smoothed):
            companions += 1
            continue
        base = key[: -len("weight")] if key.endswith("weight") else None
        has_scale = base is not None and (f"{base}weight_scale" in present or (
            qtype == "W8A8S" and f"{base}deq_scale" in present and f"{base}input_scale" in present))
        _, dtype = src.meta(key)
        is_int = dtype in ("int8", "uint8", "int16", "int32")
        if qtype in COMPRESSED:
            plans[key] = Plan(key, qtype, f"sparse-compressed {qtype}: msModelSlim's compressed layout "
                                          "cannot be decoded; compare the checkpoint it was compressed from")
        elif qtype not in (None, "FLOAT") and qtype not in DEQUANT_BITS and (is_int or has_scale):
            plans[key] = Plan(key, qtype, f"unsupported quantization scheme {qtype}")
        elif is_int and has_scale and qtype in DEQUANT_BITS:
            plans[key] = Plan(key, qtype)
        elif is_int and has_scale:
            plans[key] = Plan(key, "W4A16" if quant and (quant.default or "").startswith("W4") else "W8A16",
                              guessed=True)
        else:  # float, or an integer tensor without a scale: compared as stored
            plans[key] = Plan(key)
    return plans, companions


def _norm_bias_part(key: str, smoothed: set[str]) -> bool:
    """Whether ``key`` is a tensor of an anti-outlier norm other than its weight: its inner copy
    (``N.module.weight``/``N.module.bias``) or the bias it adds (``N.bias``, compared with none:
    the float model's norm has none; ``quantized.NormBias``)."""
    base, _, leaf = key.rpartition(".")
    if base.endswith(".module") and base[: -len(".module")] in smoothed:
        return True
    return leaf == "bias" and base in smoothed


def smoothing_scales(golden: Checkpoint | DumpWeights, target: Checkpoint | DumpWeights,
                     name_map: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """For each norm msModelSlim's anti-outlier smoothed in ``target`` (``N.module.weight``): the
    per-channel scale its weight was divided by, the golden's weight over the target's; the Linear
    layers reading it carry that scale on their input columns."""
    scales: dict[str, torch.Tensor] = {}
    g_keys = set(golden.keys())
    for key in target.keys():
        if not key.endswith(".module.weight"):
            continue
        norm = key[: -len(".module.weight")]
        g_name = map_name(f"{norm}.weight", name_map)
        if g_name not in g_keys:
            continue
        g, t = golden.get(g_name).to(torch.float64), target.get(key).to(torch.float64)
        if g.shape == t.shape and bool((t != 0).all()):
            scales[norm] = g / t
    return scales


#: a weight compared after dividing out a norm's smoothing must be this much closer to the golden
#: than as stored: the norm's own scale explains the difference, not a fault that resembles it
SMOOTHING_GAIN = 4.0


def _unsmoothed(name: str, g: torch.Tensor, t: torch.Tensor, scales: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, str | None]:
    """``t`` with the smoothing of the norm (of the same layer) whose scale its input columns carry
    divided out, and that norm; ``t`` and None where none explains the difference."""
    if t.dim() != 2 or not scales:
        return t, None
    layer = layer_of(name)
    raw = float(torch.linalg.vector_norm(t - g))
    best: tuple[float, str, torch.Tensor] | None = None
    for norm, scale in scales.items():
        if scale.numel() != t.shape[1] or (layer is not None and layer_of(norm) not in (None, layer)):
            continue
        back = t / scale.to(t.dtype)
        err = float(torch.linalg.vector_norm(back - g))
        if best is None or err < best[0]:
            best = (err, norm, back)
    if best is None or not best[0] * SMOOTHING_GAIN < raw:
        return t, None
    return best[2], best[1]


def _weight_scale(src: Checkpoint | DumpWeights, base: str) -> torch.Tensor:
    """``X.weight_scale``, or for W8A8S (which stores none) ``deq_scale / input_scale`` per channel."""
    if base + "weight_scale" in src:
        return src.get(base + "weight_scale")
    deq = deq_scale_as_float(src.get(base + "deq_scale"))
    return (deq / src.get(base + "input_scale").to(torch.float32)).reshape(-1, 1)


def materialize(src: Checkpoint | DumpWeights, plan: Plan,
                twin_shape: tuple[int, ...] | None) -> tuple[torch.Tensor, str]:
    """The float tensor of a plan and its scheme ("float" for plain tensors)."""
    t = src.get(plan.key)
    if plan.qtype is None or plan.qtype not in DEQUANT_BITS:
        return t, "float"
    base = plan.key[: -len("weight")]
    scale = _weight_scale(src, base)
    offset = src.get(base + "weight_offset") if base + "weight_offset" in src else None
    quant = src.quant
    packing = ""
    if DEQUANT_BITS[plan.qtype] == 4:
        dim = int4_packed_dim(tuple(t.shape), tuple(scale.shape), quant, twin_shape)
        if dim is not None:
            t = unpack_int4(t, dim)
            packing = " int4-packed" + (" along the output dim" if dim == 0 and t.dim() > 1 else "")
    deq, scheme = dequantize(t, scale, offset, group_size=quant.group_size if quant else None)
    return deq, f"{plan.qtype} {scheme}{packing}"


def deq_scale_mismatch(src: Checkpoint | DumpWeights, plan: Plan) -> str | None:
    """Why a W8A8 tensor's ``deq_scale`` disagrees with ``input_scale * weight_scale``, or None.

    The int8 matmul applies ``deq_scale``; ``weight_scale`` is what dequantizes the weight here. A
    checkpoint where they differ computes on the device with another weight than the one checked."""
    base = plan.key[: -len("weight")]
    if plan.qtype is None or not all(base + c in src for c in ("weight_scale", "deq_scale", "input_scale")):
        return None
    applied = deq_scale_as_float(src.get(base + "deq_scale")).flatten()
    implied = (src.get(base + "input_scale").to(torch.float32).flatten()
               * src.get(base + "weight_scale").to(torch.float32).flatten())
    if applied.numel() != implied.numel():
        return None
    rel = (applied - implied).abs() / implied.abs().clamp_min(1e-30)
    bad = rel > DEQ_SCALE_RTOL
    if not bool(bad.any()):
        return None
    ratio = (applied / implied.clamp_min(1e-30))[bad]
    worst = float(ratio[(ratio.log().abs()).argmax()])
    return (f"deq_scale disagrees with input_scale x weight_scale in {int(bad.sum())} of {bad.numel()} "
            f"channels (deq_scale {worst:.4g}x): the device computes with another weight than this one")


def quant_bias_mismatch(src: Checkpoint | DumpWeights, plan: Plan) -> str | None:
    """Why a W8A8 tensor's ``quant_bias`` is not the bias the int8 matmul needs, or None.

    The device computes ``deq_scale * (x_int8 @ W_int8.T + quant_bias)`` with ``x_int8`` shifted by
    ``input_offset``, so msModelSlim stores ``quant_bias = round(bias / deq_scale) - input_offset *
    sum_k W_int8`` (``bias`` the float bias the checkpoint keeps beside it, zero without one; exact
    on its own output). Off by more than one unit of rounding, the device adds another bias."""
    base = plan.key[: -len("weight")]
    if plan.qtype is None or not all(base + c in src for c in ("quant_bias", "deq_scale", "input_offset")):
        return None
    weight = src.get(plan.key)
    if weight.dtype != torch.int8 or weight.dim() != 2:
        return None
    stored = src.get(base + "quant_bias").to(torch.float64).flatten()
    deq = deq_scale_as_float(src.get(base + "deq_scale")).to(torch.float64).flatten()
    bias = src.get(base + "bias").to(torch.float64).flatten() if base + "bias" in src else torch.zeros(1)
    offset = src.get(base + "input_offset").to(torch.float64).flatten()
    if stored.numel() != weight.shape[0] or deq.numel() not in (1, stored.numel()):
        return None
    implied = torch.round(bias / deq) - offset * weight.to(torch.float64).sum(dim=1)
    off = (stored - implied).abs()
    bad = off > 1
    if not bool(bad.any()):
        return None
    return (f"quant_bias disagrees with round(bias / deq_scale) - input_offset x sum(weight) in "
            f"{int(bad.sum())} of {bad.numel()} channels (off by up to {float(off.max()):.4g}): the device "
            "adds another bias than this checkpoint's")


def map_name(name: str, name_map: dict[str, str] | None) -> str:
    """Rename a target tensor by the longest matching prefix of ``name_map`` (target -> golden)."""
    for prefix in sorted(name_map or {}, key=len, reverse=True):
        if name.startswith(prefix):
            return name_map[prefix] + name[len(prefix):]  # type: ignore[index]
    return name


def compare_sources(golden: Checkpoint | DumpWeights, target: Checkpoint | DumpWeights, *,
                    name_map: dict[str, str] | None = None, thresholds: dict | None = None,
                    on_tensor: Callable[[str], None] | None = None,
                    sibling_ratio: float | None = DEFAULT_RATIO_THRESHOLD,
                    ) -> tuple[list[dict[str, Any]], int]:
    """Every logical tensor compared (``rank_rows`` order) and the number of companion tensors.

    ``sibling_ratio``: a tensor whose error is this many times its siblings' median fails
    (``judge_siblings``); None or 0 judges each tensor alone."""
    g_plans, g_comp = plan_source(golden)
    t_plans, t_comp = plan_source(target)
    scales = smoothing_scales(golden, target, name_map)
    rows = list(_rows(golden, target, g_plans, t_plans, name_map, thresholds, on_tensor, scales))
    _judge_smoothed_norms(rows, scales)
    if sibling_ratio:
        judge_siblings(rows, sibling_ratio)
    return rank_rows(rows), g_comp + t_comp


def _judge_smoothed_norms(rows: list[dict[str, Any]], scales: dict[str, torch.Tensor]) -> None:
    """A smoothed norm differs from the golden's by design where its scale went into the Linear
    layers after it: its row passes, saying so; a norm none of them carries stays as judged."""
    carried = {r.get("smoothing") for r in rows}
    for r in rows:
        norm = r["name"].removesuffix(".weight")
        if norm in scales and norm in carried and r.get("status") == "compared":
            readers = sorted(x["name"] for x in rows if x.get("smoothing") == norm)
            r.update(verdict="pass", code=None, smoothing=norm,
                     reason=f"anti-outlier smoothed: its scale went into {', '.join(readers[:3])}"
                            + (", ..." if len(readers) > 3 else ""))


def _rows(golden: Checkpoint | DumpWeights, target: Checkpoint | DumpWeights, g_plans: dict[str, Plan],
          t_plans: dict[str, Plan], name_map: dict[str, str] | None, thresholds: dict | None,
          on_tensor: Callable[[str], None] | None, scales: dict[str, torch.Tensor] | None = None
          ) -> Iterator[dict[str, Any]]:
    """One row per logical tensor, golden order first (shard by shard), then target-only ones."""
    from llmflow.compare.metrics import compare_tensors, judge

    t_by_golden = {map_name(k, name_map): p for k, p in t_plans.items()}
    for name in list(g_plans) + [n for n in t_by_golden if n not in g_plans]:
        gp, tp = g_plans.get(name), t_by_golden.get(name)
        row: dict[str, Any] = {"name": name, "target_name": tp.key if tp else None,
                               "quant_type": tp.qtype if tp else None}
        if gp is not None:
            g_shape, row["golden_dtype"] = golden.meta(gp.key)
            row["golden_shape"] = list(g_shape)
        if tp is not None:
            t_shape, row["target_dtype"] = target.meta(tp.key)
            row["target_shape"] = list(t_shape)
        if on_tensor is not None:
            on_tensor(name)
        if tp is None or gp is None:
            problem = "missing in target" if tp is None else "missing in golden"
        else:
            problem = f"golden: {gp.problem}" if gp.problem else tp.problem
            if gp.qtype is None:
                tp = tp.with_twin(tuple(row["target_shape"]), tuple(row["golden_shape"]))
                row["quant_type"] = tp.qtype
        if problem:
            yield {**row, "status": _status(problem), "verdict": "fail", "reason": problem}
            continue
        try:
            g, _ = materialize(golden, gp, None)
            t, row["scheme"] = materialize(target, tp, tuple(g.shape))
        except ValueError as exc:
            yield {**row, "status": "unsupported", "verdict": "fail", "reason": str(exc)}
            continue
        if tuple(g.shape) != tuple(t.shape):
            yield {**row, "status": "shape_mismatch", "verdict": "fail",
                   "reason": f"shape mismatch: golden {list(g.shape)}, target {list(t.shape)}"}
            continue
        g, t = g.float(), t.float()  # rebinding drops the stored-dtype originals: bounded memory
        t, smoothing = _unsmoothed(name, g, t, scales or {})
        if smoothing is not None:  # compared as the float layer it stands for (see _unsmoothed)
            row["smoothing"] = smoothing
        row.update(compare_tensors(g, t))
        row["numel"] = g.numel()
        row["l2_distance"] = float(torch.linalg.vector_norm(g - t))
        row["scale_error"] = scale_error(g, t)
        del g, t
        row["status"] = "compared"
        # judged at the precision the target stores: int8/int4 for quantized weights
        bits = DEQUANT_BITS.get(tp.qtype or "")
        j = judge(row, f"int{bits}" if bits else row["target_dtype"], thresholds)
        row.update(verdict=j.verdict, code=j.code, reason=j.reason)
        mismatch = "; ".join(filter(None, (deq_scale_mismatch(target, tp), quant_bias_mismatch(target, tp))))
        if mismatch:
            row.update(verdict="fail", code=SCALE_MISMATCH,
                       reason=mismatch + (f"; {j.reason}" if j.verdict != "pass" else ""))
        yield row


def scale_error(golden: torch.Tensor, target: torch.Tensor) -> float | None:
    """The worst output channel's gain error ``|<t, g> / <g, g> - 1|``: what a wrong scale does.

    Rounding errs in every direction and hardly moves a channel's projection on its golden (an
    int4 channel of 64 inputs: about 0.01), while a scale off by 25% moves it by 0.25; so this
    separates a mis-scaled channel or tensor from honest rounding where the total error cannot
    (int4 rounding alone is a relative distance of about 0.1). None for a scalar or all-zero golden."""
    if golden.dim() == 0 or golden.numel() == 0:
        return None
    g, t = golden.reshape(golden.shape[0], -1), target.reshape(golden.shape[0], -1)
    energy = (g * g).sum(dim=1)
    live = energy > 0
    if not bool(live.any()):
        return None
    gain = (t * g).sum(dim=1)[live] / energy[live]
    worst = float((gain - 1).abs().max())
    return worst if math.isfinite(worst) else math.inf


def _status(problem: str) -> str:
    if problem.startswith("missing in "):
        return problem.replace(" ", "_")
    return "compressed" if "sparse-compressed" in problem else "unsupported"


#: Below this error siblings count as exact: an error must exceed ratio x this to stand out
#: (float32 carries ~1e-7; identical tensors give 0, and 3x 0 is no standard).
SIBLING_FLOOR = 1e-6
#: The errors a tensor is measured against its siblings by: the total error, and the worst
#: channel's gain error (``scale_error``), which a wrong scale moves far more than rounding does.
SIBLING_MEASURES = ("relative_euclidean_distance", "scale_error")


def judge_siblings(rows: list[dict[str, Any]], ratio: float = DEFAULT_RATIO_THRESHOLD) -> None:
    """Judge each compared tensor of a decoder layer against its siblings, in place.

    Siblings are the same role in the other layers (``module_type``: ``model.layers.*.mlp.up_proj
    .weight``). For each of ``SIBLING_MEASURES`` the typical error is the median of the *other*
    siblings (leave-one-out, as the bisect's ranking, so with two layers the faulty one is measured
    against the healthy one); ``sibling_score`` is the larger of the tensor's two ratios to it and
    ``sibling_median`` the typical error of that measure. A score of ``ratio`` or more fails the
    row (``sibling_outlier``), its reason saying which error, by how much and against what."""
    from statistics import median

    roles: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "compared" and layer_of(r["name"]) is not None:
            roles.setdefault(module_type(r["name"]), []).append(r)
    for role, members in roles.items():
        for i, r in enumerate(members):
            best: tuple[float, str, float, float, int] | None = None
            for measure in SIBLING_MEASURES:
                mine = finite_or_none(r.get(measure))
                others = [v for j, m in enumerate(members) if j != i
                          and (v := finite_or_none(m.get(measure))) is not None]
                if mine is None or not others:
                    continue
                typical = median(others)
                score = mine / max(typical, SIBLING_FLOOR)
                if best is None or score > best[0]:
                    best = (score, measure, mine, typical, len(others))
            if best is None:
                continue
            score, measure, mine, typical, n = best
            r["sibling_median"], r["sibling_score"] = typical, score
            if score < ratio:
                continue
            why = (f"{measure} {mine:.3g} is {score:.1f}x the median {typical:.3g} of {role} in the "
                   f"other {n} layer{'s' if n > 1 else ''} (sibling limit {ratio:g}x)")
            if r["verdict"] == "fail":
                r["reason"] = f"{r['reason']}; {why}"
            else:
                r.update(verdict="fail", code=SIBLING_OUTLIER, reason=why)


def badness(row: dict[str, Any]) -> float:
    """How far a compared tensor is from its twin: the relative Euclidean distance (NaN: worst)."""
    v = row.get("relative_euclidean_distance")
    if v is None:
        g, d = row.get("l2_distance"), row.get("cosine_similarity")
        v = (1 - d) if isinstance(d, (int, float)) else g
    try:
        v = float(v)
    except (TypeError, ValueError):
        return math.inf
    return math.inf if math.isnan(v) else v


def rank_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compared tensors worst first, then the tensors that could not be compared, by name."""
    severity = {"fail": 0, "warn": 1, "pass": 2}
    compared = [r for r in rows if r["status"] == "compared"]
    others = [r for r in rows if r["status"] != "compared"]
    compared.sort(key=lambda r: (severity.get(r["verdict"], 0), -badness(r)))
    others.sort(key=lambda r: (r["status"], r["name"]))
    return compared + others


def weight_summary(rows: list[dict[str, Any]], companions: int) -> WeightCompareBlock:
    """The ``weight_compare`` block of summary.json."""
    counts: dict[str, int] = {"tensors": len(rows), "companion_tensors": companions}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        if r["status"] == "compared":
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    worst = next((r for r in rows if r["status"] == "compared"), None)
    keep = ("name", "verdict", "cosine_similarity", "relative_euclidean_distance", "max_absolute_error",
            "quant_type", "scheme", "sibling_score", "reason")
    return WeightCompareBlock(
        counts=counts, worst=WorstWeight(**{k: worst.get(k) for k in keep}) if worst else None,
        problems=[WeightProblem(name=r["name"], status=r["status"], reason=r["reason"])
                  for r in rows if r["status"] != "compared"][:50])
