"""Hand-written inline SVG line charts for the HTML report (no JS, no CDN, no plotting library).

One chart = one metric over the layers, several series (``raw`` errors from the dumps against
``isolated`` own errors from replay). The y axis is logarithmic by default because errors span
decades (bf16 noise at 1e-3, a fault at 1e-1); it falls back to linear when a series has values
<= 0 (cosine similarity, scores of exactly zero).
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

W, H = 640, 240
ML, MR, MT, MB = 62, 16, 14, 34  # margins: room for tick labels
COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
DASHES = ("", "6 4", "2 3", "8 3 2 3", "", "6 4")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.0e}"
    return f"{v:.3g}"


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        step = max(1, (b - a) // 6)
        return [10.0 ** e for e in range(a, b + 1, step)]
    if hi == lo:
        return [lo]
    raw = (hi - lo) / 5
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10) if m * mag >= raw), default=raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 2)]


def line_chart(title: str, series: dict[str, dict[int, float]], *, x_label: str = "layer",
               mark_x: int | None = None, log: bool | None = None) -> str:
    """An ``<svg>`` element: one polyline (with point markers and hover titles) per series.

    ``series``: label -> {x: y}. Non-finite points are skipped. ``mark_x`` draws a vertical
    marker (the first bad layer). Returns an empty string when no series has a point.
    """
    pts = {k: {int(x): float(y) for x, y in v.items() if y is not None and math.isfinite(float(y))}
           for k, v in series.items()}
    pts = {k: v for k, v in pts.items() if v}
    if not pts:
        return ""
    ys = [y for v in pts.values() for y in v.values()]
    xs = [x for v in pts.values() for x in v]
    if log is None:
        log = min(ys) > 0
    ylo, yhi = min(ys), max(ys)
    if log:
        ylo, yhi = 10 ** math.floor(math.log10(ylo)), 10 ** math.ceil(math.log10(yhi))
        if ylo == yhi:
            ylo, yhi = ylo / 10, yhi * 10
    elif ylo == yhi:
        ylo, yhi = ylo - 1, yhi + 1
    xlo, xhi = min(xs), max(xs)
    xspan = max(xhi - xlo, 1)

    def px(x: float) -> float:
        return ML + (x - xlo) / xspan * (W - ML - MR)

    def py(y: float) -> float:
        if log:
            f = (math.log10(max(y, ylo)) - math.log10(ylo)) / (math.log10(yhi) - math.log10(ylo))
        else:
            f = (y - ylo) / (yhi - ylo)
        return H - MB - f * (H - MT - MB)

    out = [f'<svg class="chart" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
           f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
           f'<title>{escape(title)}</title>',
           f'<rect x="{ML}" y="{MT}" width="{W - ML - MR}" height="{H - MT - MB}" class="plot"/>']
    for t in _ticks(ylo, yhi, log):
        if ylo <= t <= yhi:
            y = py(t)
            out.append(f'<line x1="{ML}" x2="{W - MR}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                       f'<text x="{ML - 4}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>')
    xstep = max(1, math.ceil(xspan / 15))
    for x in range(xlo, xhi + 1, xstep):
        out.append(f'<text x="{px(x):.1f}" y="{H - MB + 14}" class="tick" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{(ML + W - MR) / 2:.0f}" y="{H - 4}" class="axis" text-anchor="middle">'
               f'{escape(x_label)}{" (log y)" if log else ""}</text>')
    if mark_x is not None and xlo <= mark_x <= xhi:
        x = px(mark_x)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT}" y2="{H - MB}" class="mark"/>')
    for i, (label, v) in enumerate(pts.items()):
        color, dash = COLORS[i % len(COLORS)], DASHES[i % len(DASHES)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(v.items()))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"'
                   f'{dash_attr} class="series"/>')
        for x, y in sorted(v.items()):
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}">'
                       f'<title>{escape(label)} {x_label} {x}: {y:.4g}</title></circle>')
        lx = ML + 8 + sum(40 + 6 * len(lbl) for lbl in list(pts)[:i])  # ~6 px per legend character
        out.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{MT + 10}" y2="{MT + 10}" stroke="{color}" '
                   f'stroke-width="2"{dash_attr}/><text x="{lx + 26}" y="{MT + 14}" class="legend">'
                   f'{escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def charts(curves: dict[str, dict[str, dict[Any, float]]], mark_x: int | None = None) -> str:
    """One chart per metric: ``curves[metric][series] = {layer: value}``."""
    parts = []
    for metric, series in curves.items():
        svg = line_chart(metric, {k: {int(x): y for x, y in v.items()} for k, v in series.items()},
                         mark_x=mark_x)
        if svg:
            parts.append(f'<figure><figcaption>{escape(metric)}</figcaption>{svg}</figure>')
    return "".join(parts)
