"""Geometry of the report's inline SVG charts (no JS, no CDN, no plotting library).

This module only computes numbers (coordinates, ticks, colours); the markup is drawn by the
macros in ``templates/charts.html.j2``, whose autoescaping covers every label.

``line_chart``: one metric over the layers, several series (``raw`` errors from the dumps against
``isolated`` own errors from replay). The y axis is logarithmic by default because errors span
decades (bf16 noise at 1e-3, a fault at 1e-1); it falls back to linear when a series has values
<= 0 (cosine similarity, scores of exactly zero).

``heat_map``: an error per (step, layer) cell on a logarithmic colour scale, light (small) to dark
red (large), with a legend and markers for the first bad token (row) and layer (column).
"""

from __future__ import annotations

import math
from typing import Any

W, H = 600, 240
ML, MR, MT, MB = 62, 16, 14, 34  # margins: room for tick labels
COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
DASHES = ("", "6 4", "2 3", "8 3 2 3", "", "6 4")
# ColorBrewer YlOrRd, 9 classes: small errors pale yellow, large ones dark red
HEAT = ("#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#bd0026", "#800026")
NO_DATA = "#eef0f2"


def fmt_tick(v: float) -> str:
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
               mark_x: int | None = None, log: bool | None = None) -> dict[str, Any] | None:
    """The geometry of one chart: a polyline with point markers per series, ticks, a legend.

    ``series``: label -> {x: y}. Non-finite points are skipped. ``mark_x`` places a vertical
    marker (the first bad layer). None when no series has a point.
    """
    pts = {k: {int(x): float(y) for x, y in v.items() if y is not None and math.isfinite(float(y))}
           for k, v in series.items()}
    pts = {k: v for k, v in pts.items() if v}
    if not pts:
        return None
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
        return round(ML + (x - xlo) / xspan * (W - ML - MR), 1)

    def py(y: float) -> float:
        if log:
            f = (math.log10(max(y, ylo)) - math.log10(ylo)) / (math.log10(yhi) - math.log10(ylo))
        else:
            f = (y - ylo) / (yhi - ylo)
        return round(H - MB - f * (H - MT - MB), 1)

    out: dict[str, Any] = {
        "title": title, "w": W, "h": H, "left": ML, "right": W - MR, "top": MT, "bottom": H - MB,
        "x_label": x_label + (" (log y)" if log else ""),
        "yticks": [{"y": py(t), "label": fmt_tick(t)} for t in _ticks(ylo, yhi, log) if ylo <= t <= yhi],
        "xticks": [{"x": px(x), "label": str(x)} for x in range(xlo, xhi + 1, max(1, math.ceil(xspan / 15)))],
        "mark": px(mark_x) if mark_x is not None and xlo <= mark_x <= xhi else None,
        "series": [],
    }
    legend_x = ML + 8
    for i, (label, v) in enumerate(pts.items()):
        out["series"].append({
            "label": label, "color": COLORS[i % len(COLORS)], "dash": DASHES[i % len(DASHES)],
            "points": " ".join(f"{px(x)},{py(y)}" for x, y in sorted(v.items())),
            "dots": [{"x": px(x), "y": py(y), "title": f"{label} {x_label} {x}: {y:.4g}"}
                     for x, y in sorted(v.items())],
            "legend_x": legend_x})
        legend_x += 40 + 6 * len(label)  # ~6 px per legend character
    return out


def charts(curves: dict[str, dict[str, dict[Any, float]]], mark_x: int | None = None) -> list[dict[str, Any]]:
    """One chart per metric: ``curves[metric][series] = {layer: value}``."""
    out = []
    for metric, series in curves.items():
        chart = line_chart(metric, {k: {int(x): y for x, y in v.items()} for k, v in series.items()},
                           mark_x=mark_x)
        if chart:
            out.append(chart)
    return out


def heat_color(f: float) -> str:
    """The colour at ``f`` in [0, 1] along ``HEAT`` (linear blend between its stops)."""
    f = min(max(f, 0.0), 1.0) * (len(HEAT) - 1)
    i = min(int(f), len(HEAT) - 2)
    a, b = HEAT[i], HEAT[i + 1]
    t = f - i
    rgb = [round(int(a[k:k + 2], 16) * (1 - t) + int(b[k:k + 2], 16) * t) for k in (1, 3, 5)]
    return "#" + "".join(f"{c:02x}" for c in rgb)


def heat_map(values: dict[tuple[int, int], float], *, row_labels: dict[int, str], metric: str,
             verdicts: dict[tuple[int, int], str] | None = None, mark_row: int | None = None,
             mark_col: int | None = None, first_fail: tuple[int, int] | None = None,
             split_after: int | None = None) -> dict[str, Any] | None:
    """The geometry of a (step, layer) -> error heat map; None without a positive finite value.

    The colour scale is logarithmic over the values' decades; zeros take the palest colour.
    ``mark_row``/``mark_col`` (the first bad token and layer) get a red triangle at the axis,
    ``first_fail`` (the first failing cell, step-major) a thick outline, ``split_after`` (the
    step whose tokens first differ) a dashed line under its row: later steps run on different
    input tokens on the two sides.
    """
    finite = [v for v in values.values() if v is not None and math.isfinite(v)]
    positive = [v for v in finite if v > 0]
    if not positive:
        return None
    lo = 10 ** math.floor(math.log10(min(positive)))
    hi = 10 ** math.ceil(math.log10(max(positive)))
    if hi <= lo:
        hi = lo * 10

    def frac(v: float) -> float:
        return 0.0 if v <= 0 else (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    steps = sorted({s for s, _ in values})
    layers = list(range(min(ly for _, ly in values), max(ly for _, ly in values) + 1))
    cw = max(6, min(36, 900 // len(layers)))
    ch = max(4, min(22, 560 // len(steps)))
    label_w, top, legend_h = 170, 22, 30
    left = label_w
    grid_w, grid_h = cw * len(layers), ch * len(steps)
    row_every = math.ceil(11 / ch)  # labels 11 px apart at least
    col_every = math.ceil(18 / cw)
    verdicts = verdicts or {}
    cells = []
    for r, step in enumerate(steps):
        for c, layer in enumerate(layers):
            v = values.get((step, layer))
            ok = v is not None and math.isfinite(v)
            verdict = verdicts.get((step, layer))
            cells.append({"x": left + c * cw, "y": top + r * ch, "step": step, "layer": layer,
                          "fill": heat_color(frac(v)) if ok else NO_DATA, "value": f"{v:.3g}" if ok else "",
                          "title": f"step {step}, layer {layer}: "
                                   + (f"{metric} {v:.3g}" if ok else "no data")
                                   + (f" ({verdict})" if verdict else "")})
    legend_y = top + grid_h + 58
    legend_w = min(max(grid_w, 240), 420)
    stops = [{"x": left + i * legend_w / 40, "w": legend_w / 40 + 0.5, "fill": heat_color(i / 39)}
             for i in range(40)]
    decades = range(round(math.log10(lo)), round(math.log10(hi)) + 1)
    every = max(1, math.ceil(len(decades) / 6))
    ticks = [{"x": round(left + (e - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * legend_w, 1),
              "label": fmt_tick(10.0 ** e)} for e in list(decades)[::every]]

    def row_y(step: int | None) -> float | None:
        return top + steps.index(step) * ch + ch / 2 if step in steps else None

    def col_x(layer: int | None) -> float | None:
        return left + layers.index(layer) * cw + cw / 2 if layer in layers else None

    split = None
    later = [s for s in steps if split_after is not None and s > split_after]
    if later:
        split = top + steps.index(later[0]) * ch
    outline = None
    if first_fail is not None and first_fail[0] in steps and first_fail[1] in layers:
        outline = {"x": left + layers.index(first_fail[1]) * cw, "y": top + steps.index(first_fail[0]) * ch,
                   "step": first_fail[0], "layer": first_fail[1]}
    return {
        "metric": metric, "h": legend_y + legend_h,
        "w": left + max(grid_w + (170 if split is not None else 20), legend_w) + 20,  # the split's label
        "left": left, "top": top, "cw": cw, "ch": ch, "grid_w": grid_w, "grid_h": grid_h, "cells": cells,
        "rows": [{"y": top + r * ch + ch / 2 + 4, "label": row_labels.get(s, f"step {s}"), "step": s}
                 for r, s in enumerate(steps) if r % row_every == 0 or s == mark_row],
        "cols": [{"x": left + c * cw + cw / 2, "label": str(ly)}
                 for c, ly in enumerate(layers) if c % col_every == 0 or ly == mark_col],
        "mark_row": row_y(mark_row), "mark_col": col_x(mark_col), "mark_step": mark_row,
        "mark_layer": mark_col, "outline": outline, "split": split,
        "legend": {"y": legend_y, "w": legend_w, "stops": stops, "ticks": ticks},
    }
