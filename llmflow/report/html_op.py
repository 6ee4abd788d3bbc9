"""The first bad op in detail: one golden/target tensor pair taken apart for the page.

Given two tensors (the report stage reads the first bad op's output on both sides from the
``first_bad_op.safetensors`` the bisect stage wrote beside verdict.json, else those of the nearest
compare row through the dump readers and the row's locators), this computes what the verdict box cannot
say: where in the tensor the error sits (per attention head when the last dimension splits into
the model's heads, else per channel of the last dimension), how the error is distributed (a
histogram of log10 |target - golden|), the worst elements with their indices and both values,
and both sides' statistics. The copyable ``llmflow inspect`` commands print the same tensors.

Big tensors cost bounded work: beyond ``MAX_ELEMENTS`` an evenly strided sample is analysed (and
the panel says so); the per-channel bars are binned to at most ``MAX_BARS``.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

MAX_ELEMENTS = 1 << 24  # analysed in full up to this many elements (float64: 128 MB a side)
MAX_BARS = 128  # per-channel / per-head bars drawn; wider tensors are binned (each bar: the bin's max)
HIST_BINS = 40
TOP = 20  # worst elements listed
W, H, LEFT, BOTTOM, TOP_PAD = 640, 170, 52, 26, 10  # bar chart geometry (px)


def inspect_command(dump: str, locator: str) -> str:
    """The command that prints this tensor (quoted for a POSIX shell)."""
    return f"llmflow inspect {shlex.quote(str(dump))} {shlex.quote(str(locator))}"


def _stats(x: Any, dtype: str) -> dict[str, Any]:
    import torch

    finite = x[torch.isfinite(x)]
    out = {"dtype": dtype, "shape": "x".join(map(str, x.shape)) or "scalar", "numel": x.numel(),
           "nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum())}
    if finite.numel():
        out.update(min=float(finite.min()), max=float(finite.max()), mean=float(finite.mean()),
                   std=float(finite.std()) if finite.numel() > 1 else 0.0, norm=float(finite.norm()))
    return out


def _bars(values: Sequence[float], labels: Sequence[str], *, title: str, y_label: str,
          levels: Sequence[str] | None = None) -> dict[str, Any]:
    """Bar chart geometry (log y when the values span over two decades)."""
    finite = [v for v in values if math.isfinite(v)]
    positive = [v for v in finite if v > 0]
    log = bool(positive) and len(positive) == len(finite) and max(positive) / min(positive) > 100
    lo = math.log10(min(positive)) if log else 0.0
    hi = math.log10(max(positive)) if log else (max(finite) if finite else 1.0)
    hi = hi if hi > lo else lo + 1.0
    plot_w, plot_h = W - LEFT - 8, H - BOTTOM - TOP_PAD
    bw = plot_w / max(len(values), 1)
    bars = []
    for i, v in enumerate(values):
        f = 0.0 if not math.isfinite(v) or v <= 0 else ((math.log10(v) if log else v) - lo) / (hi - lo)
        f = min(max(f, 0.02 if math.isfinite(v) and v > 0 else 0.0), 1.0)
        h = round(f * plot_h, 1)
        bars.append({"x": round(LEFT + i * bw, 1), "y": round(TOP_PAD + plot_h - h, 1),
                     "w": max(round(bw - 1, 1), 1), "h": h, "title": f"{labels[i]}: {v:.4g}",
                     "level": (levels or [""] * len(values))[i]})
    ticks = [{"y": TOP_PAD + plot_h, "label": f"{10 ** lo:.2g}" if log else "0"},
             {"y": TOP_PAD, "label": f"{10 ** hi:.2g}" if log else f"{hi:.3g}"}]
    step = max(1, len(labels) // 8)
    xticks = [{"x": round(LEFT + (i + 0.5) * bw, 1), "label": labels[i]} for i in range(0, len(labels), step)]
    return {"w": W, "h": H, "left": LEFT, "right": W - 8, "top": TOP_PAD, "bottom": TOP_PAD + plot_h,
            "bars": bars, "yticks": ticks, "xticks": xticks, "title": title, "y_label": y_label, "log": log,
            "x_label": ""}


def _rel_errors(g: Any, t: Any, dim: int, groups: int) -> list[float]:
    """Relative L2 error of each of ``groups`` equal slices of dimension ``dim``."""
    size = g.shape[dim]
    g2 = g.movedim(dim, -1).reshape(-1, groups, size // groups)
    t2 = t.movedim(dim, -1).reshape(-1, groups, size // groups)
    num = (t2 - g2).pow(2).sum(dim=(0, 2)).sqrt()
    den = g2.pow(2).sum(dim=(0, 2)).sqrt().clamp_min(1e-30)
    return [float(x) for x in (num / den)]


def op_panel(golden: Any, target: Any, *, name: str, step: Any, what: str,
             commands: Sequence[str] = (), heads: int | None = None,
             golden_dtype: str = "", target_dtype: str = "",
             per_step: Mapping[int, float] | None = None, per_step_label: str = "",
             diverged_after: int | None = None, title: str = "The first bad op in detail"
             ) -> dict[str, Any]:
    """What the op panel draws for one tensor pair (torch tensors of one shape).

    ``what``: which tensor this is, in words (the first bad op's output, or the closest tensor the
    dumps hold); ``title``: the panel's heading. ``heads``: the model's attention heads (per-head
    error when the last dimension is a multiple). ``per_step``: step -> error of the chosen module,
    drawn as bars."""
    import torch

    out: dict[str, Any] = {"name": name, "step": step, "title": title, "what": what,
                           "commands": list(commands), "notes": []}
    g = golden.detach().to("cpu")
    t = target.detach().to("cpu")
    if g.shape != t.shape:
        out["notes"].append(f"shapes differ: golden {tuple(g.shape)}, target {tuple(t.shape)}")
        out["sides"] = {"golden": _stats(g.double(), golden_dtype),
                        "target": _stats(t.double(), target_dtype)}
        return out
    numel = g.numel()
    stride = max(1, math.ceil(numel / MAX_ELEMENTS))
    full_shape = tuple(g.shape)
    g, t = g.double(), t.double()
    out["sides"] = {"golden": _stats(g if stride == 1 else g.reshape(-1)[::stride], golden_dtype),
                    "target": _stats(t if stride == 1 else t.reshape(-1)[::stride], target_dtype)}
    if stride > 1:
        out["notes"].append(f"{numel:,} elements: statistics, histogram and worst elements from every "
                            f"{stride}th element; the per-channel error from all of them")
    if out["sides"]["golden"].get("numel") != out["sides"]["target"].get("numel"):
        return out  # (cannot happen with one shape; keeps the types honest)
    diff = (t - g).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)  # NaN counts as worst
    flat_g, flat_t, flat_d = g.reshape(-1), t.reshape(-1), diff.reshape(-1)
    norm_g = float(flat_g[torch.isfinite(flat_g)].norm()) if numel else 0.0
    finite_d = flat_d[torch.isfinite(flat_d)]
    out["rel_l2"] = float(finite_d.norm()) / norm_g if norm_g > 0 else None
    out["max_abs"] = float(flat_d.max()) if numel else None
    # where it sits: per head or per channel of the last dimension (all elements: one reduction)
    last = full_shape[-1] if full_shape else 1
    attention = "attn" in name or "attention" in name
    if len(full_shape) >= 1 and last > 1 and torch.isfinite(diff).all():
        if heads and attention and len(full_shape) == 4 and full_shape[1] == heads:  # [batch, head, seq, dim]
            errs = _rel_errors(g, t, 1, heads)
            labels = [f"head {i}" for i in range(heads)]
            out["split"] = {"by": f"attention head ({heads} heads, dimension 1)"}
        elif heads and attention and heads > 1 and last % heads == 0 and last // heads > 1:
            errs = _rel_errors(g, t, -1, heads)
            labels = [f"head {i}" for i in range(heads)]
            out["split"] = {"by": f"attention head ({heads} heads of {last // heads} channels)"}
        else:
            errs = _rel_errors(g, t, -1, last)
            labels = [f"channel {i}" for i in range(last)]
            out["split"] = {"by": f"channel of the last dimension ({last})"}
        worst = sorted(range(len(errs)), key=lambda i: -errs[i])[:8]
        out["split"]["worst"] = [{"label": labels[i], "error": errs[i]} for i in worst]
        if len(errs) > MAX_BARS:  # binned: each bar the worst of its bin
            per = math.ceil(len(errs) / MAX_BARS)
            binned = [max(errs[i:i + per]) for i in range(0, len(errs), per)]
            blabels = [f"{labels[i].split()[0]}s {i}-{min(i + per, len(errs)) - 1}"
                       for i in range(0, len(errs), per)]
            errs, labels = binned, blabels
        out["split"]["chart"] = _bars(errs, labels, title=f"relative L2 error per {out['split']['by']}",
                                      y_label="rel. L2 error")
    # the error's distribution
    sample_d = flat_d[::stride] if stride > 1 else flat_d
    finite = sample_d[torch.isfinite(sample_d)]
    exact = int((finite == 0).sum())
    nonzero = finite[finite > 0]
    if nonzero.numel():
        logs = nonzero.log10()
        lo, hi = math.floor(float(logs.min())), math.ceil(float(logs.max()))
        hi = hi if hi > lo else lo + 1
        counts = torch.histc(logs, bins=HIST_BINS, min=lo, max=hi)
        width = (hi - lo) / HIST_BINS
        labels = [f"1e{lo + (i + 0.5) * width:.1f}" for i in range(HIST_BINS)]
        out["histogram"] = _bars([float(c) for c in counts], labels, title="|target - golden| per element",
                                 y_label="elements")
        out["histogram"]["x_label"] = f"log10 |error| from {lo} to {hi}"
    out["exact"] = exact
    out["nonfinite_error"] = int((~torch.isfinite(sample_d)).sum())
    # the worst elements
    k = min(TOP, sample_d.numel())
    if k:
        vals, idx = torch.topk(sample_d, k)
        rows = []
        for v, i in zip(vals.tolist(), idx.tolist(), strict=True):
            flat_i = i * stride
            index = _unravel(flat_i, full_shape)
            gv, tv = float(flat_g[flat_i]), float(flat_t[flat_i])
            rows.append({"index": "[" + ", ".join(map(str, index)) + "]", "golden": gv, "target": tv,
                         "abs_error": v, "rel_error": v / abs(gv) if gv else None})
        out["worst"] = rows
    if per_step:
        steps = sorted(per_step)
        out["per_step"] = _bars([per_step[s] for s in steps], [f"step {s}" for s in steps],
                                title=per_step_label, y_label="rel. L2 error",
                                levels=["after" if diverged_after is not None and s > diverged_after else ""
                                        for s in steps])
    return out


def _unravel(i: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for d in reversed(shape):
        out.append(i % d)
        i //= d
    return out[::-1]
