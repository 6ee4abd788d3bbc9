"""Token level: which generated token is the first to go wrong, from the per-step logits.

Two answers, because they differ:
  first_mismatch_token: the first step whose greedy token differs (what the user sees);
  first_bad_token: the first step whose logits fail the compare thresholds for the target dtype.
It can be earlier: logits drift at step 1 but the argmax only flips at step 3 when the golden's
top-2 margin is small. The margin is reported too: a flip on a 0.01-logit margin is noise
deciding a coin toss, a flip on a 5-logit margin is a real fault.

Steps after the first mismatch compare logits of different contexts (each side continues its own
text): they are reported, but never picked as the first bad token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from llmflow.compare.divergence import first_mismatch  # noqa: F401  (re-exported: the bisect reads it here)
from llmflow.formats.base import DumpReader, Entry
from llmflow.results.verdict import TokenRow

#: the compare metrics a token row carries (every field of TokenRow that ``compare_tensors`` fills; the
#: code, reason and verdict come from judging them at the target dtype, as the compare's rows do)
_ROW_OWN = {"step", "target_step", "golden_token", "golden_text", "target_token", "target_text", "same_token",
            "golden_margin", "kl", "code", "reason", "verdict"}
METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(TokenRow) if f.name not in _ROW_OWN)


def logits_entries(reader: DumpReader, rank: int = 0) -> dict[int, Entry]:
    """Step -> the logits entry of that step (level ``logits``)."""
    return {e.step: e for e in reader.entries()
            if e.level == "logits" and e.rank == rank and e.kind == "output" and e.has_data}


def kl_divergence(golden: torch.Tensor, target: torch.Tensor) -> float:
    """KL(p_golden || p_target) of the softmax distributions, in nats (float64)."""
    g = torch.log_softmax(golden.detach().to(torch.float64).reshape(-1), dim=-1)
    t = torch.log_softmax(target.detach().to(torch.float64).reshape(-1), dim=-1)
    return float((g.exp() * (g - t)).sum().clamp_min(0.0))


def top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit: how close the greedy choice was to flipping."""
    top = torch.topk(logits.detach().float().reshape(-1), 2).values
    return float(top[0] - top[1])


def token_rows(golden: DumpReader, target: DumpReader, *, golden_ids: list[int], target_ids: list[int],
               pairs: list[dict[str, int]] | None = None, target_dtype: str = "bfloat16",
               thresholds: dict[str, Any] | None = None,
               decode: Callable[[int], str] | None = None) -> list[TokenRow]:
    """One row per aligned step: tokens, top-2 margin, KL, the compare metrics and their judgement
    at ``target_dtype`` (code, reason and verdict, as the compare's logits rows say them)."""
    from llmflow.compare.metrics import compare_tensors
    from llmflow.compare.thresholds import judge

    g_log, t_log = logits_entries(golden), logits_entries(target)
    if pairs is None:
        pairs = [{"golden_step": s, "target_step": s} for s in sorted(set(g_log) & set(t_log))]
    rows = []
    for p in pairs:
        gs, ts = p["golden_step"], p["target_step"]
        if gs not in g_log or ts not in t_log:
            continue
        gl, tl = golden.load(g_log[gs])[0], target.load(t_log[ts])[0]
        metrics = compare_tensors(gl.float(), tl.float())
        judged = judge(metrics, target_dtype, thresholds)
        tokens: dict[str, Any] = {}
        for side, ids in (("golden", golden_ids), ("target", target_ids)):
            tok = ids[gs] if gs < len(ids) else None
            tokens[f"{side}_token"] = tok
            if decode is not None and tok is not None:
                tokens[f"{side}_text"] = decode(tok)
        rows.append(TokenRow(step=gs, target_step=ts, **tokens,
                             same_token=tokens["golden_token"] == tokens["target_token"],
                             golden_margin=top2_margin(gl), kl=kl_divergence(gl, tl),
                             **{k: metrics[k] for k in METRIC_FIELDS},
                             code=judged.code, reason=judged.reason, verdict=judged.verdict))
    return rows


def failing_steps(rows: list[TokenRow], first_mismatch_step: int | None, verdict: str = "fail") -> list[int]:
    """The steps whose logits fail (``verdict``: or warn), up to the first mismatching token, in order.

    After the texts part, each side continues its own text: a failing step there compares the
    logits of two different contexts, which says nothing about a fault, so it is not counted."""
    return [r.step for r in rows
            if r.verdict == verdict and (first_mismatch_step is None or r.step <= first_mismatch_step)]


def first_bad_step(rows: list[TokenRow], first_mismatch_step: int | None) -> int | None:
    """The first step whose logits fail, up to the first mismatching token (``failing_steps``)."""
    failing = failing_steps(rows, first_mismatch_step)
    return failing[0] if failing else None


def greedy_ids(reader: DumpReader, rank: int = 0) -> list[int]:
    """The token each step's logits choose (argmax of the last position), steps 0, 1, ... in order:
    what a greedy run generated, for dumps made without llmflow's generation file. It stops at the
    first step without logits: the list's positions are steps (a dump whose logits start at step 1
    would otherwise give step 1's token as step 0's)."""
    ids = []
    found = logits_entries(reader, rank)
    for step in range(len(found)):
        if step not in found:
            break
        logits = reader.load(found[step]).float()
        ids.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
    return ids
