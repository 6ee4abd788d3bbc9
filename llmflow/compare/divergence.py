"""Where the two runs' texts part, and which compare rows that makes meaningless to rank.

Golden and target generate greedily from the same prompt. Step ``n`` (0: the prefill) produces
token ``n``; once token ``d`` differs, every later step runs the two models on different input
tokens, so its rows differ whatever the kernels do. Such rows are *diverged*: the CSV marks them,
and they are never a first failing row, a summary's worst row or a heat map's first failing cell.

The first differing token comes from the token ids each side generated: the dump stage writes them
to ``generation.json`` beside its dump directory (``<stage>/generation.json``, the dump in
``<stage>/dump``), so a compare of two such dumps finds them without being told. The same file
holds the prompt's token ids: two runs given different prompts compared different inputs at
every step, and no row of theirs says anything about the target's kernels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmflow.results.compare import Divergence

GENERATION_FILE = "generation.json"


def first_mismatch(golden_ids: list[int], target_ids: list[int]) -> int | None:
    """The first step whose token differs (a shorter sequence differs where it ends); None when
    the two sequences are equal."""
    for i, (g, t) in enumerate(zip(golden_ids, target_ids, strict=False)):
        if g != t:
            return i
    return min(len(golden_ids), len(target_ids)) if len(golden_ids) != len(target_ids) else None


def generation_beside(dump_dir: str | Path) -> Path | None:
    """The dump stage's ``generation.json`` for a dump directory: inside it or beside it."""
    d = Path(dump_dir)
    for candidate in (d / GENERATION_FILE, d.parent / GENERATION_FILE):
        if candidate.is_file():
            return candidate
    return None


def output_ids(path: Path, key: str = "output_ids") -> list[int] | None:
    """The generated token ids a ``generation.json`` records (``key`` "input_ids": the prompt's);
    None when it records none (or is not one: a file of that name written by something else is
    not trusted)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ids = record.get(key) if isinstance(record, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return ids


def divergence(golden_dump: str | Path, target_dump: str | Path) -> Divergence | None:
    """Where the texts part (``first_differing_token``: None when they agree) and whether the
    prompts differ, when both dumps have the generation record beside them; None when either
    lacks it (nothing is marked diverged)."""
    files = generation_beside(golden_dump), generation_beside(target_dump)
    if files[0] is None or files[1] is None:
        return None
    ids = output_ids(files[0]), output_ids(files[1])
    if ids[0] is None or ids[1] is None:
        return None
    golden_prompt, target_prompt = output_ids(files[0], "input_ids"), output_ids(files[1], "input_ids")
    prompt_tokens = None
    if golden_prompt is not None and target_prompt is not None and golden_prompt != target_prompt:
        prompt_tokens = [len(golden_prompt), len(target_prompt)]
    return Divergence(first_differing_token=first_mismatch(ids[0], ids[1]), golden_file=str(files[0]),
                      target_file=str(files[1]), prompt_tokens=prompt_tokens)


def is_diverged(step: Any, first_differing_token: int | None) -> bool:
    """Whether a row of golden step ``step`` ran on inputs that already differ."""
    return first_differing_token is not None and isinstance(step, int) and step > first_differing_token
