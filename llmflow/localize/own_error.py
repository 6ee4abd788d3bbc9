"""The own error of one replayed output: how far a target module's output, computed from the golden
inputs, lies from the golden output. Every replay (module, MoE expert, op) is ranked by it."""

from __future__ import annotations

import math
from typing import Any

import torch

#: A row (the last dimension: one token's hidden vector) of fewer values than this is a handful of
#: roundings, not a token's output (a router's 8 expert logits, a one-value gate): such an output
#: is measured whole only.
TOKEN_ROW_MIN = 16
#: A token row's relative error divides by its golden norm, floored at this fraction of the median
#: row's norm, so that a row of almost nothing is not divided by almost nothing.
TOKEN_ROW_FLOOR = 0.1


def row_rel(g_rows: torch.Tensor, d_rows: torch.Tensor) -> torch.Tensor:
    """Each token row's relative error from the rows' golden norms and error norms, a row's norm
    floored at TOKEN_ROW_FLOOR x the median row's (the one definition ``token_rel`` and the MoE
    experts' tokens, ``moe.expert_token_error``, both use)."""
    return d_rows / g_rows.clamp(min=max(float(g_rows.median()) * TOKEN_ROW_FLOOR, 1e-30))


def token_row_errors(golden: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """``row_rel`` of each token row (the last dimension) of an output of at least two rows of
    TOKEN_ROW_MIN values, in float64 on CPU; None for another output or differing shapes."""
    width = golden.shape[-1] if golden.dim() else 1
    if golden.shape != target.shape or width < TOKEN_ROW_MIN or golden.numel() < 2 * width:
        return None
    g = golden.detach().to("cpu", torch.float64).reshape(-1, width)
    d = target.detach().to("cpu", torch.float64).reshape(-1, width) - g
    return row_rel(g.norm(dim=1), d.norm(dim=1))


def own_error(golden: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """The error metrics ranking and charts use (computed in float64, on CPU).

    rel_l2: the ranking key (scale-free, robust to a few outliers), the larger of ||t - g|| / ||g||
    and ``token_rel``; max_abs: max |t - g|; max_rel: max |t - g| / max |g|; cos_dist: 1 - cosine
    similarity; l2, norm: ||t - g|| and ||g|| themselves (ranking floors tiny norms with them);
    numel; nonfinite: how many of the target's values are Inf/NaN where the golden's are finite (an
    overflow; not where the golden's value is past bfloat16's range, a mask: ``_without_saturated``).
    Where there are any, every error metric is +inf: the output is infinitely wrong, never "no error"
    (a NaN would compare as neither large nor small).

    token_rel (an output of at least two rows of TOKEN_ROW_MIN values): the mean over its rows
    (tokens) of each row's own relative error. Measured whole, an output's error is its largest
    rows' error: real models carry massive activations (SmolLM2's layer 11 MLP sees 3065 at one
    prompt token, 1.5 at the others), and a kernel that loses every other token's output (an int8
    input scale set by that one token rounds the rest to zero) moved the whole tensor by 1.2%, the
    mean token by 97%. Where every token rounds alike, the two agree.
    """
    if golden.is_complex() or target.is_complex():  # complex angles (Llama 4's rotary): both parts
        golden, target = (torch.view_as_real(x.resolve_conj().reshape(*x.shape[:-1] or (1,), -1))
                          .flatten(-2) if x.is_complex() else x for x in (golden, target))
    g = golden.detach().to("cpu", torch.float64).reshape(-1)
    t = target.detach().to("cpu", torch.float64).reshape(-1)
    if g.shape != t.shape:
        return {"rel_l2": math.inf, "max_abs": math.inf, "max_rel": math.inf, "cos_dist": math.inf,
                "l2": math.inf, "norm": float(g.norm()), "numel": g.numel(), "nonfinite": 0}
    g, t = _without_saturated(g, t, target.dtype)
    nonfinite = int((~torch.isfinite(t) & torch.isfinite(g)).sum())
    if nonfinite:
        finite = g[torch.isfinite(g)]
        return {"rel_l2": math.inf, "max_abs": math.inf, "max_rel": math.inf, "cos_dist": math.inf,
                "l2": math.inf, "norm": float(finite.norm()), "numel": g.numel(), "nonfinite": nonfinite}
    d = t - g
    tiny = 1e-30
    width = golden.shape[-1] if golden.dim() else 1
    token_rel = None
    # each reduction once: on a 1B model's 200 replays they cost more than the replays (the row
    # norms give the whole norms too)
    if width >= TOKEN_ROW_MIN and g.numel() >= 2 * width:
        g_rows, d_rows = g.reshape(-1, width).norm(dim=1), d.reshape(-1, width).norm(dim=1)
        gn, l2 = float(g_rows.norm()), float(d_rows.norm())
        token_rel = float(row_rel(g_rows, d_rows).mean())
    else:
        gn, l2 = float(g.norm()), float(d.norm())
    cos = float(torch.dot(g, t) / max(gn * float(t.norm()), tiny)) if g.numel() else 1.0
    max_abs = float(d.abs().max()) if d.numel() else 0.0
    whole = l2 / max(gn, tiny)
    row = {"rel_l2": whole if token_rel is None else max(whole, token_rel), "max_abs": max_abs,
           "max_rel": max_abs / max(float(g.abs().max()), tiny) if d.numel() else 0.0,
           "cos_dist": max(0.0, 1.0 - cos), "l2": l2, "norm": gn, "numel": g.numel(), "nonfinite": 0}
    if token_rel is not None:
        row["token_rel"] = token_rel
    return row


def _without_saturated(g: torch.Tensor, t: torch.Tensor, target_dtype: torch.dtype,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` and ``t`` with the values the target's dtype cannot hold set to 0 on both sides: a
    golden value beyond its largest finite value (a causal mask written as float32's minimum) is
    +-Inf there, the faithful cast, not an overflow and not an error. The limit is bfloat16's
    whatever the target's dtype: a golden value past it is such a sentinel, never a result (an op
    replayed on inputs cast to bfloat16 may return float32, a softmax's upcast, its mask already
    -Inf), while a float16 target's Inf for a golden 1e5 is a real overflow."""
    if not target_dtype.is_floating_point or target_dtype == torch.float64:
        return g, t
    limit = torch.finfo(torch.bfloat16).max
    saturated = torch.isinf(t) & torch.isfinite(g) & (g.abs() > limit) & (torch.sign(t) == torch.sign(g))
    if not bool(saturated.any()):
        return g, t
    return g.masked_fill(saturated, 0.0), t.masked_fill(saturated, 0.0)


def ranked_l2(row: dict[str, Any]) -> Any:
    """The distance a row is ranked by, over its norm: ``l2``, or, where its tokens' mean relative
    error is larger (``token_rel``, see ``own_error``), or a fused experts module's worst expert's
    tokens' (``expert_rel``, ``moe.expert_token_error``), that times ``norm``; ``l2`` itself (any
    value) where neither is there."""
    l2, norm = row.get("l2"), row.get("norm")
    per_token = [v for v in (row.get("token_rel"), row.get("expert_rel")) if isinstance(v, float)]
    if isinstance(l2, float) and isinstance(norm, float) and per_token:
        return max(l2, max(per_token) * norm)
    return l2


def whole_rel(row: dict[str, Any]) -> float | None:
    """A row's whole-output relative error (``l2 / norm``), where its tokens' mean (``token_rel``)
    is known beside it; None elsewhere."""
    l2, norm = row.get("l2"), row.get("norm")
    if row.get("token_rel") is None or not isinstance(l2, float) or not isinstance(norm, float) or norm <= 0:
        return None
    return l2 / norm


def relative_to_update(row: dict[str, Any], update_norm: float | None) -> dict[str, Any]:
    """A decoder layer replayed whole, its own error relative to its output plus what it adds to the
    residual stream (``update_norm``: ||output - input|| of the golden layer), not to its output
    alone.

    Its rounding has two parts: the residual add rounds at the size of the stream (the output),
    the layer's computation at the size of what it computes (the update). Divided by the output
    alone, a layer whose update is most of its output (the first, fed the bare embedding) stood
    out from the later ones on rounding alone; divided by the update alone, a layer adding little
    to a large stream did. ``rel_l2`` and ``norm`` (what the ranking divides ``l2`` by) become
    ``l2 / (||output|| + update)`` and that sum; a row without a finite ``l2`` or ``norm`` is kept
    as it is."""
    l2, norm = row.get("l2"), row.get("norm")
    if (not row.get("replayable") or update_norm is None or not math.isfinite(update_norm)
            or not isinstance(l2, float) or not math.isfinite(l2)
            or not isinstance(norm, float) or not math.isfinite(norm) or norm + update_norm <= 0):
        return row
    scale = norm + update_norm
    # (``token_rel`` is relative to the output alone: a row measured against output plus update drops it)
    return {**{k: v for k, v in row.items() if k != "token_rel"}, "rel_l2": l2 / scale, "norm": scale}


def update_norm(call: Any) -> float | None:
    """||output - input|| of a decoder layer's recorded call (a ``dump.memory.Call``): what the
    layer added to the residual stream, its hidden states being its first positional input or
    ``hidden_states``; None where they are not there or differ in shape from output ``"0"``."""
    hidden = call.args[0] if call.args else call.kwargs.get("hidden_states")
    out = call.outputs.get("0")
    if not isinstance(hidden, torch.Tensor) or not isinstance(out, torch.Tensor) or hidden.shape != out.shape:
        return None
    return float((out.detach().to("cpu", torch.float64) - hidden.detach().to("cpu", torch.float64)).norm())


def update_errors(rows: list[dict[str, Any]], updates: dict[str, float | None]) -> dict[str, float]:
    """Decoder layer -> its own error against what it adds to the residual stream alone (``l2 /
    update``), for the replayed rows with a finite ``l2`` and a non-zero update: a layer standing
    out against its output plus update must stand out here too (``conclude``'s layer checks)."""
    out: dict[str, float] = {}
    for r in rows:
        l2, update = r.get("l2"), updates.get(r["name"])
        if r.get("replayable") and isinstance(l2, float) and math.isfinite(l2) and update:
            out[r["name"]] = l2 / update
    return out
