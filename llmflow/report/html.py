"""One self-contained HTML report: the verdict on top, then the evidence that supports it.

The page is ``templates/report.html.j2`` rendered by Jinja2 with autoescaping on, so every string
that came from a dump, a model or a user (module names, token text, prompts, paths) is escaped;
nothing here builds markup by hand. No network: CSS, JS (sortable/filterable tables, row links)
and SVG charts are inline, so the file can be mailed or attached to an issue.

Sections, each shown only when its data is there:
  banner       the run's conclusion: the status (pass/fail/inconclusive) and a one-line headline,
               coloured; the bisect's verdict, else the outcome of the stage that concluded (a
               compare's, a precheck's), in the words summary.json holds
  verdict      first mismatching token, first bad token, layer, module, op, the diagnosis line;
               what keeps the dumps from being whole; why the evidence is inconclusive and what to
               run next
  run          the prompt, the two sides' model/device/dtype/versions (env.json), the run's parameters
  texts        golden and target generations token by token, the first difference marked
  curves       per-layer errors at the replayed step, raw (dumps) against isolated (replay)
  own error    the chosen module's own error per step from the prefill on, beside the median of the
               same module in other layers (verdict.own_error_steps)
  heat map     layer-output error per step and layer (compare rows of level "layer", 2+ steps)
  tree         the model's module tree at the replayed step (topology.json): own and raw error per
               module, the layers one collapsed row each, the chosen module open and highlighted
  op panel     the first bad op's tensors as the bisect kept them (first_bad_op.safetensors; else the
               closest the dumps hold, saying so): error per head or channel,
               its histogram, the worst elements, both sides' statistics, ``llmflow inspect`` commands
  candidates   the ranked modules, each linked to its compare rows; ops inside the chosen one;
               modules that could not be replayed and why; MoE routing differences
  logits       one table of the logits per step
  compare      what the compare says about its pairing (matching, dtype, coverage); per level: its
               rows counted as the compare summary counts them, the compared rows (sortable,
               filterable) and, collapsed, the rows not compared with their reasons; links to the
               CSV/XLSX files
  cost         model runs, bytes dumped (kB/MB/GB), seconds per phase
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from llmflow.report import html_verdict as hv
from llmflow.report.html_compare import LevelRows, layer_heat_map, layer_number, summarize_level
from llmflow.report.html_svg import charts, line_chart
from llmflow.report.html_tree import module_tree
from llmflow.results.verdict import Candidate, Verdict

MAX_ROWS = 5000  # per table: a browser stays responsive, the CSV has the rest
# columns a reader looks at first (the rest follow in the CSV's order)
COMPARE_LEAD = ("step", "name", "kind", "index", "verdict", "reason", "diverged", "cosine_similarity",
                "relative_euclidean_distance", "max_absolute_error", "max_relative_error", "kl_divergence",
                "top1_match", "match")
CANDIDATE_LEAD = ("rank", "name", "score", "error", "typical", "anomalous", "compare rows")
LOGITS_LEAD = ("step", "golden_text", "target_text", "same_token", "verdict", "golden_margin", "kl",
               "cosine_similarity", "max_absolute_error")
# columns left out of the page when on every row they echo another one (the CSV keeps them)
ECHOES = (("target_step", "step"), ("target_name", "name"), ("rank", None))
TEMPLATES = Path(__file__).with_name("templates")


class Link(NamedTuple):
    """A table cell that links somewhere in the page (or to a file next to it)."""

    text: str
    href: str


@cache
def _env() -> Environment:
    return Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, undefined=StrictUndefined,
                       trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def _cell(v: Any) -> dict[str, Any]:
    """Display text, sort value, is-number and link of one table cell."""
    if isinstance(v, Link):
        return {"text": v.text, "sort": v.text, "num": False, "href": v.href}
    text, sort, num = "", "", False
    if isinstance(v, bool):
        text = sort = str(v).lower()
    elif isinstance(v, (int, float)):
        f = float(v)
        if math.isfinite(f):
            text = str(v) if isinstance(v, int) else (f"{f:.4g}" if f != 0 else "0")
            sort, num = repr(f), True
        else:
            text = sort = str(f)
    elif isinstance(v, (dict, list, tuple)):
        text = sort = json.dumps(v, default=str)
    elif v is not None:
        text = sort = str(v)
    return {"text": text, "sort": sort, "num": num, "href": None}


def table_view(rows: Sequence[Mapping[str, Any]], *, table_id: str, columns: list[str] | None = None,
               max_rows: int = MAX_ROWS, highlight: str | None = None, filters: bool = True,
               total: int | None = None, lead: Sequence[str] = (),
               drop_echoes: bool = False) -> dict[str, Any]:
    """What the ``table`` macro draws: a sortable table (with a filter box and a verdict selector
    when ``filters``). Rows with a ``verdict`` of fail/warn are coloured; the row whose ``name``
    equals ``highlight`` is bold. Columns default to every key that has a value in some row, in
    first-seen order, ``lead`` ones first; ``drop_echoes`` leaves out the ``ECHOES``.
    ``total``: how many rows there are in all (when ``rows`` is already a prefix).
    """
    shown = rows[:max_rows]
    if columns is None:
        columns = []
        for r in rows:
            columns.extend(k for k in r if k not in columns and r[k] is not None)
        columns = [c for c in lead if c in columns] + [c for c in columns if c not in lead]
        if drop_echoes:
            columns = [c for c in columns if not _echoes(c, shown)]
    out_rows = []
    for r in shown:
        cls = [str(r["verdict"])] if r.get("verdict") in ("fail", "warn") else []
        if highlight is not None and r.get("name") == highlight:
            cls.append("cand")
        out_rows.append({"cls": " ".join(cls), "name": "" if r.get("name") is None else str(r.get("name")),
                         "cells": [_cell(r.get(c)) for c in columns]})
    return {"id": table_id, "columns": [str(c) for c in columns], "rows": out_rows, "filters": filters,
            "has_verdict": "verdict" in columns, "shown": len(shown), "total": max(total or 0, len(rows))}


def _echoes(column: str, rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``column`` repeats another column (or, for ``rank``, is 0) on every row."""
    for col, other in ECHOES:
        if col == column:
            return all(r.get(col) == (r.get(other) if other else 0) for r in rows)
    return False


def _tokens(tokens: list[str], first_diff: int | None, first_bad: int | None) -> list[dict[str, str]]:
    out = []
    for i, tok in enumerate(tokens):
        cls, title = ["tok"], f"step {i}"
        if first_diff is not None and i == first_diff:
            cls.append("diff")
            title += ": first differing token"
        elif first_diff is not None and i > first_diff:
            cls.append("after")
        if first_bad is not None and i == first_bad and i != first_diff:
            cls.append("bad")
            title += ": first token whose logits fail"
        out.append({"text": tok, "cls": " ".join(cls), "title": title})
    return out


def _texts(v: Verdict | None) -> list[dict[str, Any]]:
    if v is None or v.texts is None:
        return []
    out = []
    for side, t in (("golden", v.texts.golden), ("target", v.texts.target)):
        tokens = t.tokens or [t.text]
        out.append({"label": f"{side}: {t.label}".rstrip(": "),
                    "tokens": _tokens(tokens, v.first_mismatch_token, v.first_bad_token)})
    return out


def _rows(records: Sequence[Any]) -> list[dict[str, Any]]:
    """Verdict rows (candidates, ops, logits) as the plain rows a table draws."""
    return [dataclasses.asdict(r) for r in records]


def _safe_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", text)


def _layer_of(candidate: Candidate) -> str | None:
    if candidate.layer:
        return candidate.layer
    m = re.match(r"^(.*?\.\d+)(?:\.|$)", candidate.name)
    return m[1] if m else None


def _with_row_links(candidates: list[Candidate], levels: Mapping[str, LevelRows]) -> list[dict[str, Any]]:
    """Candidates with a ``compare rows`` cell linking to the module's compare rows in the page:
    its own (module, api or layer level), else its decoder layer's output; empty when neither
    was compared."""
    names = {lv: rows_.shown_names() for lv, rows_ in levels.items()}
    out = []
    for c in candidates:
        link = None
        layer = _layer_of(c)
        for target, where, prefix in ((c.name, ("module", "api", "layer"), ""),
                                      (layer, ("layer", "module"), f"layer {layer}: ")):
            found = [lv for lv in where if target is not None and names.get(lv, {}).get(str(target))]
            if found:
                n = names[found[0]][str(target)]
                link = Link(f"{prefix}{n} row{'s' if n != 1 else ''}",
                            f"#rows=t-cmp-{_safe_id(found[0])}&name={quote(str(target), safe='')}")
                break
        out.append({**dataclasses.asdict(c), "compare rows": link})
    return out


def _compare_sections(levels: Mapping[str, LevelRows], max_rows: int,
                      logits_shown: bool) -> list[dict[str, Any]]:
    out = []
    for name, lv in levels.items():
        tid = f"t-cmp-{_safe_id(name)}"
        in_logits = logits_shown and name == "logits"
        out.append({
            "level": name, "id": f"compare-{_safe_id(name)}", "href": lv.href, "n_rows": lv.n_rows,
            "n_compared": lv.n_compared, "n_not_compared": lv.n_not_compared, "in_logits": in_logits,
            "matches": ", ".join(f"{n} by {m}" for m, n in lv.matches.most_common()),
            "verdicts": ", ".join(f"{n} {k}" for k, n in lv.verdicts.most_common() if k),
            "table": None if in_logits or not lv.compared else
            table_view(lv.compared, table_id=tid, max_rows=max_rows, total=lv.n_in_table,
                       lead=COMPARE_LEAD, drop_echoes=True),
            "reasons": lv.reason_rows(),
            "reason_line": "; ".join(f"{n} {why}" for why, n in lv.why_counts()),
            "n_diverged": lv.n_diverged, "elsewhere": lv.elsewhere,
        })
    return out


def summarize_levels(compare: Mapping[str, LevelRows | Iterable[Mapping[str, Any]]], max_rows: int,
                     hrefs: Mapping[str, str] | None = None) -> dict[str, LevelRows]:
    """Each level's rows summarised, in order; the module level leaves out the decoder-layer
    outputs the layer level already shows (a layer output is a row of both)."""
    levels: dict[str, LevelRows] = {}
    for lv, rows in compare.items():
        if isinstance(rows, LevelRows):
            levels[lv] = rows
            continue
        elsewhere = levels["layer"].names if lv == "module" and "layer" in levels else ()
        levels[lv] = summarize_level(lv, rows, max_rows=max_rows, href=(hrefs or {}).get(lv),
                                     shown_elsewhere=elsewhere)
    return levels


def render_report(*, title: str, verdict: Verdict | None = None, outcome: hv.StageOutcome | None = None,
                  problems: Sequence[str] = (), compare_notes: Sequence[str] = (),
                  compare: Mapping[str, LevelRows | Iterable[Mapping[str, Any]]] | None = None,
                  files: Sequence[tuple[str, str]] = (), run: Mapping[str, Any] | None = None,
                  tables: Mapping[str, list[Mapping[str, Any]]] | None = None,
                  meta: Mapping[str, Any] | None = None, max_rows: int = MAX_ROWS,
                  topology: Mapping[str, Any] | None = None,
                  op_panel: Mapping[str, Any] | None = None) -> str:
    """The whole HTML document as a string.

    ``verdict``: the bisect's verdict (verdict.json read back). ``outcome``: the conclusion of the
    stage that concluded when no bisect did (a compare's, a precheck's): the page leads with the
    verdict when there is one, else with it. ``problems``: what keeps each dump from being whole,
    one line each, shown under the conclusion. ``compare_notes``: what the compare says about its
    pairing (``compare.summary.report_lines``), above its tables.
    ``compare``: level -> the compare stage's rows
    (or a ``LevelRows`` already summarised, with the CSV's relative link). ``files``: (label, href)
    links to files next to the page (CSV, XLSX). ``run``: {"params": the run's parameters,
    "env": {"golden": env.json dict, "target": ...}}. ``tables``: any other row tables by heading.
    ``topology``: a dump's topology.json (the module tree). ``op_panel``: ``html_op.op_panel``'s
    dict for the first bad op (or the closest tensor the dumps hold).
    """
    v = verdict
    lead = v if v is not None else outcome  # the run's conclusion: the bisect's, else the stage's
    levels = summarize_levels(compare or {}, max_rows)
    run = run or {}
    envs = dict(run.get("env") or {})
    params = run.get("params") or {}
    replay = hv.replay(v) if v else None
    layer = v.first_bad_layer if v else None
    token_rows = _rows(v.token_rows) if v else []  # the bisect's logits rows: tokens, margins, KL
    logits_shown = bool(token_rows)  # then the compare section does not repeat its logits rows
    ctx = {
        "title": title, "meta": [(str(k), str(val)) for k, val in (meta or {}).items()],
        "css": Markup(_asset("report.css")), "js": Markup(_asset("report.js")),
        "banner": hv.banner(lead) if lead is not None else None,
        "fields": hv.fields(v) if v else [], "diagnosis": v.diagnosis if v else "",
        "problems": [str(p) for p in problems], "compare_notes": [str(n) for n in compare_notes],
        "inconclusive": hv.inconclusive(lead), "replay": replay,
        "prompt": hv.prompt_of(envs, params), "sides": hv.sides(envs) if envs else None,
        "params": [(str(k), _cell(val)["text"] if val != "" else '""') for k, val in params.items()],
        "workflow": run.get("workflow"), "texts": _texts(v),
        "charts": charts(v.curves if v else {}, mark_x=layer_number(layer) if layer else None),
        "curve_step": replay["step_label"] if replay else None,
        "heat": layer_heat_map(levels.get("layer"), v),
        "tree": _tree(topology, v, levels),
        "op_panel": op_panel,
        "own_steps": _own_error_steps(v),
        "dtype_baseline": _dtype_baseline(v) if logits_shown else None,
        "candidates": table_view(_with_row_links(v.candidates, levels),
                                 table_id="t-candidates", highlight=v.first_bad_module,
                                 max_rows=max_rows, lead=CANDIDATE_LEAD) if v and v.candidates else None,
        "ops": table_view(_rows(v.ops), table_id="t-ops", highlight=v.first_bad_op,
                          max_rows=max_rows) if v and v.ops else None,
        "routing": table_view(hv.routing(v), table_id="t-routing") if hv.routing(v) else None,
        "logits": table_view(token_rows, table_id="t-logits", max_rows=max_rows, lead=LOGITS_LEAD,
                             drop_echoes=True) if logits_shown else None,
        "logits_href": levels["logits"].href if "logits" in levels else None,
        "compare": _compare_sections(levels, max_rows, logits_shown),
        "files": [{"label": str(label), "href": str(href)} for label, href in files],
        "cost": hv.cost(v.cost) if v else None,
        "extra": [{"name": str(name),
                   "table": table_view(list(rows), table_id=f"t-extra-{i}", max_rows=max_rows)}
                  for i, (name, rows) in enumerate((tables or {}).items())],
    }
    return _env().get_template("report.html.j2").render(ctx)


def _own_error_steps(v: Verdict | None) -> dict[str, Any] | None:
    """The chosen module's own error per step (and its peers' median) as a line chart and a table."""
    own = v.own_error_steps if v is not None else None
    if own is None or not own.rows:
        return None
    series = {"own error": {r.step: r.own_error for r in own.rows if r.own_error is not None}}
    peers = max((r.peers for r in own.rows), default=0)
    if peers:
        series[f"median of {peers} other layers"] = {r.step: r.peer_median for r in own.rows
                                                     if r.peer_median is not None}
    chart = line_chart(f"{own.module}: own error ({own.metric}) per step", series, x_label="step",
                       mark_x=v.replay.step if v is not None else None)
    if chart is None:
        return None
    return {"module": own.module, "metric": own.metric, "peers": peers, "chart": chart,
            "table": table_view(_rows(own.rows), table_id="t-own-steps", filters=False)}


def _dtype_baseline(v: Verdict | None) -> dict[str, Any] | None:
    """The logits' error per step, the target's beside the golden model's own in the target's dtype
    (``Verdict.dtype_baseline``), as a line chart."""
    base = v.dtype_baseline if v is not None else None
    if base is None:
        return None
    series = {"target": {r.step: r.target_rel_l2 for r in base.steps if r.target_rel_l2 is not None},
              f"golden model in {base.dtype}": {r.step: r.baseline_rel_l2 for r in base.steps
                                                if r.baseline_rel_l2 is not None}}
    chart = line_chart("logits: relative L2 from the golden's, per step", series, x_label="step",
                       mark_x=base.step)
    return {"dtype": base.dtype, "device": base.device, "step": base.step, "factor": f"{base.factor:g}",
            "covers": base.covers, "error": base.error, "chart": chart,
            "judged": "warn (none fails)" if base.warning else "fail"}


def _tree(topology: Mapping[str, Any] | None, v: Verdict | None,
          levels: Mapping[str, LevelRows]) -> dict[str, Any] | None:
    """The module tree with each module's raw error at the replayed step (its compare rows)."""
    step = v.replay.step if v else None
    raw: dict[str, float] = {}
    verdicts: dict[str, str] = {}
    for lv in levels.values():
        for (name, at), (err, verdict) in lv.outputs.items():
            if at == step:
                raw.setdefault(name, err)
                verdicts.setdefault(name, verdict)
    tree = module_tree(topology, v, raw, verdicts)
    if tree is not None:
        tree["step_label"] = hv.step_label(step) if step is not None else None
    return tree


@cache
def _asset(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def write_report(path: str | Path, **kwargs: Any) -> Path:
    """``render_report(**kwargs)`` written to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(**kwargs), encoding="utf-8")
    return path
