"""What a bisect concludes, and the evidence behind it: ``Verdict``, written as verdict.json.

``status`` is one of the stage outcomes: ``fail`` (a module's own error stands out: the fault is
named), ``pass`` (the target matches, or its drift is the dtype's rounding, with every module
replayed at the step where the divergence starts and none standing out), ``inconclusive`` (the
evidence does not cover the question: ``inconclusive.reason`` says why and ``inconclusive.next``
what to run next). ``headline`` is the one line a terminal or a CI log shows; ``diagnosis`` the
paragraph a person reads.

The bisect (``llmflow.localize``) fills these types, the bisect stage writes them with
``codec.to_json`` and the report reads them back with ``codec.from_json``; the schema
``schemas/verdict.schema.json`` is generated from them (``schemas.verdict_schema``). Errors that
JSON cannot hold (an overflow's ``inf``, a metric's ``nan``) are written as strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Status = Literal["pass", "fail", "inconclusive"]
OpStatus = Literal["matched", "different api", "only in target", "only in golden", "not comparable"]


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass
class ReplayInfo:
    """Which step was replayed, why, from which golden source, and what could not be replayed."""

    step: int
    why: str
    source: str = field(metadata=_doc('"dump", "dump + layer recompute", "golden re-run" or "target dump" '
                                      "(the golden modules on the target dump's inputs)"))
    replayed: int = 0
    not_replayable: int = 0
    reasons: dict[str, list[str]] = field(
        default_factory=dict, metadata=_doc("why a module could not be replayed -> those modules"))
    steps_tried: list[int] = field(default_factory=list)
    ratio_threshold: float = 3.0
    device: str = ""
    dtype: str = ""
    golden_rerun_max_abs_diff: float | None = field(
        default=None, metadata=_doc("largest |logit| difference between the golden re-run and its dump"))


@dataclass
class Inconclusive:
    """Why the evidence does not cover the question, and what to run next."""

    reason: str
    next: str


@dataclass
class TokenDetail:
    """The first mismatching token: both sides' token text, the golden's top-2 margin there (every
    field null when the texts do not part)."""

    step: int | None = None
    golden_token: str | None = None
    target_token: str | None = None
    golden_id: int | None = None
    target_id: int | None = None
    golden_margin: float | None = None
    kl: float | None = None
    logits_max_abs_error: float | None = None


@dataclass
class Evidence:
    """One of the top-ranked modules in a sentence's worth of numbers."""

    name: str
    isolated_rel_l2: float = field(metadata=_doc("the module's own error (isolation replay)"))
    typical: float | None
    score: float | None
    raw_rel_l2: float | None
    step: int


@dataclass
class SideText:
    """One side's generation: its setup in words, the text, and the text token by token."""

    label: str
    text: str
    tokens: list[str] = field(default_factory=list)


@dataclass
class Texts:
    """The two generations."""

    golden: SideText
    target: SideText


@dataclass
class Candidate:
    """A ranked module: its own error against the same module in the other layers (``rank.py``),
    or a module that could not be replayed (``replayable`` false, ``reason`` why)."""

    name: str
    rank: int | None = None
    module_type: str | None = None
    layer: str | None = None
    error: float | None = field(default=None, metadata=_doc("own error (inf: an overflow)"))
    typical: float | None = field(default=None, metadata=_doc("median own error of its peers"))
    score: float | None = field(default=None, metadata=_doc("error / typical"))
    z: float | None = None
    anomalous: bool = False
    raw_rel_l2: float | None = field(default=None,
                                     metadata=_doc("its output's error in the dumps (inherited)"))
    max_abs: float | None = None
    cos_dist: float | None = None
    token_rel: float | None = field(default=None, metadata=_doc(
        "the mean over its output's tokens of each token's relative error (error is the larger of this "
        "and the whole output's); null: an output measured whole"))
    whole_rel: float | None = field(default=None, metadata=_doc(
        "its whole output's relative error, where token_rel is given"))
    expert_rel: float | None = field(default=None, metadata=_doc(
        "a fused experts module: the mean relative error of the tokens routed to its worst expert "
        "(error is the larger of this, token_rel and the whole output's)"))
    expert_worst: int | None = field(default=None, metadata=_doc("that expert"))
    expert_median_rel: float | None = field(default=None, metadata=_doc(
        "the median relative error of the tokens routed to that expert"))
    expert_rest_rel: float | None = field(default=None, metadata=_doc(
        "the median relative error of the tokens not routed to that expert (null: every token is)"))
    prefill_expert: int | None = field(default=None, metadata=_doc(
        "a fused experts module named at a decode step from a target dump, its expert not told there: "
        "the expert whose tokens carry its error at the prefill"))
    weight_expert: int | None = field(default=None, metadata=_doc(
        "a fused experts module whose experts are split over the ranks (expert parallelism): the expert "
        "whose weight rows in the target dump differ from the golden's, where one stands out"))
    rounding_ratio: float | None = field(default=None, metadata=_doc(
        "its own error over that of the golden module run in the target's dtype on its device on the "
        "same inputs (the dtype's own rounding there); a module under ratio_threshold of it is set aside, "
        "not named; null: not checked, or the two compute alike"))
    weight_ratio: float | None = field(default=None, metadata=_doc(
        "a quantized checkpoint's W8A8 Linear layer: its own error beyond what its activation "
        "quantization (clip and int8 rounding) gives, over what rounding the float weight to its int8 "
        "grid gives (about 1 for an honest quantization; a layer under 3 of it whose clip is a "
        "calibration's on other prompts is set aside, not named); null: not checked"))
    replayable: bool = True
    reason: str | None = None
    routing: str | None = field(default=None, metadata=_doc(
        '"golden": an MoE block replayed with the golden routing (the target model replayed); "target": '
        "with the target's recorded routing (the golden module on a target dump)"))
    own_routing_rel_l2: float | None = None
    overflow: bool | None = None
    nonfinite: int | None = None
    sharding: str | None = field(default=None, metadata=_doc(
        "a tensor-parallel target dump: how the ranks' inputs and output join into the golden's "
        "(concat:D, replicated)"))
    rank_errors: list[float] = field(default_factory=list, metadata=_doc(
        "each rank's own error (rel_l2, rank order); empty where no rank has one of its own"))
    shard_rank: int | None = field(default=None, metadata=_doc(
        "the rank whose own error stands out from the other ranks' (null: none does)"))
    rank_note: str | None = field(default=None, metadata=_doc("why no rank can be named, where none can"))
    rank_source: str | None = field(default=None, metadata=_doc(
        "what named the rank where its output could not (its weight shards in the target dump); null: "
        "each rank's output against the golden"))
    source: str | None = field(default=None, metadata=_doc(
        'where its replay differs from the step\'s: "target dump, steps 0..T" (a module reading a KV cache '
        "at decode step T, run on the target's recorded inputs of every step to fill a cache of its own)"))
    covers: list[str] = field(default_factory=list, metadata=_doc(
        "the modules one row stands for, where the dumps hold no output between them (the final norm "
        "and lm_head, replayed together on the last decoder layer's output); empty: the row's own"))


@dataclass
class OpRow:
    """One op of the chosen module, golden and target paired (``ops.compare_ops``)."""

    name: str
    golden_api: str | None
    target_api: str | None
    raw: float | None = field(metadata=_doc("the op output's error, earlier ops' error included"))
    iso: float | None = field(metadata=_doc("the target op on the golden op's inputs: its own error"))
    status: OpStatus
    iso_typical: float | None = None
    iso_score: float | None = None


@dataclass
class ExpertRow:
    """One expert of a fused-experts module alone, golden against target (``moe.expert_errors``)."""

    expert: int
    tokens: int
    rel_l2: float
    max_abs: float
    max_rel: float
    cos_dist: float
    l2: float
    norm: float
    numel: int
    nonfinite: int
    token_rel: float | None = None
    score: float | None = None


@dataclass
class ExpertLinearRow:
    """One Linear layer of one expert a quantized checkpoint holds expert by expert, replayed alone
    on the golden expert's input (``moe.expert_linear_errors``)."""

    name: str = field(metadata=_doc("the Linear layer as the model names it"))
    expert: int
    projection: str = field(metadata=_doc("gate_proj, up_proj or down_proj"))
    tokens: int
    rel_l2: float = field(metadata=_doc("its own error (the larger of whole-output and per-token)"))
    typical: float | None = field(default=None, metadata=_doc(
        "the median own error of the same projection in the module's other experts"))
    score: float | None = field(default=None, metadata=_doc("rel_l2 / typical"))


@dataclass
class RoutedToken:
    """A token whose experts differ under the target's own routing."""

    position: int
    golden_experts: list[int]
    target_experts: list[int]
    text: str


@dataclass
class RoutingRow:
    """Routing flips that move an MoE block's output beyond its own rounding (``moe.routing_divergences``)."""

    module: str
    step: int
    tokens: list[RoutedToken]
    output_error_with_target_routing: float
    output_error_with_golden_routing: float
    detail: str


@dataclass
class TokenRow:
    """The logits of one aligned step: tokens, top-2 margin, KL and the compare's metrics and verdict."""

    step: int
    target_step: int
    golden_token: int | None = None
    golden_text: str | None = None
    target_token: int | None = None
    target_text: str | None = None
    same_token: bool = True
    golden_margin: float | None = None
    kl: float | None = None
    cosine_similarity: float | None = None
    max_relative_error: float | None = None
    mean_relative_error: float | None = None
    max_absolute_error: float | None = None
    mean_absolute_error: float | None = None
    kl_divergence: float | None = None
    relative_euclidean_distance: float | None = None
    rmse: float | None = None
    one_thousandth_err_ratio: float | None = None
    five_thousandths_err_ratio: float | None = None
    golden_max: float | None = None
    golden_min: float | None = None
    golden_mean: float | None = None
    golden_norm: float | None = None
    target_max: float | None = None
    target_min: float | None = None
    target_mean: float | None = None
    target_norm: float | None = None
    golden_nan: int = 0
    golden_inf: int = 0
    target_nan: int = 0
    target_inf: int = 0
    numel: int = 0
    shape_mismatch: bool = False
    dtype_mismatch: bool = False
    code: str = "ok"
    reason: str = ""
    verdict: str = field(default="pass", metadata=_doc("pass, warn or fail at the target dtype's thresholds"))


@dataclass
class ModelRuns:
    """What the bisect ran: generations, models loaded, layers recomputed, replays."""

    full_generations: int
    models_loaded_by_bisect: int
    golden_layers_recomputed: int = field(metadata=_doc(
        "golden decoder-layer runs from the golden dump's layer inputs: one per layer at an isolation "
        "replay, one per layer and step for the own error per step"))
    golden_reruns: int
    module_replays: int
    op_replays: int
    golden_weights: Literal["whole", "streamed"] | None = field(
        default=None, metadata=_doc("how the bisect held the golden: whole, or streamed layer by layer"))


@dataclass
class Cost:
    """Bytes and model runs the bisect spent, against an estimate of a full API-level dump."""

    model_runs: ModelRuns
    bytes_dumped: int
    golden_dump_bytes: int
    target_dump_bytes: int
    full_api_dump_bytes_estimate: int | None = field(default=None, metadata=_doc(
        "bytes an API-level dump of every step would write on both sides, from one run of the target (the "
        "golden runs the same ops in its own dtype)"))
    full_api_dump_estimate_method: str | None = field(
        default=None, metadata=_doc('"one layer x N" (extrapolated from the first layer) or "every op"'))
    bytes_fraction_of_full_api_dump: float | None = None
    bisect_seconds: float = 0.0
    bisect_phase_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class OverflowOp:
    """The first target op whose output holds NaN or +Inf from inputs that hold none."""

    name: str
    api: str
    dtype: str
    nan: int
    inf: int
    numel: int
    input_max_abs: float = field(metadata=_doc("the largest finite |value| among its inputs (nan: none)"))


@dataclass
class ScanOrigin:
    """The overflow scan's first origin of a non-finite value in the target dump."""

    name: str
    kind: str
    step: int
    rank: int = 0
    max_abs: float | None = None
    module_type: str | None = None
    module: str | None = None


@dataclass
class Overflow:
    """Modules whose replay on finite golden inputs gives Inf/NaN, in execution order, and what else
    points at an overflow (``conclude.overflow_evidence``)."""

    modules: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    nonfinite: dict[str, int | None] = field(default_factory=dict, metadata=_doc("module -> Inf/NaN values"))
    op: OverflowOp | None = None
    scan_origin: ScanOrigin | None = None
    scan_agrees: bool | None = field(
        default=None, metadata=_doc("the scan's origin is the blamed module, an ancestor or a descendant"))


@dataclass
class HandedDown:
    """A module handed a keyword input unlike the one its enclosing module was given, where the
    golden's passes it on unchanged (``localize/handed_down.py``): read from the two dumps."""

    module: str = field(metadata=_doc("the module handed the changed input (the golden's name)"))
    enclosing: str = field(metadata=_doc("the enclosing module that was given the original"))
    input: str = field(metadata=_doc('the keyword input, as the dumps index it ("kw:position_embeddings.1")'))
    step: int = field(metadata=_doc("the golden step it was found at"))
    target_step: int
    rank: int
    difference: float | None = field(metadata=_doc(
        "relative L2 distance of a floating input from the enclosing module's, the share of elements "
        "changed of an integer or boolean one (null: a non-finite value changed, or its size)"))
    limit: float = field(metadata=_doc("the difference a cast on the way stays within"))
    shape: list[int] | None = None


@dataclass
class TeacherForced:
    """Where the texts part with nothing standing out: the target run once more on the golden's
    tokens (teacher-forced), its logits at each step after the part against the golden dump's, so
    a fault that first shows after the texts part is not passed unseen."""

    after: int = field(metadata=_doc("the step where the texts part"))
    steps: list[int] = field(default_factory=list, metadata=_doc("the steps checked, each after the part"))
    failing: list[int] = field(default_factory=list, metadata=_doc("those whose logits fail the thresholds"))
    first_fail: int | None = field(default=None, metadata=_doc(
        "the first of them whose logits fail the thresholds (null: none)"))
    reason: str | None = field(default=None, metadata=_doc("the thresholds it fails, as a compare row says"))
    furthest: int | None = field(default=None, metadata=_doc(
        "the step whose logits are furthest from the golden's (relative L2): replayed where none fails"))


@dataclass
class DtypeBaselineStep:
    """The logits of one step, the target's and the golden model's own in the target's dtype, each
    against the golden dump's (last position, relative L2)."""

    step: int
    target_rel_l2: float | None
    baseline_rel_l2: float | None
    baseline_verdict: str = field(metadata=_doc("the golden model's own logits at the thresholds: pass, warn "
                                                "or fail"))


@dataclass
class DtypeBaseline:
    """Where a port's logits fail (or warn) and no module stands out: the golden model itself run in the
    target's dtype on the target's device, teacher-forced on the golden's tokens
    (``localize/dtype_baseline.py``); how far the target's logits are from the golden's, against how
    far that dtype's own rounding takes them."""

    dtype: str
    device: str
    on_target_device: bool = field(default=True, metadata=_doc(
        "run on the target's own device (false: a target known by its dump, run on the golden's)"))
    step: int = field(default=0, metadata=_doc(
        "the failing step the figures are of: the first the golden model's own error does not cover, else "
        "the first failing"))
    failing_steps: list[int] = field(default_factory=list, metadata=_doc(
        "the steps whose logits fail, up to where the texts part: each judged (where none fails, those "
        "whose logits warn: ``warning``)"))
    warning: bool = field(default=False, metadata=_doc(
        "no step's logits fail: the steps judged are those whose logits warn (a port error too small yet "
        "to fail the thresholds is told from the dtype's drift too)"))
    target_rel_l2: float | None = None
    baseline_rel_l2: float | None = None
    factor: float = field(default=2.0, metadata=_doc(
        "how many times the golden model's own error the target's may be and still be the dtype's own"))
    covers: bool = field(default=False, metadata=_doc(
        "at every failing step the target's error is within factor times the golden model's own: the "
        "dtype's drift"))
    steps: list[DtypeBaselineStep] = field(default_factory=list)
    error: str | None = field(default=None, metadata=_doc("why it could not be measured (null: it was)"))


@dataclass
class OpRef:
    """An op by name, API and output shape."""

    name: str
    api: str
    shape: list[int]


@dataclass
class OpLevel:
    """Whether the target computes the blamed module with the golden's ops (``ops.comparability``)."""

    comparable: bool
    reason: str | None = None
    first_difference: OpRef | None = field(
        default=None, metadata=_doc("the golden op the target has no counterpart for"))
    golden_ops_paired: int = 0
    target_ops_paired: int = 0
    golden_ops_around: list[OpRef] = field(default_factory=list)
    target_ops_around: list[OpRef] = field(default_factory=list)


#: the file beside verdict.json that holds the first bad op's tensors (``OpTensors``)
FIRST_BAD_OP_FILE = "first_bad_op.safetensors"


@dataclass
class OpTensors:
    """The first bad op's tensors as the bisect's op replay saw them, kept in a safetensors file
    beside verdict.json: its output on both sides (and its tensor inputs where they are small),
    keys ``golden.output.0``, ``target.output.0``, ``golden.input.1`` ..."""

    file: str = field(metadata=_doc("the safetensors file's name, beside verdict.json"))
    op: str = field(metadata=_doc("the op whose tensors these are (the first bad op)"))
    step: int = field(metadata=_doc("the step the op was replayed at"))
    tensors: list[str] = field(default_factory=list, metadata=_doc("the keys the file holds"))
    golden_op: str | None = field(
        default=None, metadata=_doc("the golden op paired with it (the value an op only the target runs "
                                    "rewrites, when the names differ)"))
    sampled: list[str] = field(
        default_factory=list,
        metadata=_doc("keys holding an evenly strided sample (flattened), not the whole tensor"))
    notes: list[str] = field(default_factory=list)


@dataclass
class OwnErrorStep:
    """The chosen module's own error at one step: replayed alone on the golden inputs of that step."""

    step: int
    own_error: float | None = field(metadata=_doc("the ranking's metric (null: not replayable at this step)"))
    peer_median: float | None = field(
        default=None, metadata=_doc("median own error of the same module in the other layers at this step"))
    peers: int = 0


@dataclass
class OwnErrorSteps:
    """The chosen module's own error per step, from the prefill on (``own_error_steps`` steps at most)."""

    module: str
    metric: str = field(
        metadata=_doc('"rel_l2" (the output) or "kv_cache_rel_l2" (what it wrote into its cache)'))
    rows: list[OwnErrorStep] = field(default_factory=list)
    source: str = "golden re-run"


@dataclass
class VerdictHead:
    """What verdict.json and summary.json's ``verdict`` block both hold: the status, the first bad
    token, layer, module and op, the diagnosis and the evidence behind it."""

    status: Status
    headline: str
    diagnosis: str
    replay: ReplayInfo
    first_mismatch_token: int | None = None
    first_bad_token: int | None = None
    first_bad_layer: str | None = None
    first_bad_module: str | None = None
    first_bad_op: str | None = None
    first_bad_expert: int | None = None
    first_bad_rank: int | None = field(default=None, metadata=_doc(
        "a tensor-parallel target: the rank whose shard's own error stands out in the first bad module "
        "(null: none does, or one rank)"))
    isolation: Literal["target_model", "target_dump"] = field(default="target_model", metadata=_doc(
        "target_model: each target module replayed on the golden inputs; target_dump: the golden module "
        "run on the inputs the target dump recorded"))
    inconclusive: Inconclusive | None = None
    token_detail: TokenDetail = field(default_factory=TokenDetail)
    evidence: list[Evidence] = field(default_factory=list)


@dataclass
class Verdict(VerdictHead):
    """verdict.json, written by the bisect stage: the status, the first bad token, layer, module and
    op, and the evidence behind them."""

    texts: Texts | None = None
    curves: dict[str, dict[str, dict[str, float]]] = field(
        default_factory=dict, metadata=_doc("metric -> series (raw, isolated) -> layer index -> error"))
    candidates: list[Candidate] = field(default_factory=list)
    ops: list[OpRow] = field(default_factory=list)
    experts: list[ExpertRow] = field(default_factory=list)
    expert_linears: list[ExpertLinearRow] = field(default_factory=list, metadata=_doc(
        "a quantized checkpoint's experts: each expert's Linear layers replayed alone"))
    routing: list[RoutingRow] = field(default_factory=list)
    token_rows: list[TokenRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cost: Cost | None = None
    overflow: Overflow = field(default_factory=Overflow)
    op_level: OpLevel | None = field(default=None, metadata=_doc("null when the op level did not run"))
    first_bad_op_tensors: OpTensors | None = field(
        default=None, metadata=_doc("the first bad op's tensors kept beside verdict.json (null: none kept)"))
    own_error_steps: OwnErrorSteps | None = field(
        default=None, metadata=_doc("the chosen module's own error per step (null: not measured)"))
    skipped: dict[str, str] = field(default_factory=dict, metadata=_doc(
        "phase (op_level, own_error_steps, cost_estimate) -> why it did not run"))
    handed_down: HandedDown | None = field(default=None, metadata=_doc(
        "where no module stands out: a module handed a keyword input its enclosing module was given "
        "otherwise (null: none found, or not checked)"))
    teacher_forced: TeacherForced | None = field(default=None, metadata=_doc(
        "where the texts part with nothing standing out: the target's logits on the golden's tokens after "
        "the part (null: not run)"))
    dtype_baseline: DtypeBaseline | None = field(default=None, metadata=_doc(
        "where the logits fail and no module stands out: the golden model itself in the target's dtype "
        "(null: not measured)"))


#: the name the bisect has always returned
BisectResult = Verdict


@dataclass
class VerdictSummary(VerdictHead):
    """What summary.json repeats of verdict.json (under ``verdict``): the headline fields, the
    evidence, and both generated texts."""

    routing: list[RoutingRow] = field(default_factory=list)
    cost: Cost | None = None
    overflow: Overflow = field(default_factory=Overflow)
    op_level: OpLevel | None = None
    texts: dict[str, str] | None = field(default=None,
                                         metadata=_doc("side (golden, target) -> generated text"))

    @classmethod
    def of(cls, verdict: Verdict) -> VerdictSummary:
        """The summary of ``verdict`` (the same objects, not copies)."""
        shared = {f: getattr(verdict, f) for f in cls.__dataclass_fields__ if f != "texts"}
        texts = None
        if verdict.texts is not None:
            texts = {"golden": verdict.texts.golden.text, "target": verdict.texts.target.text}
        return cls(**shared, texts=texts)
