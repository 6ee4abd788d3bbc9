"""``CompareOptions``: everything ``compare_dumps`` can be told, declared once.

Each field carries its help text, its JSON-schema type when the ``compare`` stage takes it as a
parameter and its flags when ``llmflow compare`` offers it (msit llm compare's short flag first):
the stage's parameter schema and the CLI's arguments are generated from these declarations
(``llmflow.options``). This module imports nothing heavy, so the stage's schema costs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmflow.compare.algorithms import algorithm_name
from llmflow.compare.columns import known_metrics
from llmflow.compare.jumps import JUMP_RATIO, check_jump_ratio
from llmflow.compare.levels import LEVELS
from llmflow.compare.thresholds import check_dtype_name, check_thresholds, limited_metrics
from llmflow.errors import UserError
from llmflow.options import option

KL_CHOICES = ("all", "logits")  # rows that get the KL divergence: every one, or the logits rows only


@dataclass
class CompareOptions:
    """What to compare and how; each field's meaning is in its declaration below."""

    # the stage gets pairs, prefill_offset and warmup from the align stage (its pairs_file)
    pairs: list[dict[str, int]] | None = option(
        None, "Step pairs {golden_step, target_step} from the align stage (None: pair here, with "
        "prefill_offset and warmup).")
    levels: list[str] | None = option(
        None, "Levels to compare, one sheet each: logits, layer, module, api, save (default: all "
        "present).",
        schema={"type": ["array", "null"], "items": {"type": "string", "enum": list(LEVELS)}},
        flags=("-cl", "--cmp-level"), metavar="LEVEL")
    stats_only: bool = option(
        False, "Compare statistics (max, min, mean, norm) only.",
        schema={"type": "boolean"}, flags=("-st", "--stats"))
    kl: str = option(
        "all", "Rows that get the kl_divergence column: all, or logits (the logits rows only; the "
        "others leave it empty). The KL's exp is about half the compare's arithmetic on large "
        "tensors, so where the CPU bounds a compare, logits makes it 1.25-2x faster (docs/benchmarks.md).",
        schema={"type": "string", "enum": list(KL_CHOICES)}, flags=("--kl",))
    algorithms: list[str] = option(
        [], "Custom algorithms func(golden, target) -> (value, message): file.py:func or "
        "llmflow.algorithms names.",
        schema={"type": "array", "items": {"type": "string"}},
        flags=("-alg", "--custom-algorithms"), metavar="FILE.py:FUNC")
    mapping: str | None = option(
        None, "Op-mapping YAML/JSON file or llmflow.mappings name (e.g. atb-llama); default: by "
        "name, or a registered mapping that fits the target dump.",
        schema={"type": ["string", "null"]}, flags=("-mf", "--op-mapping-file"), metavar="MAPPING")
    rank: int | None = option(
        None, "Compare only this rank (default: all).",
        schema={"type": ["integer", "null"], "minimum": 0}, flags=("-r", "--rank"))
    workers: int | None = option(
        None, "Local workers (default: one per CPU core): processes for many small pairs, threads "
        "in one process otherwise.",
        schema={"type": ["integer", "null"], "minimum": 1}, flags=("--workers",))
    steps: list[int] | None = option(
        None, "Golden steps to compare (default: all).",
        schema={"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
        flags=("--steps",))
    prefill_offset: int = option(
        0, "Target folders that hold the prefill AND the first decode step (ATB: 1), when "
        "pairs are not given.",
        schema={"type": "integer", "minimum": 0}, stage=False, flags=("--prefill-offset",))
    warmup: int = option(
        0, "Warm-up steps at the start of the target dump (its first step folders, or the msprobe "
        "step numbers before the prompt's): skipped, golden step n pairs with target step n + warmup "
        "(when pairs are not given).",
        schema={"type": "integer", "minimum": 0}, stage=False, flags=("--warmup",))
    target_dtype: str | None = option(
        None, "The dtype whose thresholds judge float rows (default: the model dtype the dumps "
        "record, else each tensor's own).",
        schema={"type": ["string", "null"]}, flags=("--target-dtype",))
    thresholds: dict | None = option(
        None, "Verdict limits overriding the defaults: {metric: {warn, fail}} or {dtype: {metric: "
        "{warn, fail}}}; on the command line as JSON or a YAML/JSON file.",
        schema={"type": ["object", "null"]}, flags=("--thresholds",), metavar="JSON|FILE")
    jump_ratio: float | None = option(
        JUMP_RATIO, "A layer's row beyond a warn limit fails (error_jump) when its relative L2 error is "
        "this many times the same module's in the previous layer at the same step: the layer where "
        "a fault enters, though its error stays below the fail limits (default 5; 0 or null: off).",
        schema={"type": ["number", "null"], "minimum": 0}, flags=("--jump-ratio",), metavar="K")
    executor: str = option(
        "local", "local: this machine (a process pool where there are many small pairs); dask: an "
        "existing dask cluster.",
        schema={"type": "string", "enum": ["local", "dask"]}, flags=("--executor",))
    scheduler_address: str | None = option(
        None, "The dask scheduler (tcp://host:8786) for executor dask.",
        schema={"type": ["string", "null"]}, flags=("--scheduler-address",))
    xlsx: bool = option(
        True, "compare.xlsx (a sheet per level) beside the CSVs, written unless this is false: "
        "--no-xlsx skips it (CSVs only).",
        schema={"type": "boolean"}, flags=("--no-xlsx",))
    base_dir: str = option(".", "The directory relative file references (algorithms, mapping) "
                                "start from.")
    client: Any = option(None, "An existing dask.distributed Client (tests, notebooks).")
    final_dir: str | None = option(
        None, "Where the caller moves the output directory afterwards: the summary's paths name it.")

    def __post_init__(self) -> None:
        # an empty string means none: a workflow parameter's empty default ("mapping: ''")
        self.mapping = self.mapping or None
        self.target_dtype = self.target_dtype or None


def check_values(opts: CompareOptions, flags: dict[str, str] | None = None) -> list[str]:
    """Refuse bad option values (UserError naming the field) without loading anything: levels,
    the target dtype's name, the thresholds against the metric columns (the custom algorithms'
    named from their references), kl and jump_ratio. ``flags`` renames fields in messages
    (``{"target_dtype": "--target-dtype"}``). ``llmflow validate`` and ``run`` call it on a
    workflow's literal values before any stage runs; the compare calls it again on the final
    ones. Returns the algorithms' column names."""
    flags = flags or {}
    for lv in opts.levels or ():
        if lv not in LEVELS:
            raise UserError(f"{flags.get('levels', 'compare: levels')}: unknown level {lv!r} "
                            f"(known: {', '.join(LEVELS)})")
    if opts.target_dtype:
        where = flags.get("target_dtype", "compare: target_dtype")
        opts.target_dtype = check_dtype_name(opts.target_dtype, where)
    names = [algorithm_name(a) for a in opts.algorithms]
    check_thresholds(opts.thresholds, known_metrics(names), flags.get("thresholds", "thresholds"))
    if opts.kl not in KL_CHOICES:
        raise UserError(f"{flags.get('kl', 'compare: kl')}: expected one of {', '.join(KL_CHOICES)}, "
                        f"got {opts.kl!r}")
    if opts.kl == "logits" and "kl_divergence" in limited_metrics(opts.thresholds):
        kl = flags.get("kl", "kl")
        raise UserError(f"{flags.get('thresholds', 'thresholds')}: kl_divergence limits judge every row, "
                        f"but {kl} logits leaves the KL of every row but the logits empty: use {kl} all, "
                        "or drop the kl_divergence limits")
    opts.jump_ratio = check_jump_ratio(opts.jump_ratio, flags.get("jump_ratio", "compare: jump_ratio"))
    return names
