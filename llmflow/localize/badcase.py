"""Bad-case search: which prompts does the target get most wrong? (no dump involved)

Each prompt runs greedily on both sides (one at a time, as the dump stages run it), then both
models score the golden continuations in batches with left padding. Two measures per prompt:
  first_mismatch_token: the first generated step whose token differs (what a user sees);
  max_kl: the largest KL(golden || target) of the next-token distributions over the golden's
    continuation, both models teacher-forced on the same (golden) text, so every step compares
    the same context even after the generated texts part ways.
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


def _pad_id(tokenizer: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    return 0


def _left_pad(seqs: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def _cut(ids: list[int], eos: Any) -> list[int]:
    stops = set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1]
    return ids


@torch.no_grad()
def generate_batch(loaded: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations, one prompt at a time (cut after EOS).

    Not batched on purpose: left padding and a batch dimension change the kernels' shapes and so
    the low-precision rounding (seen on SmolLM2 bf16: the batched target kept the golden's text
    where the unbatched one, like the dump stage's run, differs at token 8). The first mismatch
    reported here must be the one the dump stages will then see. The scoring pass is batched.
    """
    from llmflow.models import greedy_generate

    eos = getattr(loaded.tokenizer, "eos_token_id", None)
    return [_cut(greedy_generate(loaded.model, p, max_new_tokens, eos_token_id=eos), eos) for p in prompts]


@torch.no_grad()
def teacher_forced_logits(loaded: Any, seqs: list[list[int]]) -> torch.Tensor:
    """Logits [batch, width, vocab] (float32, CPU) of left-padded sequences, positions from the mask."""
    from llmflow.models import logits_of

    ids, mask = _left_pad(seqs, _pad_id(loaded.tokenizer), loaded.device)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    try:
        out = loaded.model(input_ids=ids, attention_mask=mask, position_ids=pos)
    except TypeError:  # a plain module without HF keyword arguments: no padding support
        out = loaded.model(ids)
    return logits_of(out).float().cpu()


def score_batch(golden: Any, target: Any, prompts: list[list[int]],
                max_new_tokens: int) -> list[dict[str, Any]]:
    """Rows (without rank) for one batch of encoded prompts."""
    g_new = generate_batch(golden, prompts, max_new_tokens)
    t_new = generate_batch(target, prompts, max_new_tokens)
    seqs = [p + g for p, g in zip(prompts, g_new, strict=True)]
    g_logits, t_logits = teacher_forced_logits(golden, seqs), teacher_forced_logits(target, seqs)
    width = g_logits.shape[1]
    rows = []
    for i, (p, g, t) in enumerate(zip(prompts, g_new, t_new, strict=True)):
        if not g:
            kls: list[float] = []
        else:
            # position j (unpadded) predicts token j+1; generated token k sits at len(p)+k
            start = width - len(seqs[i]) + len(p) - 1
            gl = torch.log_softmax(g_logits[i, start:start + len(g)].double(), -1)
            tl = torch.log_softmax(t_logits[i, start:start + len(g)].double(), -1)
            kls = (gl.exp() * (gl - tl)).sum(-1).clamp_min(0).tolist()
        flip = next((k for k in range(len(g)) if int(tl[k].argmax()) != g[k]), None) if g else None
        rows.append({"first_mismatch_token": first_mismatch(g, t),
                     "first_flip_teacher_forced": flip,
                     "max_kl": max(kls) if kls else 0.0,
                     "max_kl_step": int(max(range(len(kls)), key=kls.__getitem__)) if kls else None,
                     "mean_kl": sum(kls) / len(kls) if kls else 0.0,
                     "golden_ids": g, "target_ids": t})
    return rows


def run_badcase(golden: Any, target: Any, prompts: list[str], *, max_new_tokens: int, batch_size: int,
                chat_template: bool = True,
                advance: Callable[[float], None] | None = None) -> list[dict[str, Any]]:
    """Score every prompt; rows ranked worst first (max_kl descending, then earliest mismatch)."""
    from llmflow.models import encode_prompt

    rows: list[dict[str, Any]] = []
    batched = hasattr(golden.model, "generate") and hasattr(target.model, "generate")
    size = batch_size if batched else 1
    for start in range(0, len(prompts), size):
        chunk = prompts[start:start + size]
        encoded = [encode_prompt(golden.tokenizer, p, chat_template) for p in chunk]
        for prompt, row in zip(chunk, score_batch(golden, target, encoded, max_new_tokens), strict=True):
            dec = golden.tokenizer.decode
            rows.append({"prompt": prompt, **row, "golden_text": dec(row["golden_ids"]),
                         "target_text": dec(row["target_ids"])})
        if advance is not None:
            advance(len(chunk))
    big = 1 << 30
    rows.sort(key=lambda r: (-r["max_kl"], r["first_mismatch_token"] if r["first_mismatch_token"]
                             is not None else big))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return rows
