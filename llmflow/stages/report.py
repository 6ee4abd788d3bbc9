"""The ``report`` stage: one self-contained HTML file from a verdict, compare tables and the run.

A thin adapter over ``llmflow.report.html``: reads the bisect stage's ``verdict_file`` (and the
first bad op's tensors it names beside it, ``first_bad_op.safetensors``), streams
the compare stage's CSVs (``csv``: level -> path) and reads the ``compare_summary.json`` the
compare wrote beside them, reads each dump's ``env.json`` and
``topology.json`` (``golden_dump``, ``target_dump``) and the run's parameters
(``<run-dir>/summary.json``), and writes ``report.html``.
Every input is optional. Links to the CSV/XLSX files are relative to the stage's final directory,
so the run directory can be moved or zipped whole and the links still work.

The page leads with the run's conclusion: the bisect's verdict when there is one (the bisect
reads the compare's rows and is the authority over them), else the outcome of the compare or the
precheck, the most severe when both are there, in the words those stages gave the run.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from llmflow.checks.env_diff import load_env
from llmflow.dtypes import dtype_name
from llmflow.errors import UserError
from llmflow.report.html import MAX_ROWS, summarize_levels, write_report
from llmflow.report.html_verdict import StageOutcome
from llmflow.report.tables import read_csv_rows
from llmflow.results.codec import RecordError, from_json, to_json
from llmflow.results.compare import CompareSummary, read_compare_summary
from llmflow.results.summary import ReportBlock
from llmflow.results.verdict import Verdict
from llmflow.stages.base import OUTCOMES, Stage, StageContext

_PATH = {"type": ["string", "null"], "default": None}


class ReportStage(Stage):
    """Write a self-contained HTML report: verdict, run, texts, charts, heat map, linked tables."""

    type: ClassVar[str] = "report"
    version: ClassVar[str] = "3"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "title": {"type": "string", "default": "llmflow report", "description": "The page title."},
            "verdict_file": {**_PATH,
                             "description": "The bisect stage's verdict_file (verdict, texts, charts)."},
            "csv": {"type": ["object", "string", "null"], "default": None,
                    "description": "Compare tables: the compare stage's csv output (level -> path) "
                    "or one path."},
            "xlsx": {**_PATH, "description": "The compare stage's xlsx output, linked from the page."},
            "golden_dump": {**_PATH, "description": "The golden dump directory (or its env.json): the "
                            "prompt, model, device, dtype and versions shown for the golden side."},
            "target_dump": {**_PATH, "description": "The target dump directory (or its env.json)."},
            "precheck_file": {**_PATH, "description": "The precheck stage's report_file (precheck.json): its "
                              "calls, worst first (precheck.csv beside it), and the counts per API."},
            "max_rows": {"type": "integer", "minimum": 1, "default": MAX_ROWS,
                         "description": "Rows per table in the page (the CSV keeps them all)."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {"html": "report.html, self-contained (no network)"}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        p = self.params(ctx)
        verdict = _read_verdict(ctx, p["verdict_file"]) if p["verdict_file"] else None
        csvs = p["csv"] or {}
        if isinstance(csvs, str):
            csvs = {Path(csvs).stem: csvs}
        files: list[tuple[str, str]] = []
        task = ctx.task(f"{ctx.stage_id}: tables", total=len(csvs))
        paths = {level: ctx.resolve_path(csv_path) for level, csv_path in csvs.items()}
        hrefs = {level: _href(path, ctx.final_dir) for level, path in paths.items()}
        files += [(path.name, hrefs[level]) for level, path in paths.items()]

        tap = _RowTap(verdict)

        def rows_of(path: Path) -> Iterator[dict[str, Any]]:
            for row in _csv_rows(path, ctx.stage_id):
                tap.see(row, path)
                yield row
            task.advance()

        levels = summarize_levels({level: rows_of(path) for level, path in paths.items()}, p["max_rows"],
                                  hrefs)
        if p["xlsx"]:
            xlsx = ctx.resolve_path(p["xlsx"])
            files.append((xlsx.name, _href(xlsx, ctx.final_dir)))
        outcomes: list[StageOutcome] = []
        tables: dict[str, list[dict[str, Any]]] = {}
        if p["precheck_file"]:
            tables, precheck_outcome = _precheck_tables(ctx, p["precheck_file"], files)
            outcomes += [precheck_outcome] if precheck_outcome is not None else []
        compare_summary = _compare_summary(ctx, list(paths.values()))
        problems: list[str] = []
        notes: list[str] = []
        if compare_summary is not None:
            from llmflow.compare.summary import report_lines

            # the words the compare stage gives the run (summary.json's outcome and the last line)
            said = compare_summary.outcome
            outcomes.append(StageOutcome(said.status, f"compare: {said.headline}", said.next))
            problems = [f"{side} dump: {problem}" for side, items in compare_summary.problems.items()
                        for problem in items]
            notes = report_lines(compare_summary)
        run = {"env": {side: _env(ctx, p[f"{side}_dump"]) for side in ("golden", "target")
                       if p[f"{side}_dump"]}, **_run_record(ctx.run_dir)}
        panel = _kept_op_panel(ctx, verdict, p["verdict_file"], run["env"]) if verdict is not None else None
        if panel is None and p["golden_dump"] and p["target_dump"]:
            panel = _op_panel(ctx, tap, p["golden_dump"], p["target_dump"], run["env"])
            if panel is not None and verdict is not None and verdict.first_bad_op:
                panel["notes"].insert(0, _NOT_KEPT if verdict.first_bad_op_tensors is None else
                                      f"{verdict.first_bad_op_tensors.file} cannot be read: the nearest "
                                      "tensor the dumps hold is shown instead")
        out = write_report(ctx.out_dir / "report.html", title=p["title"], verdict=verdict,
                           outcome=_most_severe(outcomes), problems=problems, compare_notes=notes,
                           compare=levels,
                           files=files, run=run, meta={"run": str(ctx.run_dir)}, max_rows=p["max_rows"],
                           topology=_topology(ctx, [p["target_dump"], p["golden_dump"]]), op_panel=panel,
                           tables=tables)
        ctx.summary["report"] = to_json(ReportBlock(html=str(out)))
        ctx.log(f"{ctx.stage_id}: wrote {out.name} ({out.stat().st_size / 1e3:.0f} kB)")
        return {"html": str(out)}


def _read_verdict(ctx: StageContext, verdict_file: str) -> Verdict:
    """The bisect's verdict.json as a ``Verdict``; a file that is not one fails in one line
    naming the file and the first field that does not fit."""
    path = ctx.resolve_path(verdict_file)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{ctx.stage_id}: verdict_file: cannot read {path}: {exc}") from exc
    try:
        return from_json(Verdict, data, where="verdict")
    except RecordError as exc:
        raise UserError(f"{ctx.stage_id}: verdict_file: {path} is not a bisect verdict: {exc}") from None


def _most_severe(outcomes: list[StageOutcome]) -> StageOutcome | None:
    """The outcome the run concludes from stages none of which needs another: the most severe
    (fail, then inconclusive, then pass), the first among equals."""
    return max(outcomes, key=lambda o: OUTCOMES.index(o.status), default=None)


def _compare_summary(ctx: StageContext, csv_paths: list[Path]) -> CompareSummary | None:
    """The ``compare_summary.json`` the compare wrote beside ``csv_paths`` (its outcome, its dumps'
    problems, its notes on pairing); None when the CSVs are not one compare's output. One that
    is there but cannot be read fails the report in one line naming the file."""
    from llmflow.compare.run import SUMMARY_FILE

    folders = {csv_path.parent for csv_path in csv_paths}
    if len(folders) != 1:
        return None
    summary_path = folders.pop() / SUMMARY_FILE
    if not summary_path.is_file():
        return None
    try:
        summary = read_compare_summary(summary_path)
    except UserError as exc:
        raise UserError(f"{ctx.stage_id}: csv: the compare summary beside the tables cannot be read: "
                        f"{exc}") from None
    written = {Path(listed).name for listed in summary.csv.values()}
    if not {csv_path.name for csv_path in csv_paths} <= written:  # another compare's: not these rows'
        ctx.log(f"{ctx.stage_id}: {summary_path} is not the summary of these tables: "
                "the page shows no compare outcome")
        return None
    return summary


def _precheck_tables(ctx: StageContext, report_file: str, files: list[tuple[str, str]]
                     ) -> tuple[dict[str, list[dict[str, Any]]], StageOutcome | None]:
    """The precheck's sections: its calls (precheck.csv beside ``report_file``, worst first,
    headed by the verdict) and its counts per API; its csv/xlsx/json are linked in ``files``.
    And the precheck's outcome (None when its status is not one)."""
    from llmflow.checks.precheck import COLUMNS

    path = ctx.resolve_path(report_file)
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{ctx.stage_id}: precheck_file: cannot read {path}: {exc}") from exc
    csv_path = path.with_name("precheck.csv")
    text = [c for c in (*COLUMNS, "repro") if c not in ("rank", "step", "order") and "ratio" not in c
            and "error" not in c]
    try:
        calls = list(read_csv_rows(csv_path, text_columns=text))
    except OSError as exc:
        raise UserError(f"{ctx.stage_id}: precheck_file: cannot read {csv_path}: "
                        f"{exc.strerror or exc}") from exc
    for sibling in (csv_path, path.with_name("precheck.xlsx"), path):
        if sibling.is_file():
            files.append((sibling.name, _href(sibling, ctx.final_dir)))
    status = str(summary.get("status", "")).upper()
    headline = str(summary.get("headline", ""))
    per_api = [{"api": api, **counts} for api, counts in (summary.get("counts") or {}).items()]
    outcome = StageOutcome(status.lower(), headline, str(summary.get("next") or "")) \
        if status.lower() in OUTCOMES else None
    return ({f"Precheck: {status}: {headline.removeprefix('precheck: ')}": calls,
             "Precheck: calls per API": per_api}, outcome)


def _href(path: Path, page_dir: Path) -> str:
    """``path`` relative to the page's final directory, as a URL path (forward slashes)."""
    rel = os.path.relpath(path.resolve(), page_dir.resolve())
    return Path(rel).as_posix()


def _csv_rows(path: Path, stage_id: str) -> Iterator[dict[str, Any]]:
    """The CSV's rows, streamed (a 7B compare has ~100k rows a level) and read back by the one
    CSV rule, ``read_csv_rows``."""
    from llmflow.compare.sheets import LABEL_COLUMNS, TEXT_COLUMNS  # (schema: no torch)

    try:
        yield from read_csv_rows(path, TEXT_COLUMNS, LABEL_COLUMNS)
    except OSError as exc:
        raise UserError(f"{stage_id}: csv: cannot read {path}: {exc.strerror or exc}") from exc


def _env(ctx: StageContext, source: str) -> dict[str, Any] | None:
    """A dump's env.json; None (and a log line) when the dump recorded none."""
    try:
        return load_env(ctx.resolve_path(source))
    except (UserError, OSError, ValueError) as exc:
        ctx.log(f"{ctx.stage_id}: no environment shown: {exc}")
        return None


# what the op panel shows, in words and as its heading: the verdict's first bad op, module, layer,
# or the compare's first failing row
_TITLE = ("The first bad op in detail", "The chosen module's output in detail",
          "The first bad layer's output in detail", "The first failing tensor in detail")
_WHAT = ("the first bad op's output", "the chosen module's output (the dumps hold no tensors of its ops)",
         "the first bad layer's output (the dumps hold no tensors of the chosen module or its ops)",
         "the first failing compare row before the texts part")


class _RowTap:
    """Keeps, while the compare rows stream past, the rows the op panel may show: every step of
    the first bad op, module and layer (the finest the dumps hold is shown), and the compare's
    first failing row before the texts part (the earliest by step, rank and execution order, as
    the compare's headline names it; shown when the dumps hold none of those)."""

    def __init__(self, verdict: Verdict | None):
        finest_first = (verdict.first_bad_op, verdict.first_bad_module, verdict.first_bad_layer) \
            if verdict is not None else (None, None, None)
        # each name the verdict gives, with the index in _WHAT that says what it is
        self.wanted = [(n, i) for i, n in enumerate(finest_first) if n]
        self.rows: dict[str, dict[int, dict[str, Any]]] = {n: {} for n, _ in self.wanted}
        self.first_fail: dict[str, Any] | None = None
        self.first_fail_source: Path | None = None  # the CSV it came from
        # the replayed step: the one the panel shows when it can
        self.step = verdict.replay.step if verdict is not None else None

    def see(self, row: dict[str, Any], source: Path | None = None) -> None:
        if not _shown(row):
            return
        name = str(row.get("name"))
        if name in self.rows and isinstance(row.get("step"), int):
            self.rows[name].setdefault(row["step"], row)
        if row.get("verdict") == "fail" and not row.get("diverged") and \
                (self.first_fail is None or _row_place(row) < _row_place(self.first_fail)):
            self.first_fail, self.first_fail_source = row, source

    def gather_first_fail(self, rows: Iterable[dict[str, Any]]) -> None:
        """Every step's row of the first failing tensor (same name and rank) from ``rows``, its
        CSV read again: which tensor that is was known only once every row had streamed past."""
        if self.first_fail is None:
            return
        name, rank = str(self.first_fail.get("name")), self.first_fail.get("rank")
        by_step = self.rows.setdefault(name, {})
        for row in rows:
            if str(row.get("name")) == name and row.get("rank") == rank and isinstance(row.get("step"), int) \
                    and _shown(row):
                by_step.setdefault(row["step"], row)

    def pick(self, step: Any) -> tuple[dict[str, Any], int] | None:
        """The row to show, and the index in _WHAT that says what it is."""
        for name, what in self.wanted:
            by_step = self.rows[name]
            if by_step:
                return by_step.get(step) or by_step[min(by_step)], what
        return (self.first_fail, len(_WHAT) - 1) if self.first_fail else None


def _shown(row: dict[str, Any]) -> bool:
    """Is ``row`` one the op panel can show: a tensor's first output, with data on both sides?"""
    return bool(row.get("golden_data_path") and row.get("target_data_path")) \
        and str(row.get("kind") or "output") == "output" and row.get("index") in (0, None)


def _row_place(row: dict[str, Any]) -> tuple[float, float, float]:
    """Where a row lies in the run: its step, rank and execution order, the order in which the
    compare's summary picks its first failing row (``compare.summary.conclude``; no order: 0)."""
    def number(key: str, missing: float) -> float:
        value = row.get(key)
        return float(value) if isinstance(value, (int, float)) else missing
    return number("step", math.inf), number("rank", math.inf), number("order", 0.0)


_NOT_KEPT = ("the verdict keeps no tensors of the first bad op (no op level ran, or a verdict written before "
             "the bisect kept them): the nearest tensor the dumps hold is shown instead")


def _heads(envs: dict[str, Any]) -> int | None:
    """The model's attention heads from a dump's env.json (model_config), when it recorded them."""
    config = ((envs.get("target") or envs.get("golden") or {}).get("model_config") or {})
    heads = config.get("num_attention_heads")
    return heads if isinstance(heads, int) else None


def _kept_op_panel(ctx: StageContext, verdict: Verdict, verdict_file: str,
                   envs: dict[str, Any]) -> dict[str, Any] | None:
    """The op panel from the first bad op's own tensors, the file the bisect wrote beside
    verdict.json; None (and a log line when the verdict names a file) when there is none."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from llmflow.report.html_op import inspect_command, op_panel

    kept = verdict.first_bad_op_tensors
    if kept is None:
        return None
    if kept.file in ("", ".", "..") or Path(kept.file).name != kept.file:  # beside verdict.json, nowhere else
        ctx.log(f"{ctx.stage_id}: the first bad op's tensors are not read: {kept.file!r} is not a file name")
        return None
    path = ctx.resolve_path(verdict_file).parent / kept.file
    try:
        tensors = load_file(str(path))
        golden, target = tensors["golden.output.0"], tensors["target.output.0"]
    except (OSError, SafetensorError, KeyError) as exc:
        ctx.log(f"{ctx.stage_id}: the first bad op's tensors cannot be read from {path}: {exc}")
        return None
    against = f" against the golden's {kept.golden_op} (the value it rewrites)" if kept.golden_op else ""
    commands = [inspect_command(str(path), f"{side}.output.0") for side in ("golden", "target")]
    panel = op_panel(golden, target, name=kept.op, step=kept.step,
                     what=f"its output in the bisect's op replay on the golden inputs{against}, "
                          f"kept in {kept.file}",
                     commands=commands,
                     heads=_heads(envs), golden_dtype=dtype_name(golden.dtype),
                     target_dtype=dtype_name(target.dtype))
    panel["notes"] += kept.notes
    if kept.sampled:  # a flattened sample has no heads or channels to split the error by
        panel.pop("split", None)
    return panel


def _op_panel(ctx: StageContext, tap: _RowTap, golden_dump: str, target_dump: str,
              envs: dict[str, Any]) -> dict[str, Any] | None:
    """The op panel from the two tensors of the row ``tap`` picked, loaded through the dump
    readers by the row's locators; None (and a log line) when there is no row or a side cannot
    be read."""
    from llmflow.formats import open_dump
    from llmflow.formats.describe import find_entries
    from llmflow.report.html_op import inspect_command, op_panel

    picked = tap.pick(tap.step)
    if picked is None:
        return None
    row, which = picked
    if which == len(_WHAT) - 1 and tap.first_fail_source is not None:  # (its per-step chart)
        tap.gather_first_fail(_csv_rows(tap.first_fail_source, ctx.stage_id))
    dumps = {"golden": ctx.resolve_path(golden_dump), "target": ctx.resolve_path(target_dump)}
    tensors, locators = {}, {}
    try:
        for side, dump in dumps.items():
            reader = open_dump(dump)
            locators[side], join = _row_parts(row, side)
            loaded = [reader.load(_row_entry(find_entries(reader, loc, step=None), row))
                      for loc in locators[side]]
            tensors[side] = join(loaded)
    except Exception as exc:  # a damaged or moved dump: the page goes on without the panel
        ctx.log(f"{ctx.stage_id}: no op panel: {row.get('name')} step {row.get('step')}: {exc}")
        return None
    what = _WHAT[which] + _joined_note(row, len(locators["target"]))
    name = str(row.get("name"))
    by_step = {s: float(r["relative_euclidean_distance"]) for s, r in tap.rows.get(name, {}).items()
               if isinstance(r.get("relative_euclidean_distance"), (int, float))}
    parted = [s for s, r in tap.rows.get(name, {}).items() if r.get("diverged")]
    return op_panel(tensors["golden"], tensors["target"], name=name, step=row.get("step"), what=what,
                    commands=[inspect_command(str(dumps[side]), loc)
                              for side in ("golden", "target") for loc in locators[side]],
                    heads=_heads(envs),
                    golden_dtype=str(row.get("golden_dtype") or ""),
                    target_dtype=str(row.get("target_dtype") or ""),
                    per_step=by_step if len(by_step) > 1 else None,
                    per_step_label=f"raw error of {name}'s output per step "
                                   "(compare rows; grey: after the texts part)",
                    diverged_after=min(parted) - 1 if parted else None, title=_TITLE[which])


def _row_entry(found: list[Any], row: dict[str, Any]) -> Any:
    """Of the entries stored at a row's locator, the row's own (a logits entry shares its file with
    the output head that computed every position, and holds its last position alone)."""
    return next((e for e in found if e.name == row.get("name")), found[0])


def _row_parts(row: dict[str, Any], side: str) -> tuple[list[str], Callable[[list[Any]], Any]]:
    """The locators of one side of a compare row, and how their tensors make the tensor the row
    compared: one tensor as it is; a sharded target's ranks joined as the compare joined them
    (``shards`` column); a many-to-one mapping's terms summed."""
    from llmflow.compare.mappings import SUM
    from llmflow.compare.shards import PARTS_JOIN, join_tensors, label_join

    path = str(row[f"{side}_data_path"])
    joined = label_join(row.get("shards")) if side == "target" else None
    if joined is None:
        names = str(row.get("target_name") or "").split(PARTS_JOIN) if side == "target" else []
        parts = path.split(PARTS_JOIN)
        if len(parts) > 1 and len(parts) == len(names):  # a mapping's terms, compared as their sum
            return parts, lambda tensors: join_tensors(SUM, tensors)
        return [path], lambda tensors: tensors[0]
    ranks, merge, worst = joined
    parts = path.split(PARTS_JOIN)
    if len(parts) != ranks:
        raise ValueError(f"the row joins {ranks} ranks but lists {len(parts)} locators: {path!r}")
    if worst is not None:  # replicated copies that differ: the row compared the worst rank's
        return [parts[min(worst, ranks - 1)]], lambda tensors: tensors[0]
    return parts, lambda tensors: join_tensors(merge, tensors)


def _joined_note(row: dict[str, Any], parts: int) -> str:
    """What the panel's description adds when the target's tensor joins several."""
    from llmflow.compare.shards import label_join

    joined = label_join(row.get("shards"))
    if joined is not None and parts > 1:
        return f", the target's {joined[0]} ranks joined as the compare joins them ({joined[1]})"
    return f", the target's {parts} mapped tensors summed" if parts > 1 else ""


def _topology(ctx: StageContext, dumps: list[str | None]) -> dict[str, Any] | None:
    """The module tree from the first of ``dumps`` that recorded one (``topology.json`` beside
    its env.json); None when neither did (other formats)."""
    for source in dumps:
        if not source:
            continue
        path = ctx.resolve_path(source)
        path = path / "topology.json" if path.is_dir() else path.with_name("topology.json")
        try:
            tree = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            ctx.log(f"{ctx.stage_id}: no module tree shown: {path}: {exc}")
            continue
        if isinstance(tree, dict):
            return tree
    return None


def _run_record(run_dir: Path) -> dict[str, Any]:
    """The workflow's name and parameters from ``<run-dir>/summary.json`` (written by the runner
    before any stage runs); nothing when the stage runs outside a workflow."""
    try:
        head = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(head, dict):
        return {}
    return {"workflow": head.get("workflow"), "params": head.get("params") or {}}
