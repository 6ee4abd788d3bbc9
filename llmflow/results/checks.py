"""The blocks the check stages and the dump stage put into summary.json.

Each stage builds its block as one of these types and stores it with ``to_json``; ``RunSummary``
(``llmflow.results.summary``) reads the fixed-key blocks back as the same types. A dump stage's
block sits under the stage's own id, so ``RunSummary`` cannot name it: ``DumpStageBlock`` reads
it (``read_run_summary`` returns it among the other stages' blocks). Field order is the file's
key order; a value a stage does not have is null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from llmflow.results.compare import OutcomeStatus, doc

# --------------------------------------------------------------------------- precheck


@dataclass
class PrecheckCall:
    """A checked API call as the summary repeats it (a row of precheck.csv, in part)."""

    name: str = doc("The call's name as in precheck.csv.")
    module: str | None = doc("The module the call ran in.")
    api: str = doc("The API called (torch.matmul, ...).")
    step: int
    rank: int
    ratio: float | None = doc("The call's error over the benchmark's (its CPU float64 replay's).")
    reason: str | None = doc("What tripped, in words.")


@dataclass
class PrecheckRepro:
    """A repro folder the precheck wrote for one call at one step."""

    name: str
    step: int
    status: str = doc("The call's status: pass, warn, fail or not checked.")
    script: str = doc("repro.py, relative to the stage's output folder.")


@dataclass
class MissingRepro:
    """A call a repro was asked for that got none."""

    name: str
    why: str


@dataclass
class PrecheckBlock:
    """The precheck stage: every API call of a dump replayed on the CPU against its benchmark."""

    status: OutcomeStatus
    totals: dict[str, int] = doc("Calls by their worst row: calls, checked, pass, warn, fail, not checked.")
    counts: dict[str, dict[str, int]] = doc("API -> calls by status (pass, warn, fail, not checked).")
    first_fail: PrecheckCall | None = doc("The first failing call in model order.")
    perturbed: list[str] = doc("Calls perturbation flags as ill-conditioned (with perturb: true).")
    repros: list[PrecheckRepro]
    repros_missing: list[MissingRepro] = doc("Requested calls that got no repro folder, with the reason.")


# --------------------------------------------------------------------------- weight compare


@dataclass
class WorstWeight:
    """The worst compared tensor of a weight compare (a row of weights.csv, in part)."""

    name: str
    verdict: str = doc("pass, warn or fail.")
    cosine_similarity: float | None
    relative_euclidean_distance: float | None
    max_absolute_error: float | None
    quant_type: str | None = doc("The target's quantization type (msModelSlim), null for a float tensor.")
    scheme: str | None = doc("How the target tensor was dequantized (float for a plain tensor).")
    sibling_score: float | None = doc("Its relative distance over the median of the same role in the "
                                      "other layers; null when not judged against siblings.")
    reason: str | None = doc("What tripped, in words.")


@dataclass
class WeightProblem:
    """A tensor that could not be compared: missing on a side, unsupported, a shape mismatch."""

    name: str
    status: str = doc("missing_in_target, missing_in_golden, unsupported, compressed or shape_mismatch.")
    reason: str | None


@dataclass
class WeightCompareBlock:
    """The weight-compare stage: two checkpoints (or a dump's weights) tensor by tensor."""

    counts: dict[str, int] = doc("tensors, companion_tensors, tensors per status and compared tensors per "
                                 "verdict.")
    worst: WorstWeight | None = doc("The worst compared tensor; null when none was compared.")
    problems: list[WeightProblem] = doc("The first 50 tensors that could not be compared.")


# --------------------------------------------------------------------------- env diff


@dataclass
class EnvDifference:
    """One key whose value differs between the two environments."""

    key: str = doc("The flattened key (section.name).")
    section: str
    golden: Any = doc("The golden's value; null when it lacks the key.")
    target: Any = doc("The target's value; null when it lacks the key.")
    missing: Literal["golden", "target"] | None = doc("The side that lacks the key.")
    numerics_relevant: bool = doc("The setting can change the numbers.")
    reason: str = doc("Why it is (or is not) numerics-relevant.")


@dataclass
class EnvDiffBlock:
    """The env-check stage: the differences between two environments, numerics-relevant first."""

    differences: int
    numerics_relevant: int
    items: list[EnvDifference] = doc("The first 50 differences (env_diff.json holds them all).")
    truncated: bool = doc("True when items holds only the first 50.")


# --------------------------------------------------------------------------- badcase


@dataclass
class BadcaseRank:
    """One prompt of the badcase ranking (a row of ranking.json, in part)."""

    rank: int = doc("1: the worst prompt.")
    prompt: str
    first_mismatch_token: int | None = doc("The first generated token that differs; null when none does.")
    max_kl: float = doc("The largest KL divergence of the logits over the generated steps.")
    max_kl_step: int | None


@dataclass
class BadcaseBlock:
    """The badcase stage: prompts ranked by how far the target's logits part from the golden's."""

    prompts: int = doc("How many prompts were run.")
    worst_prompt: str
    ranking: list[BadcaseRank] = doc("The first 10 of the ranking, worst first.")


# --------------------------------------------------------------------------- dump


@dataclass
class DumpTotals:
    """What a dump stage wrote."""

    bytes: int
    entries: int = doc("Tensors (or statistics records) written.")
    steps: int = doc("Generation steps: one per generated token.")
    text: str = doc("The generated text.")
    truncated: bool = doc("True when a dump limit stopped the dump early.")


@dataclass
class DumpStageBlock:
    """A dump stage's block, under the stage's id."""

    dump: DumpTotals
