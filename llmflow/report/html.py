"""One self-contained HTML report: the verdict on top, then the evidence that supports it.

No network: CSS, JS (sortable/filterable tables) and SVG charts are inline, so the file can be
mailed or attached to an issue. Every string that came from a dump, a model or a user (module
names, token text, prompts) goes through ``html.escape``.

Sections, each shown only when its data is there:
  verdict      first mismatching token, first bad token, layer, module, op, the diagnosis line
  texts        golden and target generations token by token, the first difference marked
  curves       per-layer errors, raw (from the dumps) against isolated (replay), one chart per metric
  candidates   the ranked modules (own error, typical error of the type, score)
  ops          the op-level comparison inside the chosen module
  cost         model runs, bytes dumped, seconds, against a full API-level dump
  tables       any row tables (the compare stage's CSVs), sortable and filterable
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from html import escape
from pathlib import Path
from typing import Any

from llmflow.report.html_assets import CSS, JS
from llmflow.report.html_svg import charts

MAX_ROWS = 5000  # per table: a browser stays responsive, the CSV has the rest


def _cell(v: Any) -> tuple[str, str, bool]:
    """(display text, sort value, is-number) of one table cell."""
    if v is None:
        return "", "", False
    if isinstance(v, bool):
        return str(v).lower(), str(v).lower(), False
    if isinstance(v, (int, float)):
        f = float(v)
        if not math.isfinite(f):
            return str(f), str(f), False
        text = str(v) if isinstance(v, int) else (f"{f:.4g}" if f != 0 else "0")
        return text, repr(f), True
    if isinstance(v, (dict, list, tuple)):
        s = json.dumps(v, default=str)
        return s, s, False
    s = str(v)
    return s, s, False


def table(rows: list[Mapping[str, Any]], *, table_id: str, columns: list[str] | None = None,
          max_rows: int = MAX_ROWS, highlight: str | None = None, filters: bool = True) -> str:
    """A sortable ``<table>`` (with a filter box and a verdict selector when ``filters``).

    Rows with a ``verdict`` of fail/warn are coloured; the row whose ``name`` equals
    ``highlight`` is bold. Columns default to the union of the rows' keys in first-seen order.
    """
    if columns is None:  # every key that has a value in some row, in first-seen order
        columns = []
        for r in rows:
            columns.extend(k for k in r if k not in columns and r[k] is not None)
    shown = rows[:max_rows]
    out = []
    if filters:
        has_verdict = "verdict" in columns
        sel = ('<select aria-label="verdict"><option value="">all verdicts</option>'
               '<option value="fail">fail</option><option value="warn">warn</option></select>'
               if has_verdict else "")
        out.append(f'<div class="filters" data-table="{escape(table_id)}"><input type="search" '
                   f'placeholder="filter rows..." aria-label="filter"> {sel} '
                   f'<span class="count muted"></span></div>')
    if len(rows) > max_rows:
        out.append(f'<p class="muted">showing the first {max_rows} of {len(rows)} rows; the CSV '
                   f'has all of them</p>')
    out.append(f'<div class="tablebox"><table class="sortable" id="{escape(table_id)}"><thead><tr>')
    out.extend(f"<th>{escape(str(c))}</th>" for c in columns)
    out.append("</tr></thead><tbody>")
    for r in shown:
        cls = [str(r.get("verdict"))] if r.get("verdict") in ("fail", "warn") else []
        if highlight is not None and r.get("name") == highlight:
            cls.append("cand")
        out.append(f'<tr class="{" ".join(cls)}">' if cls else "<tr>")
        for c in columns:
            text, sort, num = _cell(r.get(c))
            attr = f' class="num" data-v="{escape(sort)}"' if num else ""
            out.append(f"<td{attr}>{escape(text)}</td>")
        out.append("</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _tokens(tokens: list[str], first_diff: int | None, first_bad: int | None) -> str:
    out = ['<div class="tokens">']
    for i, tok in enumerate(tokens):
        cls = ["tok"]
        title = f"step {i}"
        if first_diff is not None and i == first_diff:
            cls.append("diff")
            title += ": first differing token"
        elif first_diff is not None and i > first_diff:
            cls.append("after")
        if first_bad is not None and i == first_bad and i != first_diff:
            cls.append("bad")
            title += ": first token whose logits fail"
        out.append(f'<span class="{" ".join(cls)}" title="{escape(title)}">{escape(tok)}</span>')
    out.append("</div>")
    return "".join(out)


def _verdict_box(v: Mapping[str, Any]) -> str:
    found = v.get("first_bad_layer") is not None or v.get("first_bad_op") is not None
    same = v.get("first_mismatch_token") is None and v.get("first_bad_token") is None
    # red: a module is blamed; amber: the outputs drift but no module stands out; green: identical
    cls = "verdict" if found else ("verdict ok" if same else "verdict drift")
    fields = [("first mismatching token", v.get("first_mismatch_token")),
              ("first bad token (logits)", v.get("first_bad_token")),
              ("first bad layer", v.get("first_bad_layer")),
              ("first bad module", v.get("first_bad_module")),
              ("first bad op", v.get("first_bad_op"))]
    detail = v.get("token_detail") or {}
    if detail.get("golden_token") is not None:
        fields.append(("tokens at the mismatch",
                       f"golden {detail.get('golden_token')!r} vs target {detail.get('target_token')!r}"))
    out = [f'<section class="{cls}"><h2 style="margin-top:0;border:0">Verdict</h2>']
    if v.get("diagnosis"):
        out.append(f'<p class="diagnosis">{escape(str(v["diagnosis"]))}</p>')
    out.append("<dl>")
    for label, value in fields:
        shown = "none" if value is None else str(value)
        out.append(f"<dt>{escape(label)}</dt><dd><code>{escape(shown)}</code></dd>")
    out.append("</dl></section>")
    return "".join(out)


def render_report(*, title: str, verdict: Mapping[str, Any] | None = None,
                  tables: Mapping[str, list[Mapping[str, Any]]] | None = None,
                  meta: Mapping[str, Any] | None = None, max_rows: int = MAX_ROWS) -> str:
    """The whole HTML document as a string. ``verdict`` is the bisect stage's verdict dict."""
    body: list[str] = [f"<h1>{escape(title)}</h1>"]
    if meta:
        body.append('<p class="muted">' + " &middot; ".join(
            f"{escape(str(k))}: <code>{escape(str(val))}</code>" for k, val in meta.items()) + "</p>")
    v = verdict or {}
    if verdict:
        body.append(_verdict_box(v))
        texts = v.get("texts") or {}
        if texts:
            body.append("<h2>Generated texts</h2>")
            for side in ("golden", "target"):
                t = texts.get(side) or {}
                label = f"{side}: {t.get('label', '')}".rstrip(": ")
                body.append(f"<div><b>{escape(label)}</b></div>")
                body.append(_tokens([str(x) for x in t.get("tokens") or [t.get("text", "")]],
                                    v.get("first_mismatch_token"), v.get("first_bad_token")))
        curves = v.get("curves") or {}
        if curves:
            layer = v.get("first_bad_layer")
            mark = int(str(layer).rsplit(".", 1)[-1]) if layer and str(layer)[-1:].isdigit() else None
            body.append("<h2>Per-layer error: raw (dumps) against isolated (replay)</h2>"
                        '<p class="muted">Raw errors carry everything upstream (the residual stream '
                        "accumulates); isolated errors are each module's own, measured on the golden "
                        "inputs. The dashed red line marks the first bad layer.</p>")
            body.append(charts(curves, mark_x=mark))
        sections = [("Ranked candidate modules", "candidates", v.get("first_bad_module")),
                    ("Ops inside the chosen module", "ops", v.get("first_bad_op")),
                    ("Logits per step", "token_rows", None)]
        for heading, key, highlight in sections:
            rows = v.get(key) or []
            if rows:
                body.append(f"<h2>{escape(heading)}</h2>")
                body.append(table(rows, table_id=f"t-{key}", highlight=highlight, max_rows=max_rows))
        cost = v.get("cost")
        if cost:
            body.append("<h2>Cost</h2>")
            body.append(table([{"what": k, "value": val} for k, val in cost.items()],
                              table_id="t-cost", filters=False))
    for i, (name, rows) in enumerate((tables or {}).items()):
        body.append(f"<h2>{escape(name)}</h2>")
        body.append(table(list(rows), table_id=f"t-extra-{i}", max_rows=max_rows))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{''.join(body)}<script>{JS}</script></body></html>\n")


def write_report(path: str | Path, **kwargs: Any) -> Path:
    """``render_report(**kwargs)`` written to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(**kwargs), encoding="utf-8")
    return path


def rows_of(items: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dict copies (CSV readers give OrderedDicts of strings; numbers are parsed back)."""
    out = []
    for item in items:
        row = {}
        for k, val in item.items():
            if isinstance(val, str):
                try:
                    num = float(val)
                    row[k] = int(num) if val.strip().lstrip("-").isdigit() else num
                    continue
                except ValueError:
                    pass
                row[k] = None if val == "" else val
            else:
                row[k] = val
        out.append(row)
    return out
