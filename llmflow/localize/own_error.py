"""The own error of one replayed output: how far a target module's output, computed from the golden
inputs, lies from the golden output. Every replay (module, MoE expert, op) is ranked by it."""

from __future__ import annotations

import math
from typing import Any

import torch


def own_error(golden: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """The error metrics ranking and charts use (computed in float64, on CPU).

    rel_l2: ||t - g|| / ||g||, the ranking key (scale-free, robust to a few outliers);
    max_abs: max |t - g|; max_rel: max |t - g| / max |g|; cos_dist: 1 - cosine similarity;
    l2, norm: ||t - g|| and ||g|| themselves (ranking floors tiny norms with them); numel;
    nonfinite: how many of the target's values are Inf/NaN where the golden's are finite (an
    overflow). Where there are any, every error metric is +inf: the output is infinitely wrong,
    never "no error" (a NaN would compare as neither large nor small).
    """
    g = golden.detach().to("cpu", torch.float64).reshape(-1)
    t = target.detach().to("cpu", torch.float64).reshape(-1)
    if g.shape != t.shape:
        return {"rel_l2": math.inf, "max_abs": math.inf, "max_rel": math.inf, "cos_dist": math.inf,
                "l2": math.inf, "norm": float(g.norm()), "numel": g.numel(), "nonfinite": 0}
    nonfinite = int((~torch.isfinite(t) & torch.isfinite(g)).sum())
    if nonfinite:
        finite = g[torch.isfinite(g)]
        return {"rel_l2": math.inf, "max_abs": math.inf, "max_rel": math.inf, "cos_dist": math.inf,
                "l2": math.inf, "norm": float(finite.norm()), "numel": g.numel(), "nonfinite": nonfinite}
    d = t - g
    gn = float(g.norm())
    tiny = 1e-30
    cos = float(torch.dot(g, t) / max(gn * float(t.norm()), tiny)) if g.numel() else 1.0
    l2 = float(d.norm())  # each reduction once: on a 1B model's 200 replays they cost more than the replays
    max_abs = float(d.abs().max()) if d.numel() else 0.0
    return {"rel_l2": l2 / max(gn, tiny), "max_abs": max_abs,
            "max_rel": max_abs / max(float(g.abs().max()), tiny) if d.numel() else 0.0,
            "cos_dist": max(0.0, 1.0 - cos), "l2": l2, "norm": gn, "numel": g.numel(), "nonfinite": 0}


def relative_to_update(row: dict[str, Any], update_norm: float | None) -> dict[str, Any]:
    """A decoder layer replayed whole, its own error relative to what the layer adds to the residual
    stream (``update_norm``: ||output - input|| of the golden layer) rather than to its output.

    The residual stream passes through a layer exactly on both sides, so the difference between
    the outputs is the layer's computation alone; divided by the whole output it shrinks with the
    stream's size, and the first layer (whose input is the bare embedding) would stand out from
    the later ones on rounding alone. ``rel_l2`` and ``norm`` (what the ranking divides ``l2`` by)
    become the update's; a row without a finite ``l2`` or an update of zero is kept as it is."""
    l2 = row.get("l2")
    if (not row.get("replayable") or not update_norm or not math.isfinite(update_norm)
            or not isinstance(l2, float) or not math.isfinite(l2)):
        return row
    return {**row, "rel_l2": l2 / update_norm, "norm": update_norm}
