"""What a compare concludes: ``compare_summary.json`` and the ``compare`` block of summary.json.

``llmflow.compare.summary`` fills a ``CompareSummary`` while the rows stream past and
``llmflow.compare.run`` writes it (``to_json``); the CLI, the spreadsheet's summary sheet and the
run's summary.json read the same type. Counts come from the rows' problem codes
(``llmflow.compare.codes``): ``counts`` are by verdict (pass, warn, fail, unmatched), ``codes`` by
code. Field order is the file's key order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmflow.errors import UserError
from llmflow.results.codec import from_json


def doc(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose description (the schema's) is ``text``; ``kwargs`` as ``field``'s."""
    return field(metadata={"doc": text}, **kwargs)


CompareVerdict = Literal["pass", "warn", "fail", "inconclusive"]
OutcomeStatus = Literal["pass", "inconclusive", "fail"]


@dataclass
class SummaryRow:
    """One compare row as the summary repeats it: where it is, its verdict and its main metrics.

    A metric the row has none of (an unmatched or statistics-only row, a NaN or Inf value) is null.
    """

    step: int | None = doc("The golden step (0: the prefill).")
    target_step: int | None
    rank: int | None
    order: int | None = doc("Execution order within (rank, step).")
    name: str | None = doc("The golden tensor's module or op name.")
    target_name: str | None
    kind: str = doc("input, output, ...")
    index: str | None
    verdict: str = doc("pass, warn, fail or unmatched.")
    code: str = doc("The problem code (llmflow.compare.codes).")
    reason: str | None = doc("What tripped, in words.")
    cosine_similarity: float | None = None
    relative_euclidean_distance: float | None = None
    max_absolute_error: float | None = None
    kl_divergence: float | None = None
    norm_rel_diff: float | None = doc("Statistics-only rows: the norms' relative difference.", default=None)
    diverged: bool | None = doc("A step after the first differing token: its inputs differ (null: the dumps "
                                "record no generation).", default=None)


@dataclass
class LevelSummary:
    """One level of the compare (logits, layer, module, api, save): counts and notable rows."""

    rows: int
    counts: dict[str, int] = doc("Rows per verdict: pass, warn, fail, unmatched.")
    codes: dict[str, int] = doc("Rows per problem code.")
    match: dict[str, int] = doc("Paired rows per way of matching (name, order, mapping ...).")
    unmatched_golden: int
    unmatched_target: int
    diverged: int = doc("Rows of steps after the first differing token (their inputs differ): never "
                        "first_fail, first_warn or worst.")
    first_fail: SummaryRow | None = doc("The first failing row in execution order, before the texts part.")
    first_warn: SummaryRow | None = doc("The first warning row, as first_fail.")
    worst: list[SummaryRow] = doc("The (at most ten) rows of lowest cosine similarity, worst first.",
                                  default_factory=list)


@dataclass
class LogitsAgreement:
    """The greedy tokens of the logits rows: how often the two sides pick the same one."""

    steps: int
    top1_agreement: float = doc("The share of steps whose top-1 tokens agree.")
    first_token_mismatch_step: int | None
    mean_kl_divergence: float | None


@dataclass
class TensorParallel:
    """A tensor-parallel target's ranks joined to pair with a one-device golden."""

    ranks: int
    joined: dict[str, int] = doc("Pairs per way of joining (concatenated, replicated, sum).")


@dataclass
class Matching:
    """How golden and target tensors were paired: by name, or through a mapping (given or chosen)."""

    method: Literal["name", "mapping"]
    mapping: str | None
    chosen: Literal["given", "automatically"] | None
    vars: dict[str, Any] | None = doc("The mapping's variables, read from the target dump.", default=None)
    why: str | None = doc("Why the mapping was chosen, in words.", default=None)
    rows: dict[str, int] = doc("Paired rows per way of matching.", default_factory=dict)
    tensor_parallel: TensorParallel | None = None


@dataclass
class JudgedAs:
    """The dtype whose thresholds judge the float rows, and where it comes from."""

    dtype: str | None = doc("null: each tensor's own dtype.")
    given: str | None = doc("--target-dtype / target_dtype.")
    recorded: str | None = doc("The model dtype the dumps record (where neither records one: the dtype "
                               "most of their outputs are in).")
    source: str


@dataclass
class Divergence:
    """Where the two runs' texts part: from each dump's generation.json, else from the token ids
    each dump records at every step (the embedding's input: the token the previous step chose)."""

    first_differing_token: int | None = doc("null: the texts agree.")
    golden_file: str | None = doc("The golden's generation.json; null: read from the dumps' token ids.")
    target_file: str | None = doc("The target's generation.json; null: read from the dumps' token ids.")
    source: str = doc("Where it was read, in words.", default="the generation.json beside each dump")


@dataclass
class LevelCoverage:
    """Golden rows of one level by what became of them."""

    golden: int
    paired: int
    unpaired: int
    golden_only: int
    not_in_target: int


@dataclass
class Coverage:
    """Did the compare compare? Golden rows paired and not; incomplete fails the compare."""

    state: Literal["complete", "incomplete"]
    paired: int
    unpaired: int
    considered: int
    golden_only: int
    missing_step_rows: int
    levels: dict[str, LevelCoverage]
    levels_without_pairs: list[str]
    not_in_target: dict[str, int] = doc("Golden rows per '<level> <kind>' the target did not dump.")
    causes: list[str]
    headline: str | None = doc("Why it is incomplete (null: complete).")
    layers_not_in_target: list[str] = doc(
        "Golden decoder layers with no target row in a step both dumps hold (the compare is incomplete).",
        default_factory=list)
    steps_not_in_target: dict[str, list[int]] = doc(
        "Level -> golden steps at which the target, though it dumped that level, has no row of it "
        "(the compare is incomplete; --steps compares the steps both dumps hold).", default_factory=dict)
    ranks_not_in_target: list[int] = doc(
        "Golden ranks the target holds no row of (the compare is incomplete; -r compares a rank both "
        "hold).", default_factory=list)


@dataclass
class MissingStep:
    """A step of one dump with no partner step in the other."""

    side: Literal["golden", "target"] = doc("The dump that lacks the step.")
    golden_step: int | None = None
    target_step: int | None = None


@dataclass
class CompareOutcome:
    """The compare's conclusion: its status and the line that says it."""

    status: OutcomeStatus
    headline: str
    next: str = doc("For an inconclusive compare: what to run to get the evidence that is missing.",
                    default="")


@dataclass(kw_only=True)
class CompareSummary:
    """The compare's conclusion, counts, coverage and notable rows (``compare_summary.json``)."""

    verdict: CompareVerdict
    counts: dict[str, int] = doc("Rows per verdict (a row of several levels once).")
    codes: dict[str, int] = doc("Rows per problem code (llmflow.compare.codes).")
    levels: dict[str, LevelSummary]
    logits: LogitsAgreement | None = doc("null (or absent): no logits rows were compared.", default=None)
    golden_dump: str
    target_dump: str
    golden_format: str
    target_format: str
    mapping: str | None = doc("The op-mapping in use (null: names).")
    matching: Matching
    judged_as: JudgedAs
    divergence: Divergence | None = doc("Where the texts part; null when neither a generation record nor the "
                                        "dumps' token ids at every step say.")
    levels_without_rows: dict[str, str] = doc("Asked-for levels no pair belongs to, and why.")
    coverage: Coverage
    problems: dict[str, list[str]] = doc("What keeps each dump from being whole (golden, target).")
    algorithms: list[str]
    missing_steps: list[MissingStep]
    pairs: int
    bytes: int = doc("Tensor bytes read.")
    seconds: float
    gb_per_s: float | None
    csv: dict[str, str] = doc("Level -> its CSV.")
    xlsx: str | None
    state: Literal["complete", "incomplete"] = doc("incomplete: most golden rows found no partner, or a "
                                                   "level paired nothing (the verdict is then fail).")
    outcome: CompareOutcome
    kl: Literal["all", "logits"] = doc("Rows that got the KL divergence: all, or the logits rows only "
                                       "(--kl logits).", default="all")
    different_inputs: str | None = doc(
        "Why the two runs were not given the same inputs (their prompts' token ids, or the first integer "
        "input each dump records at the prefill): every row then compares different computations and "
        "the compare is inconclusive; null: nothing says so.", default=None)


def read_compare_summary(path: str | Path) -> CompareSummary:
    """A ``compare_summary.json`` read back; a file that does not fit raises a one-line UserError
    naming the file and the field."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{p}: cannot read it as JSON ({getattr(exc, 'strerror', None) or exc})") from None
    return from_json(CompareSummary, data, where=str(p))
