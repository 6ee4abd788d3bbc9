"""From the evidence to a verdict: fault, pass or inconclusive, and the words that say so.

A module whose own error stands out is a fault (``fail``), whatever else is missing. Otherwise the
verdict is ``pass`` only when the evidence covers the question: every module replayed at the step
where the divergence starts, the dumps whole, no logits failing before the texts part. Anything
less is ``inconclusive``, with the reason and what to run next; it never says "matches" or
"rounding" on no evidence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from llmflow.compare.align import steps_text
from llmflow.compare.codes import Code
from llmflow.compare.thresholds import coarser, finite_or_none
from llmflow.dtypes import DEFAULT_THRESHOLDS, OP_ERROR_FLOOR, dtype_class
from llmflow.localize.dtype_baseline import OnDemand
from llmflow.localize.own_error import whole_rel
from llmflow.localize.quantized_words import (
    EXPLAINED_REASON,
    expert_linear_clause,
    explained_sentence,
    most_sensitive,
    quantization_explained,
    quantization_of,
    quantization_spread,
    quantized_sentences,
    stored_name,
)
from llmflow.quantized import WEIGHT_ROUNDING_LIMIT
from llmflow.results.codec import from_json
from llmflow.results.verdict import (
    Candidate,
    DtypeBaseline,
    Evidence,
    ExpertLinearRow,
    ExpertRow,
    HandedDown,
    Inconclusive,
    OpLevel,
    OpRow,
    Overflow,
    OverflowOp,
    OwnErrorSteps,
    ReplayInfo,
    RoutingRow,
    ScanOrigin,
    SideText,
    TeacherForced,
    Texts,
    TokenDetail,
    TokenRow,
    Verdict,
)
from llmflow.structure import LayerStack, layer_index, layer_of, module_type

#: the suffix of a ranked row measuring what an attention wrote into its KV cache at a decode step
KV_CACHE = "/kv_cache"
CURVE_METRICS = {"rel_l2": "relative L2 error", "cos_dist": "cosine distance (1 - cos)",
                 "max_rel": "max abs error / max |golden|"}


@dataclass
class StepReplay:
    """The isolation replay of one step: its rows, ranking and candidate, and the golden source."""

    step: int
    why: str
    raw: dict[str, dict[str, float]] = field(default_factory=dict)
    source: str = ""
    rows: list[dict[str, Any]] = field(default_factory=list)
    ranked: list[dict[str, Any]] = field(default_factory=list)
    candidate: dict[str, Any] | None = None
    call_of: Callable[[str], Any] | None = None
    rerun_diff: float | None = None
    missing: str | None = None  # why this step could not be replayed (at all, or inside the layers)
    missing_next: str | None = None  # what to give or run next for it, where not the usual
    routing: list[RoutingRow] = field(default_factory=list)
    op_rows: list[OpRow] = field(default_factory=list)
    first_op: str | None = None
    experts: list[ExpertRow] = field(default_factory=list)
    expert: int | None = None
    # a quantized checkpoint's experts: each expert's Linear layers alone (``moe.expert_linear_errors``),
    # and the named expert's Linear layer that stands out (``moe.worst_expert_linear``)
    expert_linears: list[ExpertLinearRow] = field(default_factory=list)
    expert_linear: ExpertLinearRow | None = None
    op_level: OpLevel | None = None  # ops.comparability of the chosen module's two op sequences
    overflow_op: OverflowOp | None = None  # ops.overflow_detail of the op where an overflow starts
    # a quantized Linear layer's account of the chosen module's golden input (clipping, scales)
    quant_detail: str | None = None
    # isolation from the target dump: each decoder layer's own error, the layer replayed whole
    layer_errors: dict[str, float] = field(default_factory=dict)
    # the same layers' own error against what each adds to the residual stream alone
    # (``own_error.update_errors``): a layer stands out only where it does here too
    layer_update_errors: dict[str, float] = field(default_factory=dict)
    # the error one correct op shows in the coarser of the two sides' dtypes (the ranking's
    # ``op_floor``): the least "the other layers' typical error" is taken to be, so one layer off
    # where every other layer matches to the bit (0) still stands out
    op_floor: float = 0.0
    # isolation from the target dump: why the code before or after the decoder layers, which the
    # dumps do not hold, was not replayed (``target_dump.outside_layer_rows``)
    ends_not_replayed: list[str] = field(default_factory=list)
    # candidates set aside: standing out from their peers by no more than the golden module's own
    # rounding in the target's dtype (``rounding.py``), each with its ``rounding_ratio``
    rounding: list[dict[str, Any]] = field(default_factory=list)
    # candidates set aside: a quantized checkpoint's Linear layers whose own error their quantization
    # explains (``quantized.QuantAccount``, under ``account``, with ``detail``: their ``explain``), and
    # the modules holding them that carry that error and nothing more (``account`` None)
    quantization: list[dict[str, Any]] = field(default_factory=list)

    @property
    def replayed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("replayable")]

    @property
    def cache_writes(self) -> list[dict[str, Any]]:
        """What each replayed attention wrote into its KV cache, as a row of its own (``KV_CACHE``),
        ranked and judged like a module."""
        return [{"name": f"{r['name']}{KV_CACHE}", "module_type": "kv cache write", "replayable": True,
                 "rel_l2": r["kv_cache_rel_l2"]}
                for r in self.replayed if r.get("kv_cache_rel_l2") is not None]

    @property
    def not_replayable(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if not r.get("replayable")]

    @property
    def anomalous(self) -> bool:
        return bool(self.candidate and self.candidate.get("anomalous"))


#: a decoder layer replayed whole stands out at this many times the ranking's ratio_threshold: its
#: own error is the residual stream's too, so clean layers spread wider (up to ~4x their median on
#: the tiny families) than a module's
LAYER_STANDOUT = 2.0


#: where nothing fails (the same tokens, every step's logits and every compare row within their
#: thresholds), a module standing out by less than this many times the ratio_threshold is taken as
#: rounding: a median of few peers (a tiny model's 3 other layers) spreads that far on a clean port
QUIET_STANDOUT = 2.0
#: the same for a quantized checkpoint's Linear layer: its own error is its quantization's, and an
#: honest layer with activation outliers stands out that far (6x on tiny Llama and Qwen2 checkpoints
#: of msModelSlim, alike in fp32, fp16 and bf16) where a calibration that clips stands out at 13-14x
QUIET_QUANTIZED_STANDOUT = 3.0


def _is_quantized(cand: dict[str, Any] | None, quantized: dict[str, str] | None) -> bool:
    return bool(cand and quantization_of(cand.get("name"), quantized))


def quiet_limit(inp: Any, cand: dict[str, Any] | None, quantized: dict[str, str] | None = None) -> float:
    """The score under which ``cand`` standing out is not called a fault where nothing fails."""
    quant = _is_quantized(cand, quantized)
    return (QUIET_QUANTIZED_STANDOUT if quant else QUIET_STANDOUT) * inp.ratio_threshold


def below_notice(inp: Any, cand: dict[str, Any] | None, mismatch: int | None, bad_token: int | None,
                 quantized: dict[str, str] | None = None) -> bool:
    """Whether a standing-out candidate is too weak to call a fault where nothing else fails: the
    texts agree, no step's logits fail, and the compare ran with no failing row (``inp``'s
    ``compare_first_fail`` empty; None: no compare, so nothing says the rows pass). ``quantized``:
    a quantized target's Linear layers, whose limit is ``QUIET_QUANTIZED_STANDOUT``."""
    if cand is None or mismatch is not None or bad_token is not None or cand.get("overflow"):
        return False
    if getattr(inp, "compare_first_fail", None) != {}:
        return False
    if _weight_wrong(cand, quantized):
        return False
    score = cand.get("score")
    return isinstance(score, (int, float)) and score < quiet_limit(inp, cand, quantized)


def _weight_wrong(cand: dict[str, Any] | None, quantized: dict[str, str] | None) -> bool:
    """Whether ``cand``, a quantized Linear layer, errs beyond its activation quantization by
    ``WEIGHT_ROUNDING_LIMIT`` times what int8 rounding of its weight gives (``weight_ratio``): a
    weight, scale or bias that is wrong, never the quantization's own, however little it stands out."""
    ratio = (cand or {}).get("weight_ratio")
    return (_is_quantized(cand, quantized) and isinstance(ratio, (int, float))
            and ratio >= WEIGHT_ROUNDING_LIMIT)


def layer_fault(step: StepReplay, ratio_threshold: float) -> str | None:
    """The decoder layer whose own code is the fault: the target's layer, replayed whole on the
    golden inputs, stands out where none of its modules does. From a target dump that is only a
    lead (the golden module runs on the target's recorded inputs, after its pre-hooks): None."""
    if step.anomalous or step.source == "target dump":
        return None
    between = _layer_standing_out(step, LAYER_STANDOUT * ratio_threshold)
    return between[0] if between else None


def stands_out(step: StepReplay, ratio_threshold: float) -> bool:
    """Did the step's replay find something: a module standing out, or a decoder layer replayed
    whole standing out where none of its modules does (a fault from the target model, a lead from
    a target dump: either is the step the verdict must speak of, never a quiet one)."""
    return step.anomalous or _layer_standing_out(step, LAYER_STANDOUT * ratio_threshold) is not None


def _layer_standing_out(step: StepReplay, ratio: float) -> tuple[str, float] | None:
    """The decoder layer whose own error (``layer_errors``) is ``ratio`` times the median of the
    other layers' or more, with that ratio (the largest), and where it is known, its error against
    its update alone (``layer_update_errors``) as well; None where none is."""
    worst: tuple[str, float] | None = None
    update_ratios = _ratios_to_others(step.layer_update_errors, step.op_floor)
    for name, r in _ratios_to_others(step.layer_errors, step.op_floor).items():
        if r >= ratio and update_ratios.get(name, r) >= ratio and (worst is None or r > worst[1]):
            worst = (name, r)
    return worst


def _ratios_to_others(errors: dict[str, float], floor: float = 0.0) -> dict[str, float]:
    """Each finite error over the median of the others' or ``floor``, the larger (where that is
    above 0)."""
    finite = {n: e for n, e in errors.items() if e is not None and math.isfinite(e)}
    out: dict[str, float] = {}
    for name, error in finite.items():
        others = [e for n, e in finite.items() if n != name]
        typical = max(median(others) if others else 0.0, floor)
        if typical > 0:
            out[name] = error / typical
    return out


#: a module type's median own error over its layers at this many times the typical module type's
#: (the median of the types' medians) stands out among the types: with the error beyond what the
#: dtype's rounding gives a whole tensor, a fault every layer shares (a kernel, scale or weight
#: conversion each layer's copy uses), which no ranking against the other layers can show
SHARED_RATIO = 10.0
#: what an attention writes into its KV cache is what its projections computed (and the rotary
#: turned), so in a correct port its own error is theirs, about one op's rounding (1.2-1.4x the
#: typical module type's on tiny models of 9 families, bf16 against fp32); a cache stored in a
#: lower precision (fp8 or int8 KV cache quantization), a wrong scale or a wrong position shows at
#: many times that (8.7-10.9x for an fp8 cache), yet under the whole-tensor limits the other types
#: are judged by. Its copies are shared-faulty at this many times the typical module type's own
#: error and at least KV_WRITE_FLOORS x the dtype's OP_ERROR_FLOOR.
KV_WRITE_RATIO = 4.0
KV_WRITE_FLOORS = 4.0


@dataclass
class SharedError:
    """A module type whose own error is beyond the dtype's rounding in its copies alike (every
    layer's, or most: the median copy is)."""

    module_type: str  # model.layers.*.self_attn.o_proj
    example: str  # its first copy past the limit, named as the verdict's module
    error: float  # the median own error (relative L2) of its copies past the limit
    layers: int  # copies replayed
    typical: float | None  # the median of every module type's median; None: too few types to say
    limit: str  # the dtype's limit the error passes: "fail" or "warn"
    limit_value: float
    faulty: list[str] = field(default_factory=list)  # the copies past the limit, in layer order
    kv_cache: bool = False  # the error is of what the copies write into their KV cache (KV_CACHE)

    def where(self) -> str:
        """"in every layer", or in which of them."""
        if len(self.faulty) >= self.layers:
            return "in every layer"
        return (f"in {len(self.faulty)} of {self.layers} layers ("
                + ", ".join(self.faulty[:4]) + (", ..." if len(self.faulty) > 4 else "") + ")")

    @property
    def fails(self) -> bool:
        """A fault: past the fail limit and standing out among the module types. With too few types
        to say (a dump of the decoder layers alone), or every type beyond rounding, a golden model
        that is not the one that made the golden dump looks the same: never called a fault."""
        return self.limit == "fail" and self.typical is not None

    def ratio_words(self) -> str:
        if self.typical is None:
            return ""
        if self.typical == 0:
            return ", where the typical module type has none"
        return f", {self.error / self.typical:.0f}x the {self.typical:.2g} of the typical module type"

    def limit_words(self, dtype: str) -> str:
        """The limit the error is past, in words with its value."""
        if self.kv_cache:
            return (f"{KV_WRITE_FLOORS:g}x the rounding of one {dtype} op ({self.limit_value:g}), where a "
                    "correct cache write carries its projections' rounding")
        return f"the {self.limit} limit of {dtype} rounding for a whole tensor ({self.limit_value:g})"

    def same_as(self, other: SharedError | None) -> bool:
        return other is not None and (other.module_type, other.kv_cache) == (self.module_type, self.kv_cache)


#: a candidate whose tokens' mean relative error is this many times its whole output's is said to
#: err per token (``own_error``: a few tokens of large output carry the whole output's norm)
PER_TOKEN_SAID = 3.0


#: the median token error the tokens an expert does not reach are floored at (fp32's op rounding):
#: bit-exact other tokens do not make any error of its own tokens a fault of its own
REST_FLOOR = 1e-6


def expert_of_tokens(cand: dict[str, Any]) -> int | None:
    """The expert of a fused experts module whose tokens carry its error (``moe.add_expert_error``):
    their mean relative error ``PER_TOKEN_SAID`` times the average token's, or their median that
    many times the median of the tokens it does not reach (an expert that top-2 of 4 routing sends
    half the tokens to lifts the average to half its own; a median, as one bad token that every
    expert it reaches shares is no expert's fault); None where none does."""
    token, expert = cand.get("token_rel"), cand.get("expert_rel")
    median_, rest = cand.get("expert_median_rel"), cand.get("expert_rest_rel")
    if not isinstance(expert, float) or expert <= 0:
        return None
    if (isinstance(token, float) and expert >= PER_TOKEN_SAID * token) or (
            isinstance(median_, float) and isinstance(rest, float)
            and median_ >= PER_TOKEN_SAID * max(rest, REST_FLOOR)):
        return cand.get("expert_worst")
    return None


def _per_token_sentence(cand: dict[str, Any], expert_named: int | None = None) -> str:
    """Where the module's error is in most of its tokens yet small over its whole output, why the
    two differ (and why the compare's rows of its output may look fine); where it is in one
    expert's tokens, which (said only where the expert the verdict names, ``expert_named``, is
    that one or none is named)."""
    token, whole, expert = cand.get("token_rel"), whole_rel(cand), cand.get("expert_rel")
    routed, prefill = expert_of_tokens(cand), cand.get("prefill_expert")
    if routed is None and prefill is not None and expert_named in (None, prefill):
        return (f" At the prefill its error is in the tokens routed to expert {prefill}; at this step "
                "its tokens are too few to tell its experts apart (each reaches its top-k experts alike).")
    if routed is not None and expert_named in (None, routed):
        rest = cand.get("expert_rest_rel")
        others = [f"the other tokens' {rest:.2g} at the median"] if isinstance(rest, float) else []
        others += [f"the average token's {token:.2g}"] if isinstance(token, float) else []
        return (f" Its error is in the tokens routed to expert {routed}: their outputs are "
                f"{expert:.2g} off on average, {', '.join(others)} (an expert that few "
                "tokens reach moves the output as a whole little).")
    if not isinstance(token, float) or whole is None or token < PER_TOKEN_SAID * whole:
        return ""
    return (f" Its error is in its tokens: the average token's output is {token:.2g} off, while its output "
            f"as a whole is only {whole:.2g} off, being carried by a few tokens of far larger output that it "
            "gets right (a scale or reduction shared by the whole tensor and set by those tokens does this).")


def shared_error(step: StepReplay, stack: LayerStack | None, dtype: str) -> SharedError | None:
    """The module type whose median copy over the layers has an own error beyond the target dtype's
    limits for a whole tensor (``DEFAULT_THRESHOLDS``' relative Euclidean distance, loose: a whole
    tensor carries the rounding of every op before it, one module's own error far less) and
    ``SHARED_RATIO`` times the typical module type's, or None; what the attentions write into their
    KV caches by the tighter ``KV_WRITE_RATIO`` and ``KV_WRITE_FLOORS``. Of types that nest (an
    o_proj inside its self_attn) with errors within 2x of the worst, the innermost. Copies set aside
    as the golden module's own rounding (``step.rounding``) are left out."""
    limits = DEFAULT_THRESHOLDS.get(dtype_class(dtype), {}).get("relative_euclidean_distance")
    # copies whose error is the golden module's own rounding in the target's dtype (``rounding.py``)
    # are no fault of the port's, shared or not
    rounding = {r["name"] for r in step.rounding}
    by_type = {t: finite for t, copies in _errors_by_type(step.replayed + step.cache_writes, stack).items()
               if (finite := [(n, e) for n, e in copies
                              if finite_or_none(e) is not None and n not in rounding])}
    if not limits or not by_type:
        return None
    medians = {t: median(e for _, e in copies) for t, copies in by_type.items()}
    modules = [m for t, m in medians.items() if not t.endswith(KV_CACHE)]
    typical = median(modules) if len(modules) >= 3 else None
    if typical is not None and typical >= limits["warn"]:
        typical = None  # the typical module is beyond rounding too: no type stands out, none is a fault
    kv_floor = KV_WRITE_FLOORS * OP_ERROR_FLOOR.get(dtype_class(dtype), 0.0)

    def floor(t: str) -> float:
        """The own error past which a copy of type ``t`` is off beyond rounding."""
        if t.endswith(KV_CACHE):
            return max(kv_floor, KV_WRITE_RATIO * typical if typical is not None else 0.0)
        return max(limits["warn"], SHARED_RATIO * typical if typical is not None else 0.0)

    shared = {t: m for t, m in medians.items() if len(by_type[t]) >= 2 and m >= floor(t) > 0}
    if not shared:
        return None
    top = max(shared.values())
    kind = max((t for t, m in shared.items() if m * 2 >= top), key=lambda t: (t.count("."), shared[t]))
    copies = sorted(by_type[kind], key=lambda c: (layer_index(c[0], stack) or 0, c[0]))
    # the copies past the limit: a clean copy among them (one layer spared) is never the one named
    faulty = [n.removesuffix(KV_CACHE) for n, e in copies if e >= floor(kind)]
    error = median(e for _, e in copies if e >= floor(kind))
    if kind.endswith(KV_CACHE):
        limit, limit_value = "fail", kv_floor
    else:
        limit = "fail" if error >= limits["fail"] else "warn"
        limit_value = limits[limit]
    return SharedError(kind.removesuffix(KV_CACHE), faulty[0], error, len(copies), typical, limit,
                       limit_value, faulty, kv_cache=kind.endswith(KV_CACHE))


def _reasons(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(str(r.get("reason")), []).append(r["name"])
    return out


def _curves(raw: dict[str, dict[str, float]], iso_rows: list[dict[str, Any]],
            stack: LayerStack | None) -> dict[str, Any]:
    curves: dict[str, Any] = {}
    for key, label in CURVE_METRICS.items():
        raw_s: dict[int, float] = {}
        iso: dict[int, float] = {}
        for name, m in raw.items():
            idx = layer_index(name, stack)
            if idx is not None and layer_of(name, stack) == name:
                raw_s[idx] = m[key]
        for r in iso_rows:
            idx = layer_index(r["name"], stack)
            if idx is not None and r.get(key) is not None:
                iso[idx] = max(iso.get(idx, 0.0), r[key])
        series = {"raw (layer output, dumps)": raw_s, "isolated (worst module, replay)": iso}
        curves[label] = {k: {str(x): y for x, y in sorted(v.items())} for k, v in series.items()}
    return curves


def _errors_by_type(rows: list[dict[str, Any]], stack: LayerStack | None) -> dict[str, list[tuple[str, Any]]]:
    """Module type -> (name, own error) of each row that has one, in row order."""
    by_type: dict[str, list[tuple[str, Any]]] = {}
    for r in rows:
        if r.get("rel_l2") is not None:
            by_type.setdefault(module_type(r["name"], stack), []).append((r["name"], r["rel_l2"]))
    return by_type


def _noisiest_types(rows: list[dict[str, Any]], stack: LayerStack | None, n: int = 3) -> str:
    """The module types with the largest median own error: where the dtype's rounding bites."""
    by_type = _errors_by_type(rows, stack)
    top = sorted(((median(e for _, e in v), k) for k, v in by_type.items()), reverse=True)[:n]
    return ", ".join(f"{k} {m:.2g}" for m, k in top)


def _step_word(step: int) -> str:
    return "the prefill (step 0)" if step == 0 else f"decode step {step}"


#: what a ranked row (``rank.rank_modules``) carries into the verdict's candidates
CANDIDATE_FIELDS = ("rank", "name", "module_type", "layer", "error", "typical", "score", "z", "anomalous",
                    "max_abs", "cos_dist", "replayable", "reason", "routing", "own_routing_rel_l2",
                    "overflow", "nonfinite", "sharding", "rank_errors", "shard_rank", "rank_note",
                    "rank_source", "source", "covers", "token_rel", "expert_rel", "expert_worst",
                    "expert_median_rel", "expert_rest_rel", "prefill_expert", "weight_expert",
                    "rounding_ratio", "weight_ratio")


def conclude(inp: Any, tried: list[StepReplay], chosen: StepReplay, *, rows: list[TokenRow],
             mismatch: int | None, bad_token: int | None, stack: LayerStack | None,
             decode: Callable[[int], str], dtype: str, device: str, problems: list[str],
             note: str | None = None, own_steps: OwnErrorSteps | None = None,
             quantized: dict[str, str] | None = None, quantized_names: dict[str, str] | None = None,
             compute_dtype: str | None = None, handed_down: HandedDown | None = None,
             dumps_as_specs: bool = False,
             dtype_baseline: Callable[[], DtypeBaseline | None] | None = None,
             teacher_forced: TeacherForced | None = None) -> Verdict:
    """The verdict of a bisect from what each replayed step showed (and, where measured, the chosen
    module's own error per step). ``quantized``: the target's quantized Linear layers and their
    weight types (an msModelSlim checkpoint), whose error is the quantization's own;
    ``quantized_names``: their names in the checkpoint where those differ (what msModelSlim's
    ``disable_names`` takes). ``dtype`` judges (its thresholds, its rounding in words);
    ``compute_dtype`` (default: ``dtype``) is the one the target ran in, which differs for a
    quantized target (judged at ``w8a8``). ``handed_down``: a module handed a keyword input changed
    (``handed_down.py``), the fault where nothing else is named. ``dumps_as_specs``: the dumps were
    made as the two specs say (the bisect's ``dumps_made_as_specs``), so a target spec that is the
    golden's in a coarser dtype (``golden_in_another_dtype``) speaks for the target dump.
    ``dtype_baseline``: measures the golden model itself in the target's dtype (``dtype_baseline.py``),
    called only where the logits fail and nothing else explains it. ``teacher_forced``: the target's
    logits on the golden's tokens after the step where the texts part (``TeacherForced``)."""
    cand = chosen.candidate
    # the golden model in the target's dtype explains finite logits only: not NaN/Inf nor an overflow
    drift_possible = (not any(r.code in _NOT_DRIFT for r in rows) and _overflow_scan_origin(inp) is None)
    baseline = OnDemand(dtype_baseline if drift_possible else None)
    module = _standing_out(chosen)
    quiet = module is not None and below_notice(inp, cand, mismatch, bad_token, quantized)
    if (module is not None and not quiet and cand is not None and teacher_forced is not None
            and teacher_forced.first_fail is None and chosen.step == teacher_forced.furthest):
        # a step replayed only because its logits, on the golden's tokens, are furthest from the
        # golden's while within the thresholds: held to the bar of a run where nothing fails
        score = cand.get("score")
        quiet = (isinstance(score, (int, float)) and score < quiet_limit(inp, cand, quantized)
                 and not _weight_wrong(cand, quantized))
    if quiet and cand is not None:  # a lead too weak to name where every output is within its thresholds
        cand["anomalous"] = False
        module = None
    # the hidden states entering the first layer, from dumps without the token ids: a lead only
    lead = cand if module and cand and cand.get("inputs_unverified") else None
    if lead is not None:
        module = None
    expert = chosen.expert if module else None
    if module and cand and expert is None and not chosen.experts:  # no per-expert replay (a target dump):
        # the expert whose weight rows differ (expert parallel, weights dumped), else whose routed
        # tokens carry the module's error
        expert = cand.get("weight_expert")
        expert = expert if expert is not None else expert_of_tokens(cand)
        expert = expert if expert is not None else cand.get("prefill_expert")
    shard_rank = cand.get("shard_rank") if module and cand else None
    if module is None:
        module = layer_fault(chosen, inp.ratio_threshold)
    shared = shared_error(chosen, stack, dtype) if lead is None else None
    if module is not None and not (shared is not None and shared.fails and shared.kv_cache
                                   and module_type(module, stack) == shared.module_type):
        shared = None  # a module stands out; but a cache every layer writes wrong is said as such
    if shared is not None and shared.fails:  # the layers' copies are the fault: named by the first faulty
        module = shared.example
    # a tensor-parallel module whose ranks kept their partial products: the first such is the fault,
    # whatever stands out after it (the modules after it see another input on each rank)
    unreduced = next((r for r in chosen.replayed if r.get("unreduced") is not None), None)
    if unreduced is not None and lead is None:
        module, expert, shard_rank, shared = unreduced["name"], None, None, None
    # a side input changed on its way into a module: the fault where nothing else is named
    handed = handed_down if module is None and lead is None and unreduced is None else None
    if handed is not None:
        module, shared = handed.module, None
    layer = layer_of(module, stack) if module else None
    detail = _token_detail(inp, mismatch, rows, decode)
    replay = ReplayInfo(step=chosen.step, why=chosen.why, source=chosen.source,
                        replayed=len(chosen.replayed), not_replayable=len(chosen.not_replayable),
                        reasons=_reasons(chosen.not_replayable), steps_tried=[t.step for t in tried],
                        ratio_threshold=inp.ratio_threshold, device=device, dtype=compute_dtype or dtype,
                        golden_rerun_max_abs_diff=chosen.rerun_diff)
    routing = [r for t in tried for r in t.routing]
    if lead is not None:
        status, headline, diagnosis, why_not = _head_lead(lead, chosen.step)
    elif unreduced is not None:
        status, headline, diagnosis, why_not = _unreduced_fault(unreduced, chosen.step)
        cand = None  # the ranked candidate's rank notes are not this module's
    elif handed is not None:
        status, headline, diagnosis, why_not = _handed_down_fault(handed, tried)
        cand = None
    else:
        status, headline, diagnosis, why_not = _judge(inp, tried, chosen, module, expert, mismatch, bad_token,
                                                      problems, routing, stack, dtype, shared, own_steps,
                                                      quiet=quiet, quantized=quantized or {},
                                                      stored=stored_name(quantized_names),
                                                      dtype_drift=_dtype_drift(inp, rows, bad_token,
                                                                               dumps_as_specs),
                                                      baseline=baseline, forced=teacher_forced)
    if module and cand and shard_rank is not None:
        errors = ", ".join(f"rank {r}: {e:.3g}" for r, e in enumerate(cand.get("rank_errors") or []))
        if cand.get("rank_source"):  # its output is one sum over the ranks: the weights told
            rows_of = (f" in expert {cand['weight_expert']}'s rows" if cand.get("weight_expert") is not None
                       else "")
            diagnosis += (f" Of the ranks it is sharded over, rank {shard_rank}'s shard differs from its "
                          f"slice of the golden's weight{rows_of} ({errors}; from {cand['rank_source']}).")
        else:
            diagnosis += (f" Of the ranks it is sharded over, rank {shard_rank}'s shard has the error of its "
                          f"own ({errors}).")
    elif module and cand and cand.get("rank_note"):
        diagnosis += f" No rank is named: {cand['rank_note']}."
    if handed_down is not None and handed is None:  # found, but something else is named: said too
        what = handed_down.input.removeprefix("kw:")
        diagnosis += (f" Also, {handed_down.module} is handed a changed {what} at "
                      f"{_step_word(handed_down.step)}: not the one {handed_down.enclosing} was given.")
    if chosen.rounding:
        diagnosis += " " + _rounding_sentence(chosen.rounding, compute_dtype or dtype)
    if chosen.quantization and not (why_not and why_not.reason.startswith(EXPLAINED_REASON)):
        diagnosis += " " + explained_sentence(chosen.quantization, stored_name(quantized_names))
    diagnosis += _token_sentence(mismatch, detail)
    if note:
        diagnosis += f" {note}"
    top = [Candidate(**{k: r.get(k) for k in CANDIDATE_FIELDS if r.get(k) is not None},
                     raw_rel_l2=chosen.raw.get(r["name"], {}).get("rel_l2"), whole_rel=whole_rel(r))
           for r in chosen.ranked if r.get("score") is not None][: inp.top_k]
    unrep = [Candidate(name=r["name"], replayable=False, reason=r.get("reason"),
                       raw_rel_l2=chosen.raw.get(r["name"], {}).get("rel_l2")) for r in chosen.not_replayable]
    return Verdict(
        status=status, headline=headline, diagnosis=diagnosis, replay=replay,
        first_mismatch_token=mismatch, first_bad_token=bad_token, first_bad_layer=layer,
        first_bad_module=module, first_bad_op=chosen.first_op if module and unreduced is None and (
            module != getattr(shared, "example", None) or module == _standing_out(chosen)) else None,
        first_bad_expert=expert, first_bad_rank=shard_rank, inconclusive=why_not, token_detail=detail,
        evidence=[Evidence(name=c.name, isolated_rel_l2=c.error, typical=c.typical, score=c.score,
                           raw_rel_l2=c.raw_rel_l2, step=chosen.step) for c in top[:5]],
        texts=Texts(**{side: SideText(label=_side_label(inp, side, spec),
                                      text="".join(decode(i) for i in ids), tokens=[decode(i) for i in ids])
                       for side, spec, ids in (("golden", inp.golden_spec, inp.golden_ids),
                                               ("target", inp.target_spec, inp.target_ids))}),
        curves=_curves(chosen.raw, chosen.replayed, stack),
        candidates=top + unrep[:50],
        ops=chosen.op_rows, experts=chosen.experts, expert_linears=chosen.expert_linears, routing=routing,
        token_rows=rows,
        problems=problems, notes=[note] if note else [],
        overflow=overflow_evidence(inp, chosen, module), op_level=chosen.op_level, handed_down=handed_down,
        dtype_baseline=baseline.value, teacher_forced=teacher_forced)


def _side_label(inp: Any, side: str, spec: dict[str, Any] | None) -> str:
    """The model a side ran (its spec), or, for a target known only by its dump, the dump."""
    if not spec:
        return f"{side} dump {getattr(inp, f'{side}_dump', '')}"
    return (f"{spec.get('model')} {spec.get('dtype')} {spec.get('device')}"
            + (f" patch={spec['patch']}" if spec.get("patch") else ""))


def _token_detail(inp: Any, mismatch: int | None, rows: list[TokenRow],
                  decode: Callable[[int], str]) -> TokenDetail:
    """Both sides' tokens at the first mismatch and how close the golden's choice was there."""
    if mismatch is None:
        return TokenDetail()
    g = inp.golden_ids[mismatch] if mismatch < len(inp.golden_ids) else None
    t = inp.target_ids[mismatch] if mismatch < len(inp.target_ids) else None
    at = next((r for r in rows if r.step == mismatch), None)
    return TokenDetail(step=mismatch, golden_token=decode(g) if g is not None else None,
                       target_token=decode(t) if t is not None else None, golden_id=g, target_id=t,
                       golden_margin=at.golden_margin if at else None, kl=at.kl if at else None,
                       logits_max_abs_error=at.max_absolute_error if at else None)


def _overflow_scan_origin(inp: Any) -> ScanOrigin | None:
    """The target dump's overflow-scan origin of a non-finite value (None: no scan, or none found)."""
    scan = getattr(inp, "overflow_scan", None) or {}
    origin = scan.get("first_origin")
    if not origin or origin.get("kind") not in ("nan", "inf"):
        return None
    known = {f: origin[f] for f in ScanOrigin.__dataclass_fields__ if f in origin}
    return from_json(ScanOrigin, known, where="overflow_report: first_origin")


def _scan_sentence(origin: ScanOrigin) -> str:
    return (f"the overflow scan of the target dump finds the first {origin.kind} in {origin.name} "
            f"at step {origin.step}")


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".") or a.startswith(b + "/")


def overflow_evidence(inp: Any, chosen: StepReplay, module: str | None) -> Overflow:
    """The verdict's ``overflow`` block: the modules whose replay overflows (execution order),
    their layers, the op where the blamed one starts, and the overflow scan's origin with whether
    it agrees (same module, an ancestor or a descendant)."""
    rows = [r for r in chosen.ranked if r.get("overflow")]
    origin = _overflow_scan_origin(inp)
    return Overflow(
        modules=[r["name"] for r in rows],
        layers=list(dict.fromkeys(r["layer"] for r in rows if r.get("layer"))),
        nonfinite={r["name"]: r.get("nonfinite") for r in rows},
        op=chosen.overflow_op,
        scan_origin=origin,
        scan_agrees=(_related(origin.name, module) if origin and module else None),
    )


#: why the code before the first decoder layer is a lead, not a finding, from dumps of the layers
HEAD_UNVERIFIED = ("the dumps do not record the token ids, so a run given other ids (another prompt, "
                   "chat template or BOS token) looks the same")


def _head_lead(lead: dict[str, Any], step: int) -> tuple[str, str, str, Inconclusive]:
    """Inconclusive, pointing at the code before the first decoder layer (``lead``: the row of the
    hidden states entering it, golden against target, from dumps that lack the token ids)."""
    reason = (f"the hidden states entering the first decoder layer differ from the golden's, "
              f"{lead['score']:.0f}x the median own error of the model's modules at {_step_word(step)}: "
              f"the embedding ({lead['name']}) or the model's code before the first decoder layer is the "
              f"likely fault, but {HEAD_UNVERIFIED}")
    nxt = (f"check that both runs read the same token ids, or dump both sides with {lead['name']} too "
           "(module mode with its inputs and output) and bisect again")
    diagnosis = (f"No module inside the decoder layers stands out; {reason}. Inconclusive: the evidence "
                 "points at the embedding without proving it.")
    return "inconclusive", reason, diagnosis, Inconclusive(reason, nxt)


def _unreduced_fault(row: dict[str, Any], step: int) -> tuple[str, str, str, None]:
    """The verdict's words for a module whose ranks kept their partial products (``unreduced``,
    ``target_dump.UNREDUCED_MATCH``)."""
    name, where = row["name"], _step_word(step)
    errors = ", ".join(f"rank {r}: {e:.3g}" for r, e in enumerate(row.get("rank_errors") or []))
    headline = (f"{name} is the fault: the all-reduce of its output is missing at {where}; its ranks' "
                f"outputs differ and their sum matches the golden's (relative L2 {row['unreduced']:.2g})")
    diagnosis = (f"{name} is the fault: its inputs are the same on every rank, yet its output, which an "
                 f"all-reduce makes the same on every rank, differs between them at {where}, each far from "
                 f"the golden module's on those inputs ({errors}); summed over the ranks it matches the "
                 f"golden's (relative L2 {row['unreduced']:.3g}). Each rank kept its partial product: the "
                 "all-reduce of the row-parallel linear inside it, or right after it, is missing or skipped. "
                 "The modules after it see another input on each rank, so what stands out there is not their "
                 "own error.")
    return "fail", headline, diagnosis, None


def _handed_down_fault(found: HandedDown, tried: list[StepReplay]) -> tuple[str, str, str, None]:
    """The verdict's words for a module handed a keyword input unlike its enclosing module's."""
    where = _step_word(found.step) + (f", rank {found.rank}" if found.rank else "")
    what = found.input.removeprefix("kw:")
    if found.difference is None:
        how = "its size or non-finite values changed"
    elif found.limit == 0.0:
        how = f"{found.difference:.0%} of its elements changed"
    else:
        how = f"relative difference {found.difference:.3g}"
    steps = " and ".join(_step_word(t.step) for t in tried)
    headline = (f"{found.module} is handed a changed {what}: not the one {found.enclosing} was given, at "
                f"{where} ({how}); the golden's passes it on unchanged")
    diagnosis = (f"{found.module} is where the fault enters: at {where} the target hands it the keyword "
                 f"input {what} changed from the one {found.enclosing} was given ({how}"
                 + (f", beyond the {found.limit:.2g} a cast on the way gives" if found.limit else "")
                 + f"), where the golden hands it on unchanged. What changes it is {found.enclosing}'s own "
                 f"code or a hook or wrapper around {found.module}: an off-by-one position, a mask cut at "
                 f"the wrong window, a cache position of another step. Replayed at {steps}, no module's own "
                 "error stands out: a module replayed on its recorded inputs is given the changed input too.")
    return "fail", headline, diagnosis, None


def _judge(inp: Any, tried: list[StepReplay], chosen: StepReplay, module: str | None, expert: int | None,
           mismatch: int | None, bad_token: int | None, problems: list[str], routing: list[RoutingRow],
           stack: LayerStack | None, dtype: str,
           shared: SharedError | None = None, own_steps: OwnErrorSteps | None = None,
           quiet: bool = False, quantized: dict[str, str] | None = None,
           stored: Callable[[str], str] = str, dtype_drift: bool = False,
           baseline: OnDemand | None = None, forced: TeacherForced | None = None
           ) -> tuple[str, str, str, Inconclusive | None]:
    """(status, headline, diagnosis, inconclusive) from the evidence; ``quiet``: the worst candidate
    stands out, but too little to name where nothing fails (``below_notice``); ``stored``: a
    quantized Linear layer's name in its checkpoint (``stored_name``); ``dtype_drift``: failing
    logits are the dtype's own (``_dtype_drift``); ``baseline``: the golden model itself in the target's
    dtype, measured where failing logits are all that is left to explain; ``forced``: the target's
    logits on the golden's tokens after the texts part."""
    baseline = baseline or OnDemand(None)
    cand = chosen.candidate
    steps = " and ".join(_step_word(t.step) for t in tried)
    if shared is not None and shared.fails and module == shared.example:
        return _shared_fault(chosen, tried, shared, dtype, stack, problems)
    between = _layer_standing_out(chosen, LAYER_STANDOUT * inp.ratio_threshold)
    if module and between and module == between[0]:  # a layer's own code (see conclude)
        where, ratio = _step_word(chosen.step), between[1]
        headline = (f"{module}'s own code is the fault: replayed whole on the golden inputs at {where} it "
                    f"has {ratio:.0f}x the own error of the other layers, while none of its modules' own "
                    "error stands out")
        diagnosis = (f"{module} is the fault, between its modules: each of its modules replayed alone on the "
                     f"golden inputs at {where} is within the usual error, but the layer replayed whole has "
                     f"{ratio:.0f}x the own error of the other decoder layers. What differs is the layer's "
                     "forward itself: a residual add, a scale, a reshape, or what it hands a module.")
        return "fail", headline, diagnosis, None
    if module and cand:
        return _fault(inp, tried, chosen, module, expert, problems, stack, own_steps, quantized or {},
                      stored)
    worst = f"{cand['name']} at {cand['score']:.1f}x" if cand else "none replayed"
    if _set_aside(cand, inp.ratio_threshold):
        worst += " (set aside: the golden module's own rounding in the target's dtype)"
    quiet_words = (f"; under {quiet_limit(inp, cand, quantized):g}x, taken as "
                   + ("the quantization's own" if _is_quantized(cand, quantized) else "rounding")
                   + " where the texts agree and no step's logits and no compare row fail")
    nothing = (f"No module's own error stands out from the same module in the other layers at {steps} "
               f"(worst: {worst}, threshold {inp.ratio_threshold}x"
               + (quiet_words if quiet else "") + ")")
    if routing:  # near-tied experts swapped by the router's rounding: reported, not a fault
        r = routing[0]
        toks = ", ".join(repr(t.text) for t in r.tokens[:5])
        nothing += (f"; routing diverges in {r.module} at {_step_word(r.step)} for {toks}: "
                    f"{r.detail} (the router's own error does not stand out: rounding picked other "
                    "experts for near-tied tokens)")
    reason, nxt = _inconclusive_reason(inp, tried, chosen, between, mismatch, bad_token, problems, shared,
                                       dtype, steps, quantized or {}, stored, dtype_drift, baseline, forced)
    origin = _overflow_scan_origin(inp)
    if reason and origin:
        reason += (f"; {_scan_sentence(origin)}, but replayed on the golden inputs no module overflows: "
                   "the overflow needs values only the target's own run produces (upstream drift, its own "
                   "KV cache)")
    if reason:
        diagnosis = nothing + ". Inconclusive: " + reason + "."
        return "inconclusive", reason, diagnosis, Inconclusive(reason, nxt or "")
    if dtype_drift:  # (no reason above: the failing logits are the dtype's own, ``_dtype_drift``)
        headline = (f"no fault: the target is the golden model itself in {dtype}; its logits fail the "
                    f"{dtype} thresholds at step {bad_token} through that dtype's own rounding")
        diagnosis = (nothing + ". The target is the golden model itself (its dump and spec: the same model "
                     f"on the same device, no patch) run in {dtype}: only the dtype differs, so its logits "
                     f"failing the {dtype} thresholds at step {bad_token} is how far {dtype} on this device "
                     "takes this model on this prompt, not a fault. A port in that dtype whose logits fail "
                     "alike there drifts no further than this.")
        return "pass", headline, diagnosis, None
    measured = baseline.value
    if measured is not None and measured.covers and not measured.warning:  # (no reason above: the port
        # drifts as the dtype does)
        return _dtype_baseline_pass(measured, nothing, steps, dtype, forced)
    status, headline, diagnosis, none = _plain_pass(inp, chosen, nothing, steps, mismatch, dtype, quantized,
                                                    stored, stack, forced)
    if measured is not None and measured.warning:
        diagnosis += " " + _warning_sentence(measured)
    return status, headline, diagnosis, none


def _warning_sentence(measured: DtypeBaseline) -> str:
    """What the golden model itself in the target's dtype says of logits that warn, in a pass."""
    warned = measured.failing_steps or [measured.step]
    at = ("step " if len(warned) == 1 else "steps ") + steps_text(warned)
    run = f"the golden model itself in {measured.dtype} on {measured.device}"
    if measured.error or not isinstance(measured.target_rel_l2, float):
        return (f"Where the logits warn ({at}), {run} could not tell them from that dtype's own drift"
                + (f": {measured.error}." if measured.error else "."))
    figures = (f"relative L2 {measured.target_rel_l2:.3g} against its {measured.baseline_rel_l2:.3g} at step "
               f"{measured.step}")
    if not measured.covers:  # (off the target's device: ``_warning_beyond_drift``)
        return (f"Where the logits warn ({at}), they are further from the golden's than those of {run} "
                f"({figures}), which ran on another device than the target's: its kernels round otherwise, "
                "so logits within their thresholds are not held to it.")
    return (f"Where the logits warn ({at}), they are no further from the golden's than those of {run} "
            f"({figures}): that dtype's own drift.")


def _plain_pass(inp: Any, chosen: StepReplay, nothing: str, steps: str, mismatch: int | None, dtype: str,
                quantized: dict[str, str] | None, stored: Callable[[str], str], stack: LayerStack | None,
                forced: TeacherForced | None) -> tuple[str, str, str, None]:
    """The pass where no module stands out and nothing is left to explain: the tokens agree, or they
    part through the dtype's rounding (or were not compared)."""
    unknown = [side for side, ids in (("golden", inp.golden_ids), ("target", inp.target_ids)) if not ids]
    if mismatch is None and unknown:  # nothing to say of the tokens: only of the modules replayed
        held = f"the {unknown[0]} dump holds no" if len(unknown) == 1 else "neither dump holds any"
        headline = f"no module stands out at {steps}; the tokens were not compared ({held} logits)"
        return "pass", headline, (nothing + f". The tokens were not compared: {held} logits or token ids "
                                  "(dump with logits, or give the generation files)."), None
    if mismatch is None:
        headline = "the target matches the golden: the same tokens, logits within the thresholds"
        return "pass", headline, ("The target matches the golden: the same tokens, logits within the "
                                  f"{dtype} thresholds. " + nothing + "."
                                  + most_sensitive(chosen.replayed, quantized, stored)), None
    noisy = _noisiest_types(chosen.replayed, stack)
    headline = (f"no fault: no module stands out at {_step_word(chosen.step)}; the texts part at token "
                f"{mismatch} through {dtype} rounding")
    diagnosis = (nothing + f": the drift is the {dtype} rounding of every layer adding up, not one faulty op"
                 + (f" (largest own errors: {noisy})." if noisy else ".")
                 + _after_part_sentence(inp, mismatch, forced))
    return "pass", headline, diagnosis, None


def _fault(inp: Any, tried: list[StepReplay], chosen: StepReplay, module: str, expert: int | None,
           problems: list[str], stack: LayerStack | None, own_steps: OwnErrorSteps | None,
           quantized: dict[str, str], stored: Callable[[str], str]) -> tuple[str, str, str, None]:
    """The words of a fault: ``module`` (its expert where one stands out), whose own error, replayed
    on the golden inputs or read from the target dump, stands out from the same module elsewhere."""
    cand = chosen.candidate
    where = _step_word(chosen.step)
    from_dump = chosen.source == "target dump"
    alone = ("its output in the target dump, against the golden module run on the same recorded inputs"
             if from_dump else "replayed alone on the golden inputs")
    if from_dump and cand.get("source"):  # a KV cache reader, run over every step before this one
        alone += f" ({cand['source']}, filling a KV cache of its own)"
    which = [f"expert {expert}"] if expert is not None else []
    if cand.get("shard_rank") is not None:
        which.append(f"rank {cand['shard_rank']}'s shard")
    what = module
    if len(cand.get("covers") or ()) > 1:  # the final norm and lm_head, replayed as one
        what = " and ".join(cand["covers"])
        alone = ("the target's logits, against the golden's " + what + " run on the target's recorded "
                 "output of the last decoder layer (the dumps hold no output between them)")
    what += f" ({', '.join(which)})" if which else ""
    qtype = quantization_of(module, quantized)
    linear = chosen.expert_linear if expert is not None else None
    if qtype:  # its error is its quantization's: said where it is named
        what += f" ({qtype}-quantized)"
    if cand["name"].endswith(KV_CACHE):
        what += " (the keys and values it writes to the KV cache)"
    op = f"; first bad op {chosen.first_op}" if chosen.first_op else ""
    if linear is not None:
        op = f"; of the expert's Linear layers, {linear.projection} stands out ({linear.score:.0f}x)"
    level = chosen.op_level
    if level is not None and not level.comparable:
        op += "; op level not comparable (the target runs other ops than the golden)"
    if cand.get("overflow"):
        o = chosen.overflow_op
        how = (f" ({o.api} in {o.dtype}: {o.inf} Inf, {o.nan} NaN from inputs up to "
               f"{o.input_max_abs:.3g})") if o else ""
        headline = (f"{what} overflows: replayed alone on finite golden inputs at {where} it gives "
                    f"Inf/NaN where the golden is finite{op}")
        diagnosis = (f"{what} is the fault, an overflow: {alone} at {where}, "
                     f"{cand['nonfinite']} of its {cand.get('numel')} output values are Inf/NaN where "
                     "the golden's are finite")
        diagnosis += (f"; inside it, {chosen.first_op} is the first op whose output overflows{how}."
                      if chosen.first_op else ".")
        origin = _overflow_scan_origin(inp)
        if origin:
            agrees = _related(origin.name, module)
            diagnosis += (f" Consistent with this, {_scan_sentence(origin)}." if agrees else
                          f" Note: {_scan_sentence(origin)}, elsewhere.")
    else:
        if cand["typical"] and cand.get("peers", 1) == 0:  # one of a kind: the final norm, lm_head ...
            are = "are" if len(cand.get("covers") or ()) > 1 else "is"
            headline = (f"{what} {are} the fault: {cand['score']:.0f}x the median own error of the "
                        f"model's modules (no other layer has this module), at {where}{op}")
            diagnosis = (f"{what} {are} the fault: {alone} at {where} it adds {cand['error']:.3g} "
                         f"relative error, {cand['score']:.0f}x the {cand['typical']:.2g} the model's "
                         "modules add at the median (no other layer has this module to compare it with)")
        elif cand["typical"]:
            headline = (f"{what} is the fault: {cand['score']:.0f}x the own error of the same module in "
                        f"the other layers, at {where}{op}")
            diagnosis = (f"{what} is the fault: {alone} at {where} it adds "
                         f"{cand['error']:.3g} relative error, {cand['score']:.0f}x the "
                         f"{cand['typical']:.2g} the same module adds in the other layers")
        else:  # the other copies (or modules) match the golden exactly: a ratio to 0 says nothing
            one_of_a_kind = cand.get("peers", 1) == 0  # (the model's other modules are its peers)
            others = "the model's other modules" if one_of_a_kind else "the same module in the other layers"
            headline = (f"{what} is the fault: an own error of {cand['error']:.3g} where {others} "
                        f"{'have' if one_of_a_kind else 'has'} none, at {where}{op}")
            diagnosis = (f"{what} is the fault: {alone} at {where} it adds {cand['error']:.3g} relative "
                         f"error, where {others} {'add' if one_of_a_kind else 'adds'} none")
        if isinstance(cand.get("rounding_ratio"), float):  # (rounding.py: not the dtype's own)
            diagnosis += (f", {cand['rounding_ratio']:.0f}x what the golden module itself gives in the "
                          "target's dtype on the same inputs")
        if expert is not None:
            diagnosis += f"; of its experts, expert {expert} stands out"
            diagnosis += expert_linear_clause(linear, chosen.expert_linears, expert, stored)
        diagnosis += (f"; inside it, {chosen.first_op} is the first op that goes wrong."
                      if chosen.first_op else ".")
        diagnosis += _per_token_sentence(cand, expert)
        # the same module standing out in other layers too: each is named, not hidden in a median
        others = [r for r in chosen.ranked if r.get("anomalous") and r["name"] != cand["name"]
                  and r.get("module_type") == cand.get("module_type")]
        if others:
            names = ", ".join(r["name"] for r in others[:3]) + (", ..." if len(others) > 3 else "")
            headline += f"; also in {names}"
            diagnosis += (f" The same module stands out in {len(others)} more layer(s): "
                          + ", ".join(f"{r['name']} ({r['error']:.3g})" for r in others[:8]) + ".")
    if level is not None and not level.comparable:
        ops = ", ".join(o.name.rsplit("/", 1)[-1] for o in level.target_ops_around)
        diagnosis += f" The op level is not comparable: {level.reason} (target ops there: {ops})."
    if quantized:
        diagnosis += quantized_sentences(module, expert, linear, chosen.ranked, chosen.quant_detail,
                                         (inp.golden_spec, inp.target_spec), quantized, stored)
    if _weight_wrong(cand, quantized):
        diagnosis += (" Its own error is not its quantization's: beyond what its activation "
                      "quantization's clip and int8 rounding give, its output errs "
                      f"{cand['weight_ratio']:.0f}x what rounding the float weight to its int8 grid "
                      "gives: a weight, scale or bias of the checkpoint that is wrong.")
    if from_dump and stack is not None and module in stack.layers:  # the dumps hold the layers whole
        diagnosis += (f" The dumps hold no module inside {module}: dump the target with its modules "
                      f"(layer_name: {module}.*, module mode with inputs and outputs) and bisect again "
                      "to name the one.")
    if chosen.step > 0 and not from_dump:
        diagnosis += _decode_path(chosen, tried, own_steps, inp.ratio_threshold)
    if problems:
        diagnosis += f" Note: {problems[0]}."
    return "fail", headline, diagnosis, None


def _inconclusive_reason(inp: Any, tried: list[StepReplay], chosen: StepReplay,
                        between: tuple[str, float] | None, mismatch: int | None, bad_token: int | None,
                        problems: list[str], shared: SharedError | None, dtype: str, steps: str,
                        quantized: dict[str, str], stored: Callable[[str], str],
                        dtype_drift: bool = False, baseline: OnDemand | None = None,
                        forced: TeacherForced | None = None) -> tuple[str | None, str | None]:
    """Where no module is named a fault: why the evidence does not cover the question, and what to
    run next, in the order the causes are checked; (None, None) where it does (the failing logits
    within the golden model's own drift in the target's dtype: ``baseline.value.covers``)."""
    cand = chosen.candidate
    # the causes checked after the failing logits, which stand whatever the dtype's drift: the
    # baseline (a model load and a re-run) is measured only where none of them applies
    others_first = _cheap_cause(inp, tried, chosen, mismatch)
    missing = [t.missing for t in tried if t.missing]
    reason, nxt = None, None
    if chosen.missing and chosen.missing_next:  # what was missing is known, and what to give
        reason, nxt = chosen.missing, chosen.missing_next
    elif between is not None:
        layer, ratio = between
        reason = (f"{layer}, replayed whole from the target dump, has {ratio:.0f}x the own error of the "
                  f"other layers at {_step_word(chosen.step)}, but none of its modules' own error stands "
                  "out: the difference arises between its modules (the layer's own code, or something that "
                  "changes what a module receives), which a module replayed on its recorded inputs does not "
                  "see")
        nxt = ("bisect with the target model (isolate: target_model, target_model_spec), which runs each "
               f"module as the target runs it, or dump the target in API mode inside {layer} (layer_name) "
               "and precheck it")
    elif missing and not chosen.replayed and chosen.source == "target dump":
        reason, nxt = missing[0], ("dump the target again in module mode with each module's inputs and "
                                   "outputs as tensors on every rank (DumpConfig mode module, tensor_part 2, "
                                   "data_mode tensor), and give the golden model (golden_model)")
    elif missing and not chosen.replayed:
        reason, nxt = missing[0], ("give the bisect the golden model (golden_model_spec) and the golden "
                                   "generation file with input_ids, or replay_step: 0")
    elif not chosen.replayed:
        reason = f"no module could be replayed at {_step_word(chosen.step)}{_reason_list(chosen)}"
        nxt = ("dump the golden's decoder layers with inputs and outputs (module mode, tensor_part 2, "
               "layer_class auto) at that step, or give the golden model so the bisect can re-run it")
    elif problems:
        reason = "the dumps are not whole: " + "; ".join(problems[:3])
        nxt = "rerun the dump stages (llmflow run ... --from dump-golden) and bisect again"
    elif quantized and (bad_token is not None or mismatch is not None) and chosen.quantization:
        reason, nxt = quantization_explained(chosen.quantization, steps, stored)
    elif quantized and (bad_token is not None or mismatch is not None or shared is not None):
        reason, nxt = quantization_spread(chosen.replayed, quantized, steps, stored)
    elif shared is not None:  # beyond rounding in the layers alike, but not a clear fault
        reason, nxt = _shared_reason(shared, dtype)
    elif dtype_drift:  # (``bad_token`` set: ``_dtype_drift``)
        pass  # the dtype's own drift: a pass (``_judge``), with nothing else to run
    elif bad_token is not None and not (others_first is None and _drifts_as_dtype(baseline)):
        # (else: the checks below, then a pass in ``_judge``: the port drifts no further than the
        # golden model itself in its dtype; measured only where none of those checks applies)
        measured = baseline.value if baseline else None
        entered = _where_rows_fail(inp, bad_token, tried)  # (where the compare saw it: said in place of the
        # places a fault may hide)
        reason = (f"the logits fail the {dtype} thresholds at step {bad_token}, but no module's own error "
                  f"stands out when replayed at {steps}: "
                  + (entered[0] if entered is not None else _unseen_causes(bad_token)))
        ends = [n for t in tried for n in t.ends_not_replayed]
        if ends:  # named: the modules outside the layers this evidence leaves out
            reason += f"; outside the decoder layers, not replayed: {ends[0]}"
        rounds = _set_aside(cand, inp.ratio_threshold)
        if rounds:  # the module standing out is the dtype's own rounding: what the logits may show
            reason += (f"; the module standing out most, {cand['name']} at {cand['score']:.1f}x the typical "
                       f"own error of its kind, errs as the golden module itself does in the target's dtype "
                       f"({cand['rounding_ratio']:.2f}x)" + ("" if measured is not None else
                                                             ": the logits may fail through that dtype's "
                                                             "rounding there, which the golden run in that "
                                                             "dtype would show too"))
        elif cand is not None and _a_lead(cand):  # the strongest lead, not called a fault
            reason += (f"; the strongest lead, not called a fault, is {cand['name']} at {cand['score']:.1f}x "
                       "the typical own error of its kind")
        if measured is not None:
            reason += "; " + _baseline_words(measured)
        # the step to look at: the first whose logits go beyond the dtype's own drift, where measured
        beyond = measured is not None and not measured.error and not measured.covers
        focus = measured.step if beyond else bad_token
        which = ("the first step whose logits go beyond the dtype's own drift"
                 if beyond and focus != bad_token else "the step whose logits fail")
        seen = {t.step for t in tried}
        earlier = [s for s in dict.fromkeys((focus - 1, 0)) if 0 <= s < focus and s not in seen]
        if focus not in seen:
            nxt = (f"replay {which}: bisect replay_step: {focus} (in the recipe: --set replay_step={focus})"
                   + (", or leave replay_step unset to let the bisect choose" if focus == bad_token else ""))
        elif earlier:
            steps_left = " or ".join(map(str, earlier))
            nxt = (f"replay an earlier step (bisect replay_step: {steps_left}), dump both sides in module "
                   "mode at that step and compare them (llmflow compare), or lower ratio_threshold")
        else:  # the step and those before it that a replay would pick were replayed already
            nxt = (f"dump both sides in module mode at step {focus} and compare them (llmflow compare): "
                   "the first failing row is where the error enters; or lower ratio_threshold")
        if entered is not None and entered[1] and not beyond:  # (the rows say where to look)
            nxt = entered[1]
        if rounds and measured is None:
            nxt = ("bisect the golden model run in the target's dtype against the golden (in the recipe: "
                   "--set target_model=<the golden model> --set target_dtype=<the target's dtype>): where it "
                   "fails these logits too, the drift is the dtype's; else " + nxt)
    elif chosen.not_replayable:
        reason = (f"{len(chosen.not_replayable)} module(s) could not be replayed at "
                  f"{_step_word(chosen.step)}{_reason_list(chosen)}: the fault may be among them")
        nxt = "dump those modules on both sides in module mode and compare them (llmflow compare)"
    elif unchecked := next((t for t in tried if t is not chosen and t.not_replayable), None):
        # the other step tried (a decode step, where a fault on the decode path alone shows) is not
        # covered: "no fault" would speak for modules nobody ran there
        reason = (f"{len(unchecked.not_replayable)} module(s) could not be replayed at "
                  f"{_step_word(unchecked.step)}{_reason_list(unchecked)}: a fault on that step's path "
                  "may be among them")
        nxt = (f"dump those modules on both sides in module mode at step {unchecked.step} and compare them "
               "(llmflow compare)" + (", or bisect with the target model (isolate: target_model, "
                                      "target_model_spec), which replays them on a golden re-run"
                                      if unchecked.source.startswith("target dump") else ""))
    elif (forced is not None and forced.first_fail is not None
          and not (others_first is None and _drifts_as_dtype(baseline))):
        # (nothing stands out there either; else a pass in ``_judge``: the dtype's own drift)
        reason = (f"the texts part at token {forced.after} through {dtype} rounding, but on the golden's "
                  f"tokens (teacher-forced) the target's logits fail the {dtype} thresholds at step "
                  f"{forced.first_fail}, after the part ({forced.reason}), and no module's own error stands "
                  f"out when replayed at {steps}: the fault may live in state carried between steps (a KV "
                  "cache written wrong), in a module the replay cannot isolate, or be spread over many "
                  "layers")
        if baseline is not None and baseline.value is not None:
            reason += "; " + _baseline_words(baseline.value)
        before = forced.first_fail - 1
        nxt = (f"replay the step before it (bisect replay_step: {before}), where state it reads may have "
               "been written wrong, or lower ratio_threshold"
               if before > forced.after and before not in {t.step for t in tried} else
               f"lower ratio_threshold, or bisect a prompt whose texts do not part before step "
               f"{forced.first_fail} (llmflow run badcase_bisect ranks prompts by how far the target drifts)")
    elif mismatch is not None and inp.replay_step is not None and mismatch != chosen.step:
        reason = (f"the texts part at step {mismatch}, but step {chosen.step} was replayed (replay_step): "
                  "the evidence does not cover the step where the divergence starts")
        nxt = f"bisect with replay_step: {mismatch}, or leave replay_step unset to let the bisect choose"
    elif (failing := _compare_fail_not_replayed(inp, tried)) is not None:
        reason = (f"the compare's first failing row, {failing.get('name')}, is at step {failing['step']}, "
                  f"but step {chosen.step} was replayed (replay_step): the evidence does not cover the step "
                  "where the error shows first")
        nxt = (f"bisect with replay_step: {failing['step']}, or leave replay_step unset to let the bisect "
               "choose")
    elif (bad_token is None and (forced is None or forced.first_fail is None) and others_first is None
          and (beyond := _warning_beyond_drift(baseline)) is not None):
        reason, nxt = _warning_reason(beyond, cand, mismatch, dtype, steps, tried)
    if reason is None and shared is not None:  # (after "the texts part at a step not replayed")
        reason, nxt = _shared_reason(shared, dtype)
    return reason, nxt


def _unseen_causes(step: int) -> str:
    """Where a fault no module replayed alone shows may be, at ``step``: state carried between
    steps only after the prefill (at step 0 nothing came before)."""
    carried = ("" if step == 0 else
               "in state carried between steps (a KV cache written wrong at earlier steps), ")
    return (f"the fault may live {carried}in a module the replay cannot isolate, in code between the modules "
            "(an attention mask or positions the model's forward builds, a logits soft-cap or scale), or be "
            "spread over many layers")


def _where_rows_fail(inp: Any, step: int, tried: list[StepReplay]) -> tuple[str, str | None] | None:
    """What the compare's first failing row (``compare_first_fail``: a whole compare's, every row
    paired) says of where the error enters, where it is at or before ``step`` at a step replayed
    with nothing standing out: the logits alone (every module's output before them passes: the
    model's forward after its last module), or a module or layer whose modules are right on the
    golden inputs (what it is handed differs). (sentence, what to run next or None); None where
    the compare says nothing of it, or of a step not replayed."""
    row = getattr(inp, "compare_first_fail", None) or {}
    name, at = row.get("name"), row.get("step")
    if not isinstance(name, str) or not isinstance(at, int) or at > step:
        return None
    if at not in {t.step for t in tried if t.replayed}:
        return None
    if name == "logits" or name.endswith("lm_head"):
        return (f"the compare's first failing row is the {name} at step {at}: every module's output before "
                "them passes, so the error enters after the last module dumped, in the model's own forward "
                "(a logits soft-cap or scale) or its head"), (
                "compare the target's forward after its last decoder layer with the golden's (its final "
                "norm, lm_head and what it does to the logits: final_logit_softcapping, a scale)")
    cache = ", or at a decode step the KV cache it reads" if at > 0 else ""
    return (f"the compare's first failing row is {name} at step {at}, yet no module replayed on the golden "
            "inputs errs beyond its peers: what the model's forward hands it differs (an attention mask, a "
            f"sliding window, positions{cache}), or the error builds up over the modules before it"), (
            f"compare what {name} is handed at step {at} on both sides (dump its inputs as tensors, keyword "
            "inputs included: module mode, tensor_part 2, and llmflow compare), and the model config's mask "
            "settings (sliding_window, layer_types)")


def _a_lead(cand: dict[str, Any]) -> bool:
    """Whether the worst candidate is worth naming as a lead: its own error above the typical of
    its kind (a score of 0.0x, every module without error, leads nowhere)."""
    score = cand.get("score")
    return isinstance(score, (int, float)) and score > 1.0


def _warning_beyond_drift(baseline: OnDemand | None) -> DtypeBaseline | None:
    """The golden model itself in the target's dtype, measured now where no step's logits fail but
    some warn, where the target's warning logits go beyond its drift; None where they do not, or
    where it could not say."""
    measured = baseline() if baseline is not None else None
    if measured is None or not measured.warning or measured.error or measured.covers:
        return None
    if not measured.on_target_device:  # (a target known by its dump: the baseline ran on the golden's
        # device, whose kernels round otherwise; logits within their thresholds are not held to it)
        return None
    if not isinstance(measured.target_rel_l2, float) or not isinstance(measured.baseline_rel_l2, float):
        return None
    return measured


def _warning_reason(measured: DtypeBaseline, cand: dict[str, Any] | None, mismatch: int | None, dtype: str,
                    steps: str, tried: list[StepReplay]) -> tuple[str, str]:
    """Why a port whose logits only warn, further than the dtype's own drift takes them, is not
    passed: an error of its own too small yet to fail the thresholds (a logits scale in its forward
    changes no greedy token), which no module replayed alone shows."""
    warned = measured.failing_steps or [measured.step]
    at = ("step " if len(warned) == 1 else "steps ") + steps_text(warned)
    tokens = ("the greedy tokens agree" if mismatch is None else
              f"the texts part at token {mismatch} and up to there")
    reason = (f"{tokens} and no step's logits fail the {dtype} thresholds, but they warn at {at}, and no "
              f"module's own error stands out when replayed at {steps}; " + _baseline_words(measured))
    if cand is not None and _a_lead(cand):
        reason += (f"; the strongest lead, not called a fault, is {cand['name']} at {cand['score']:.1f}x the "
                   "typical own error of its kind")
    focus = measured.step
    if focus not in {t.step for t in tried}:
        nxt = (f"replay the first step whose logits go beyond the dtype's own drift: bisect replay_step: "
               f"{focus} (in the recipe: --set replay_step={focus}); a scale or soft-cap the model's forward "
               "applies to the logits shows in no module")
    else:
        nxt = (f"dump both sides in module mode at step {focus} and compare them (llmflow compare): a logits "
               "row that drifts where no module's row does is the model's own forward (a logits scale or "
               "soft-cap); or tighten the logits thresholds (thresholds: {relative_euclidean_distance: ...})")
    return reason, nxt


def _after_part_sentence(inp: Any, mismatch: int, forced: TeacherForced | None) -> str:
    """What the pass of texts parted through rounding says of the steps after the part."""
    last = len(getattr(inp, "golden_ids", None) or []) - 1
    if forced is not None and forced.steps:
        return (f" On the golden's tokens (teacher-forced) the target's logits stay within the thresholds at "
                f"every step after the part ({steps_text(forced.steps)}).")
    if mismatch < last:
        return (f" Steps after token {mismatch}, where each side continues its own text, are not checked "
                "(the target was not run on the golden's text: that needs the target model and the "
                "prompt's token ids).")
    return ""


def _cheap_cause(inp: Any, tried: list[StepReplay], chosen: StepReplay, mismatch: int | None) -> str | None:
    """Which of the causes ``_inconclusive_reason`` checks after the failing logits applies (modules
    not replayed at a step tried, a step asked that misses the divergence or the compare's first
    failing row); None where none does."""
    if chosen.not_replayable or any(t is not chosen and t.not_replayable for t in tried):
        return "not replayed"
    if mismatch is not None and inp.replay_step is not None and mismatch != chosen.step:
        return "replay_step"
    if _compare_fail_not_replayed(inp, tried) is not None:
        return "compare row"
    return None


def _drifts_as_dtype(baseline: OnDemand | None) -> bool:
    """Whether the golden model itself in the target's dtype, measured now, drifts as far as the
    target at the failing step (``DtypeBaseline.covers``)."""
    measured = baseline() if baseline is not None else None
    return measured is not None and measured.covers


def _baseline_words(measured: DtypeBaseline) -> str:
    """What the golden model itself in the target's dtype showed, where it does not explain the
    failing logits (or could not be run)."""
    run = f"the golden model itself in {measured.dtype} on {measured.device}"
    if measured.error:
        return f"{run} could not be run to measure that dtype's own drift: {measured.error}"
    t, b = measured.target_rel_l2, measured.baseline_rel_l2
    if not isinstance(t, float) or not isinstance(b, float):
        return (f"the logits at step {measured.step} could not be measured against {run} (the target's or "
                "the golden model's own are missing)")
    if not math.isfinite(t):
        return (f"at step {measured.step} the target's logits hold NaN/Inf, where those of {run} are "
                f"{b:.3g} from the golden's (relative L2): error of the port's own")
    against = f"{t / b:.1f}x its {b:.3g} for {run}" if b > 0 else f"where {run} reproduces them exactly"
    return (f"at step {measured.step} the target's logits are {t:.3g} from the golden's (relative L2), "
            f"{against}: error of the port's own, beyond that dtype's rounding, which no "
            "module replayed alone shows (code between the modules, the model's own forward: a logits "
            "soft-cap or scale, a residual, is where a replay does not look)")


def _dtype_baseline_pass(measured: DtypeBaseline, nothing: str, steps: str, dtype: str,
                         forced: TeacherForced | None = None) -> tuple[str, str, str, None]:
    """The pass of a port whose failing logits are within the golden model's own drift in its dtype."""
    t, b = measured.target_rel_l2, measured.baseline_rel_l2
    failing = measured.failing_steps or [measured.step]
    part = forced.after if forced is not None else None  # (steps after it ran on the golden's tokens)
    after = [k for k in failing if part is not None and k > part]
    before = [k for k in failing if k not in after]
    parts = [("step " if len(ks) == 1 else "steps ") + steps_text(ks) for ks in (before, after) if ks]
    if after:
        parts[-1] += f" (on the golden's tokens, after the texts part at token {part})"
    at = " and ".join(parts)
    headline = (f"no fault: no module stands out at {steps}; the logits fail the {dtype} thresholds at {at} "
                f"no more than the golden model itself does in {measured.dtype} on {measured.device} "
                f"(relative L2 {t:.3g} against its {b:.3g} at step {measured.step})")
    diagnosis = (nothing + f". The golden model itself, run in {measured.dtype} on {measured.device} on the "
                 f"golden's tokens, drifts from the golden's logits as far as the target at each failing "
                 f"step ({at}; relative L2 of the last position, the target within {measured.factor:g}x of "
                 f"it: {t:.3g} against {b:.3g} at step {measured.step}), so the failing logits are how far "
                 f"{measured.dtype} takes this model on this prompt, not a fault of the port."
                 + (f" Both ran on {measured.device}: a fault of that device's own {measured.dtype} kernels "
                    "would show in both (the golden model in that dtype on another device would tell)."
                    if measured.on_target_device and measured.device != "cpu" else
                    f" The target ran on its own device, known by its dump; the golden model ran on "
                    f"{measured.device}." if not measured.on_target_device else ""))
    return "pass", headline, diagnosis, None


#: token-row codes that say the logits are not a drift: not finite, not comparable, not read
_NOT_DRIFT = {Code.NAN_INF.value, Code.NO_FINITE.value, Code.SHAPE_MISMATCH.value, Code.LOAD_ERROR.value,
              Code.STATS_MISSING.value, Code.EMPTY_TENSOR.value, Code.DTYPE_MISMATCH.value}


def _dtype_drift(inp: Any, rows: list[TokenRow], bad_token: int | None, dumps_as_specs: bool) -> bool:
    """Whether the logits failing at ``bad_token`` are the dtype's own drift: the target's spec is the
    golden's in a coarser dtype (``golden_in_another_dtype``) and the dumps were made as the specs say
    (``dumps_as_specs``), the logits fail there by their metrics, no step's logits hold NaN/Inf or
    fail to compare, and no overflow scan found NaN/Inf in the target dump (an overflow is no drift,
    whatever made it)."""
    if (bad_token is None or not dumps_as_specs or not golden_in_another_dtype(inp)
            or _overflow_scan_origin(inp) is not None or any(r.code in _NOT_DRIFT for r in rows)):
        return False
    row = next((r for r in rows if r.step == bad_token), None)
    return row is not None and row.code == Code.THRESHOLD_FAIL.value


def golden_in_another_dtype(inp: Any) -> bool:
    """Whether the target's spec is the golden's with only the dtype changed, to a coarser one: the
    same model on the same device, no patch on either side (the recipe's ``target_model`` set to the
    golden's, only ``target_dtype`` changed). Its drift is then that dtype's rounding on that device
    and nothing else: the baseline a port in that dtype is measured against. (Whether the dumps were
    made so is the bisect's to check: ``conclude``'s ``dumps_as_specs``.)"""
    golden, target = inp.golden_spec or {}, inp.target_spec
    if not target or golden.get("patch") or target.get("patch"):
        return False
    model = str(golden.get("model") or "")
    same_place = Path(model).is_absolute() or golden.get("base_dir") == target.get("base_dir")
    g_dtype, t_dtype = (str(side.get("dtype") or "float32") for side in (golden, target))
    return (bool(model) and model == str(target.get("model") or "") and same_place
            and (golden.get("device") or "cpu") == (target.get("device") or "cpu")
            and t_dtype != g_dtype and coarser(g_dtype, t_dtype) == t_dtype)


def _compare_fail_not_replayed(inp: Any, tried: list[StepReplay]) -> dict[str, Any] | None:
    """The compare's first failing row where it is at a step the bisect was told not to replay
    (``replay_step`` set elsewhere); None where the compare fails no row, or at a step replayed. (Left
    unset, the bisect replays that step itself.)"""
    failing = getattr(inp, "compare_first_fail", None) or {}
    step = failing.get("step")
    if (getattr(inp, "replay_step", None) is None or not isinstance(step, int)
            or step >= len(getattr(inp, "golden_ids", None) or [])):  # (past the steps generated: no replay)
        return None
    return failing if step not in {t.step for t in tried} else None


def _set_aside(cand: dict[str, Any] | None, ratio_threshold: float) -> bool:
    """Whether ``cand`` stands out from its peers by no more than the golden module's own rounding in
    the target's dtype (``rounding.py``)."""
    ratio = (cand or {}).get("rounding_ratio")
    return isinstance(ratio, float) and ratio < ratio_threshold


def _rounding_sentence(rows: list[dict[str, Any]], dtype: str) -> str:
    """The modules standing out from their peers that the golden module's own rounding in the
    target's dtype explains (``rounding.py``), set aside rather than named."""
    said = ", ".join(f"{r['name']} ({r['score']:.1f}x its peers, {r['rounding_ratio']:.2f}x the golden "
                     "module's own error)" for r in rows)
    return (f"Set aside: {said}: run in {dtype} on the target's device on the same golden inputs, the golden "
            f"module itself errs as much, so {dtype} rounds more there (a sensitive input), not a fault in "
            "the target's code.")


def _shared_reason(shared: SharedError, dtype: str) -> tuple[str, str]:
    """(reason, next) of an inconclusive verdict for a shared error that is not called a fault."""
    what = f"what {shared.module_type} writes to its KV cache" if shared.kv_cache else shared.module_type
    reason = (f"{what}'s own error is {shared.error:.3g} {shared.where()} (the median of "
              f"{len(shared.faulty)}){shared.ratio_words()}, beyond {shared.limit_words(dtype)}, and no "
              "layer stands out from the others: a fault the layers share, more error than this precision "
              "should give, or a golden model that is not the one that made the golden dump")
    nxt = ("check that the golden model is the one that made the golden dump; dump the target in API "
           f"mode inside {shared.example} (layer_name) and precheck its ops against a float64 reference "
           "(llmflow precheck); or raise the thresholds if this precision is what the port should give")
    return reason, nxt


def _decode_path(chosen: StepReplay, tried: list[StepReplay], own_steps: OwnErrorSteps | None,
                 ratio_threshold: float) -> str:
    """What the evidence says of the prefill, for a fault found at a decode step: on the decode path
    alone only where the prefill was seen clean (replayed with nothing standing out, or the module's
    own error there within ``ratio_threshold`` of its copies in the other layers)."""
    said = f" Step {chosen.step} was replayed ({chosen.why}) with the golden KV cache"
    prefill = next((r for r in own_steps.rows if r.step == 0), None) if own_steps else None
    if prefill is not None and prefill.own_error is not None and prefill.peer_median is not None:
        own, peers = prefill.own_error, prefill.peer_median
        if own > 0 and (peers == 0 or own >= ratio_threshold * peers):
            than = f"{own / peers:.0f}x its copies in the other layers" if peers else "its copies have none"
            return (f"{said}; the module's own error stands out at the prefill too ({own:.3g}, {than}): the "
                    "fault is on the prefill path as well.")
        than = f"{own / peers:.1f}x its copies' in the other layers" if peers else "none, as its copies'"
        return f"{said}; at the prefill its own error is {than}, so the fault lives on the decode path."
    if any(t.step == 0 and not stands_out(t, ratio_threshold) for t in tried):
        return f"{said}; at the prefill nothing stood out, so the fault lives on the decode path."
    return f"{said}; whether the prefill has it too was not measured."


def _standing_out(chosen: StepReplay) -> str | None:
    """The module whose own error stands out at the step (its KV cache write's: the module), or None."""
    cand = chosen.candidate
    return cand["name"].removesuffix(KV_CACHE) if chosen.anomalous and cand else None


def _shared_fault(chosen: StepReplay, tried: list[StepReplay], shared: SharedError, dtype: str,
                  stack: LayerStack | None, problems: list[str]) -> tuple[str, str, str, None]:
    """The verdict's words for a fault the layers share (``shared_error``)."""
    where = _step_word(chosen.step)
    alone = ("its output in the target dump, against the golden module run on the same recorded inputs"
             if chosen.source == "target dump" else "each copy replayed alone on the golden inputs")
    of = f"(the median of {len(shared.faulty)} layers){shared.ratio_words()}"
    if shared.kv_cache:
        headline = (f"{shared.module_type} is the fault {shared.where()}: the keys and values it writes to "
                    f"its KV cache have an own error of {shared.error:.3g} at {where} {of}, past "
                    f"{KV_WRITE_FLOORS:g}x the rounding of one {dtype} op")
        standing = _standing_out(chosen)
        among = (f"{standing}'s output stands out among its copies, but every layer's cache write is off "
                 "alike" if standing in shared.faulty else "No layer stands out from the others because "
                 "they share it")
        diagnosis = (f"{shared.module_type} is the fault {shared.where()}: {alone} at {where}, the keys and "
                     f"values it writes to its KV cache are off by {shared.error:.3g} relative L2 {of}, past "
                     f"{shared.limit_words(dtype)}. {among}: look for what their cache writes share, a "
                     "cache kept in a lower precision (fp8 or int8 KV cache quantization) or its scales, or "
                     "the positions the keys are rotated to; "
                     f"{shared.example}, the first, is named as the module.")
    else:
        headline = (f"{shared.module_type} is the fault {shared.where()}: an own error of "
                    f"{shared.error:.3g} at {where} {of}, past what {dtype} rounding gives a whole tensor")
        diagnosis = (f"{shared.module_type} is the fault {shared.where()}: {alone} at {where}, its own "
                     f"error is {shared.error:.3g} relative L2 {of}, past {shared.limit_words(dtype)}. No "
                     "layer stands out from the others because they share it: look for what their copies "
                     "share, a kernel, a scale or a weight conversion; "
                     f"{shared.example}, the first, is named as the module.")
    if chosen.step > 0 and chosen.source != "target dump":
        prefill = next((t for t in tried if t.step == 0), None)
        at_prefill = shared_error(prefill, stack, dtype) if prefill is not None else None
        if prefill is None:
            diagnosis += " Whether the prefill has it too was not measured."
        elif shared.same_as(at_prefill):
            diagnosis += f" The prefill has it too ({at_prefill.error:.3g} there)."
        else:
            diagnosis += (" At the prefill its copies are within rounding, so the fault lives on the decode "
                          "path.")
    if problems:
        diagnosis += f" Note: {problems[0]}."
    return "fail", headline, diagnosis, None


def _reason_list(step: StepReplay, n: int = 3) -> str:
    reasons = _reasons(step.not_replayable)
    parts = [f"{len(names)}x {why} (e.g. {names[0]})" for why, names in list(reasons.items())[:n]]
    return (": " + "; ".join(parts)) if parts else ""


def _token_sentence(mismatch: int | None, detail: TokenDetail) -> str:
    if mismatch is None or detail.golden_margin is None:
        return ""
    tokens = f"{detail.golden_token!r} -> {detail.target_token!r}"
    both = f"{detail.golden_token}{detail.target_token}"
    if detail.golden_token == detail.target_token or "\ufffd" in both:
        tokens += f", token ids {detail.golden_id} -> {detail.target_id}"  # (texts that print alike)
    s = (f" The texts first differ at generated token {mismatch} ({tokens}), where the golden's top-2 "
         f"logit margin was {detail.golden_margin:.3g}")
    err = detail.logits_max_abs_error
    if isinstance(err, (int, float)) and err >= detail.golden_margin:
        return s + f" and the target's logits there differ by up to {err:.3g}: enough to swap the top two."
    return s + "."
