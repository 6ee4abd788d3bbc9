"""Bad-case search: which prompts does the target get most wrong? (no dump involved)

Each prompt runs greedily on both sides, alone and through the model's own decoding loop (prefill,
then one token at a time against the KV cache), as the dump stages run it: no padding, no batch,
so every forward call has the shapes, and the kernels, the dump stages will then see. Then the
target runs once more on the golden's continuation (teacher forcing through that same loop). Two
measures per prompt:
  first_mismatch_token: the first generated step whose token differs (what a user sees);
  max_kl: the largest KL(golden || target) of the next-token distributions over the golden's
    continuation, both on the same (golden) text, so every step compares the same context even
    after the generated texts part ways, and a decode-path fault (the kernel that attends one new
    token to the cache) counts as much as a prefill one.
Prompts are ranked by max_kl, worst first; the worst one is what a bisect should run on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmflow.errors import UserError
from llmflow.localize.tokens import first_mismatch


def load_prompts(prompts: list[str] | str, base: Path) -> list[str]:
    """An inline list of prompts, or a JSONL file of ``{"prompt": ...}`` lines (relative to base)."""
    if isinstance(prompts, list):
        out = [str(p) for p in prompts]
    else:
        path = Path(prompts).expanduser()
        path = path if path.is_absolute() else base / path
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UserError(f"badcase: prompts: cannot read {path}: {exc.strerror or exc}") from exc
        out = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{n}: not JSON ({exc.msg})") from exc
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise UserError(f'{path}:{n}: expected {{"prompt": "..."}}')
            out.append(item["prompt"])
    if not out:
        raise UserError("badcase: prompts: no prompts given")
    return out


def _cut(ids: list[int], eos: Any) -> list[int]:
    stops = set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1]
    return ids


@torch.no_grad()
def score_prompt(golden: Any, target: Any, prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
    """One prompt's row (without rank): both sides' greedy text, and the target's logits along the
    golden's continuation against the golden's own."""
    from llmflow.models import greedy_steps

    g_eos = getattr(golden.tokenizer, "eos_token_id", None)
    t_eos = getattr(target.tokenizer, "eos_token_id", None)
    g_all, g_logits = greedy_steps(golden.model, prompt, max_new_tokens, eos_token_id=g_eos, keep_logits=True)
    g = _cut(g_all, g_eos)
    t = _cut(greedy_steps(target.model, prompt, max_new_tokens, eos_token_id=t_eos)[0], t_eos)
    kls: list[float] = []
    flip = None
    if g:
        _, t_logits = greedy_steps(target.model, prompt, max_new_tokens, eos_token_id=t_eos, force_ids=g,
                                   stop_after=len(g), keep_logits=True)
        n = min(len(g), g_logits.shape[0], t_logits.shape[0])  # type: ignore[union-attr]
        gl = torch.log_softmax(g_logits[:n].double(), -1)  # type: ignore[index]
        tl = torch.log_softmax(t_logits[:n].double(), -1)  # type: ignore[index]
        kls = (gl.exp() * (gl - tl)).sum(-1).clamp_min(0).tolist()
        flip = next((k for k in range(n) if int(tl[k].argmax()) != g[k]), None)
    return {"first_mismatch_token": first_mismatch(g, t),
            "first_flip_teacher_forced": flip,
            "max_kl": max(kls) if kls else 0.0,
            "max_kl_step": int(max(range(len(kls)), key=kls.__getitem__)) if kls else None,
            "mean_kl": sum(kls) / len(kls) if kls else 0.0,
            "golden_ids": g, "target_ids": t}


def run_badcase(golden: Any, target: Any, prompts: list[str], *, max_new_tokens: int,
                chat_template: bool = True,
                advance: Callable[[float], None] | None = None) -> list[dict[str, Any]]:
    """Score every prompt; rows ranked worst first (max_kl descending, then earliest mismatch)."""
    from llmflow.models import check_context, encode_prompt

    encoded = [encode_prompt(golden.tokenizer, p, chat_template) for p in prompts]
    for i, ids in enumerate(encoded):  # every prompt before the first runs: a long one is bad input
        for side in (golden, target):
            check_context(side, len(ids), max_new_tokens, f"badcase: prompt {i + 1} of {len(prompts)}")
    rows: list[dict[str, Any]] = []
    for prompt, ids in zip(prompts, encoded, strict=True):
        row = score_prompt(golden, target, ids, max_new_tokens)
        dec = golden.tokenizer.decode
        rows.append({"prompt": prompt, **row, "golden_text": dec(row["golden_ids"]),
                     "target_text": dec(row["target_ids"])})
        if advance is not None:
            advance(1)
    big = 1 << 30
    rows.sort(key=lambda r: (-r["max_kl"], r["first_mismatch_token"] if r["first_mismatch_token"]
                             is not None else big))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return rows
