"""Where the two runs' texts part, and which compare rows that makes meaningless to rank.

Golden and target generate greedily from the same prompt. Step ``n`` (0: the prefill) produces
token ``n``; once token ``d`` differs, every later step runs the two models on different input
tokens, so its rows differ whatever the kernels do. Such rows are *diverged*: the CSV marks them,
and they are never a first failing row, a summary's worst row or a heat map's first failing cell.

The first differing token comes from the token ids each side generated: the dump stage writes them
to ``generation.json`` beside its dump directory (``<stage>/generation.json``, the dump in
``<stage>/dump``), so a compare of two such dumps finds them without being told.

Two runs given different inputs (another prompt, chat template, BOS token or tokenizer) differ
at every step, and no row of theirs says anything of the target's kernels: ``different_inputs``
says why, from the prompts' token ids the generation records hold, else from the first integer
input each dump records at the prefill (the model's token ids).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from llmflow.formats.base import DumpReader, Entry, api_of
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
    """Where the texts part (``first_differing_token``: None when they agree) when both dumps have
    the generation record beside them; None when either lacks it (nothing is marked diverged)."""
    files = generation_beside(golden_dump), generation_beside(target_dump)
    if files[0] is None or files[1] is None:
        return None
    ids = output_ids(files[0]), output_ids(files[1])
    if ids[0] is None or ids[1] is None:
        return None
    return Divergence(first_differing_token=first_mismatch(ids[0], ids[1]), golden_file=str(files[0]),
                      target_file=str(files[1]))


def token_ids_entry(entries: Iterable[Entry]) -> Entry | None:
    """The token ids a step's forward pass starts from: the first integer input 0 of an embedding
    (a module whose type ends in ``Embedding``, rotary ones aside, or the ``embedding`` API)."""
    found = None
    for e in entries:
        if e.kind != "input" or e.index != "0" or e.dtype not in _INTEGER_DTYPES or not e.shape:
            continue
        mtype = e.module_type or ""
        api = api_of(e.name) if e.level == "api" else ""
        if ((e.level == "module" and mtype.endswith("Embedding") and "Rotary" not in mtype)
                or api == "embedding") and (found is None or e.order < found.order):
            found = e
    return found


def _last_tokens_differ(golden: DumpReader, g: Entry, target: DumpReader, t: Entry) -> bool | None:
    """Whether the last position's token ids differ (the token the previous step chose, whether a
    step feeds the new token alone or the whole sequence again); None: the entries cannot say."""
    if g.has_data and t.has_data:
        a, b = golden.load(g), target.load(t)
        if a.dim() == 0 or b.dim() == 0 or a.shape[:-1] != b.shape[:-1]:
            return None
        return not torch.equal(a[..., -1].to(torch.int64), b[..., -1].to(torch.int64))
    if g.stats and t.stats and g.shape and t.shape and g.shape[-1] == 1 and t.shape[-1] == 1:
        # one new token per row: max, min and mean are the ids themselves (batch 1: exact)
        keys = [k for k in ("max", "min", "mean") if k in g.stats and k in t.stats]
        return any(g.stats[k] != t.stats[k] for k in keys) if keys else None
    return None


def divergence_in_dumps(golden: DumpReader, target: DumpReader, step_pairs: list[dict[str, int]],
                        rank: int = 0) -> Divergence | None:
    """Where the texts part, from the token ids each dump records at every step: step ``s`` starts
    from the token step ``s - 1`` chose, so the first step whose ids differ dates the first
    differing token. None where the dumps cannot say for every step up to it (no embedding
    input recorded, a step missing on a side, statistics of a whole sequence), or the ids agree.

    What dumps from other tools need (msprobe, msit, ATB): they carry no generation record."""
    by_step: dict[tuple[DumpReader, int], list[Entry]] = {}
    for reader in (golden, target):
        for e in reader.entries():
            if e.rank == rank and e.kind == "input":
                by_step.setdefault((reader, e.step), []).append(e)
    steps = {int(p["golden_step"]): int(p["target_step"]) for p in step_pairs}
    step = 1
    while step in steps:  # every step from 1 on, none skipped: a gap could hide an earlier part
        g = token_ids_entry(by_step.get((golden, step), ()))
        t = token_ids_entry(by_step.get((target, steps[step]), ()))
        if g is None or t is None:
            return None
        differ = _last_tokens_differ(golden, g, target, t)
        if differ is None:
            return None
        if differ:
            return Divergence(first_differing_token=step - 1, golden_file=None, target_file=None,
                              source=f"read from the token ids the dumps record every step: {g.name} input 0")
        step += 1
    return None


def is_diverged(step: Any, first_differing_token: int | None) -> bool:
    """Whether a row of golden step ``step`` ran on inputs that already differ."""
    return first_differing_token is not None and isinstance(step, int) and step > first_differing_token


def different_inputs(golden: DumpReader, target: DumpReader, target_prefill: int | None) -> str | None:
    """Why the two runs were not given the same inputs, or None where nothing says so: the
    prompts' token ids of their generation records, else ``input_difference`` at the prefill
    (``target_prefill``: the target's step paired with the golden's step 0; None: not compared)."""
    files = generation_beside(golden.path), generation_beside(target.path)
    if files[0] is not None and files[1] is not None:
        prompts = output_ids(files[0], "input_ids"), output_ids(files[1], "input_ids")
        if prompts[0] is not None and prompts[1] is not None and prompts[0] != prompts[1]:
            return (f"their prompts' token ids differ ({len(prompts[0])} and {len(prompts[1])} tokens; "
                    f"{files[0]}, {files[1]})")
    if target_prefill is None:
        return None
    try:
        return input_difference(golden, target, target_prefill)
    except Exception:  # (a tensor that cannot be read says nothing of the inputs: its own row says why)
        return None


_INTEGER_DTYPES = {"int64", "int32", "int16", "uint8", "int8"}


def input_difference(golden: DumpReader, target: DumpReader, target_step: int = 0) -> str | None:
    """Why the two runs were not given the same inputs, or None where nothing says so.

    The first integer tensor the golden's prefill records as an input (the model's token ids, or
    a decoder layer's positions where only the layers were dumped) against the target's entry of
    the same module and argument: a different shape or different values mean the two runs read
    different token ids (another prompt, chat template, BOS token or tokenizer), and every module
    error after it compares different computations. Nothing is claimed where the target records
    no such entry (another format, other names) or neither side holds its values or statistics.
    """
    first = min((e for e in golden.entries() if e.step == 0 and e.rank == 0 and e.kind == "input"
                 and e.dtype in _INTEGER_DTYPES and e.shape is not None),
                key=lambda e: e.order, default=None)
    if first is None:
        return None
    other = next((e for e in target.entries() if e.step == target_step and e.rank == 0
                  and e.kind == "input" and e.name == first.name and e.index == first.index
                  and e.shape is not None), None)
    if other is None:
        return None
    what = f"{first.name} input {first.index}"
    if tuple(first.shape) != tuple(other.shape):
        return f"{what} has shape {list(first.shape)} in the golden and {list(other.shape)} in the target"
    if first.has_data and other.has_data:
        g, t = golden.load(first).to(torch.int64), target.load(other).to(torch.int64)
        if torch.equal(g, t):
            return None
        at = int((g.reshape(-1) != t.reshape(-1)).nonzero()[0])
        return (f"{what} differs at position {at} of {g.numel()} (golden {g.reshape(-1)[at].item()}, "
                f"target {t.reshape(-1)[at].item()})")
    if first.stats and other.stats:
        differ = [k for k in ("max", "min", "mean") if k in first.stats and k in other.stats
                  and first.stats[k] != other.stats[k]]
        if differ:
            return (f"{what} has other statistics in the two dumps ({differ[0]}: golden "
                    f"{first.stats[differ[0]]}, target {other.stats[differ[0]]})")
    return None
