"""``compare_dumps``: the one library call behind the ``compare`` stage and ``llmflow compare``.

Open both dumps, pair their steps (``align``), pair the tensors of each step (``match``), compute
every pair in parallel (``engine``), stream one CSV per level, then derive the XLSX (a sheet per
level) from the CSVs and write ``compare_summary.json``. Memory stays flat: rows go straight to
disk, only the summary accumulates.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmflow.compare.algorithms import algorithm_name, load_algorithms
from llmflow.compare.align import align_dumps
from llmflow.compare.engine import execute
from llmflow.compare.mappings import load_mapping
from llmflow.compare.match import LEVELS, Pair, match_step
from llmflow.compare.metrics import COUNT_COLUMNS, METRIC_COLUMNS, STAT_COLUMNS
from llmflow.compare.rows import ID_COLUMNS, LOGITS_COLUMNS, TAIL_COLUMNS, Job
from llmflow.compare.summary import SummaryBuilder
from llmflow.errors import UserError
from llmflow.formats import DumpReader, open_dump
from llmflow.plugins import is_file_ref
from llmflow.report.tables import CsvStream, read_csv_rows, write_xlsx

TEXT_COLUMNS = ("name", "target_name", "kind", "index", "match", "module_type", "golden_dtype",
                "target_dtype", "golden_shape", "target_shape", "verdict", "reason")
SUMMARY_FILE = "compare_summary.json"


@dataclass
class CompareOptions:
    """Everything ``compare_dumps`` can be told (the compare stage's parameters)."""

    pairs: list[dict[str, int]] | None = None
    levels: list[str] | None = None
    thresholds: dict | None = None
    algorithms: list[str] = field(default_factory=list)
    mapping: str | None = None
    executor: str = "local"
    scheduler_address: str | None = None
    workers: int | None = None
    rank: int | None = None
    steps: list[int] | None = None
    stats_only: bool = False
    target_dtype: str | None = None
    base_dir: str = "."
    xlsx: bool = True
    client: Any = None  # an existing dask.distributed Client (tests, notebooks)


def _absolute_ref(ref: str, base_dir: str | Path) -> str:
    if not is_file_ref(ref):
        return ref
    path, _, attr = ref.rpartition(":")
    p = Path(path).expanduser()
    return f"{(p if p.is_absolute() else Path(base_dir) / p).resolve()}:{attr}"


def _reader(x: str | Path | DumpReader) -> DumpReader:
    return x if isinstance(x, DumpReader) else open_dump(x)


def build_pairs(golden: DumpReader, target: DumpReader, opts: CompareOptions,
                mapping: Any = None) -> tuple[list[Pair], list[dict[str, Any]]]:
    """Every tensor pair to compute (in step, rank, execution order) and the missing steps."""
    missing: list[dict[str, Any]] = []
    if opts.pairs is None:
        aligned = align_dumps(golden, target, steps=opts.steps)
        step_pairs, missing = aligned["pairs"], aligned["missing"]
    else:
        wanted = set(opts.steps) if opts.steps is not None else None
        step_pairs = [p for p in opts.pairs if wanted is None or p["golden_step"] in wanted]
    g_idx: dict[tuple[int, int], list] = defaultdict(list)
    t_idx: dict[tuple[int, int], list] = defaultdict(list)
    for e in golden.entries():
        g_idx[(e.rank, e.step)].append(e)
    for e in target.entries():
        t_idx[(e.rank, e.step)].append(e)
    ranks = sorted({r for r, _ in g_idx} | {r for r, _ in t_idx})
    if opts.rank is not None:
        if opts.rank not in ranks:
            raise UserError(f"compare: rank {opts.rank} is in neither dump (ranks: {ranks})")
        ranks = [opts.rank]
    pairs: list[Pair] = []
    for sp in step_pairs:
        gs, ts = int(sp["golden_step"]), int(sp["target_step"])
        for r in ranks:
            pairs.extend(match_step(g_idx.get((r, gs), ()), t_idx.get((r, ts), ()), golden_step=gs,
                                    target_step=ts, rank=r, mapping=mapping, levels=opts.levels))
    return pairs, missing


def level_columns(level: str, stats: bool, tensors: bool, alg_names: Iterable[str]) -> list[str]:
    """The fixed header of one level's CSV (fixed so rows can be streamed)."""
    cols = list(ID_COLUMNS)
    if tensors:
        cols += list(METRIC_COLUMNS)
    if stats:
        cols += list(STAT_COLUMNS)
    cols += list(COUNT_COLUMNS) + ["numel", "shape_mismatch", "dtype_mismatch"]
    if level == "logits":
        cols += LOGITS_COLUMNS
    for name in alg_names:
        cols += [name, f"{name}_message"]
    return cols + TAIL_COLUMNS


def compare_dumps(golden: str | Path | DumpReader, target: str | Path | DumpReader, out_dir: str | Path,
                  opts: CompareOptions | None = None, *,
                  progress: Callable[[str, float | None], Any] | None = None,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Compare two dumps into ``out_dir``; returns ``{"csv": {level: path}, "xlsx", "summary_file",
    "summary"}``. ``progress(description, total)`` returns a task with ``advance``/``update``."""
    opts = opts or CompareOptions()
    for lv in opts.levels or ():
        if lv not in LEVELS:
            raise UserError(f"compare: levels: unknown level {lv!r} (known: {', '.join(LEVELS)})")
    out = Path(out_dir)
    g_reader, t_reader = _reader(golden), _reader(target)
    mapping = load_mapping(opts.mapping, opts.base_dir) if opts.mapping else None
    load_algorithms(opts.algorithms, opts.base_dir)  # fail fast on bad refs, before any work
    alg_names = [algorithm_name(a) for a in opts.algorithms]
    t0 = time.perf_counter()
    pairs, missing = build_pairs(g_reader, t_reader, opts, mapping)
    if not pairs:  # a compare of nothing must not read as a pass
        raise UserError(f"compare: nothing to compare: {g_reader.path} has steps {_span(g_reader.steps())}, "
                        f"{t_reader.path} has steps {_span(t_reader.steps())} and none pair up "
                        "(check steps, prefill_offset, and that both dumps hold tensors)")
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused compare leaves no empty folder
    # file refs made absolute: worker processes (or dask workers) may run in another directory
    algs = [_absolute_ref(a, opts.base_dir) for a in opts.algorithms]
    job = Job(g_reader, t_reader, algs, str(opts.base_dir), opts.stats_only, opts.thresholds,
              opts.target_dtype)
    any_stats = opts.stats_only or any(
        not e.has_data for p in pairs if not p.unmatched for e in (p.golden, *p.targets) if e is not None)
    any_tensors = not opts.stats_only
    streams: dict[str, CsvStream] = {}
    summary = SummaryBuilder()
    task = progress("compare", len(pairs)) if progress else None
    done = {"pairs": 0, "bytes": 0}

    def on_chunk(n: int, nbytes: int) -> None:
        done["pairs"] += n
        done["bytes"] += nbytes
        if task is not None:
            dt = max(time.perf_counter() - t0, 1e-9)
            task.advance(n)
            task.update(description=f"compare {done['pairs'] / dt:,.0f} pairs/s "
                                    f"{done['bytes'] / dt / 1e9:.2f} GB/s")

    try:
        for levels, row, _ in execute(job, pairs, executor=opts.executor, workers=opts.workers,
                                      scheduler_address=opts.scheduler_address, client=opts.client,
                                      on_chunk=on_chunk):
            for level in levels:
                if level not in streams:
                    cols = level_columns(level, any_stats, any_tensors, alg_names)
                    streams[level] = CsvStream(out / f"compare_{level}.csv", cols)
                streams[level].write(row)
            summary.add(levels, row)
    finally:
        for s in streams.values():
            s.close()
    seconds = time.perf_counter() - t0
    order = [lv for lv in LEVELS if lv in streams]
    csvs = {lv: str(streams[lv].path) for lv in order}
    xlsx_path = None
    if opts.xlsx:
        xlsx_path = out / "compare.xlsx"
        text = TEXT_COLUMNS + tuple(f"{a}_message" for a in alg_names)
        write_xlsx({lv: read_csv_rows(csvs[lv], text) for lv in order} or {"empty": []}, xlsx_path,
                   columns={lv: streams[lv].columns for lv in order})
    result = summary.result(
        golden_dump=str(g_reader.path), target_dump=str(t_reader.path),
        mapping=mapping.name if mapping else None, algorithms=alg_names, missing_steps=missing,
        pairs=len(pairs), bytes=done["bytes"], seconds=round(seconds, 3),
        gb_per_s=round(done["bytes"] / seconds / 1e9, 3) if seconds > 0 else None,
        csv=csvs, xlsx=str(xlsx_path) if xlsx_path else None)
    summary_file = out / SUMMARY_FILE
    summary_file.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    if log is not None:
        c = result["counts"]
        log(f"compare: {len(pairs)} pairs in {seconds:.1f}s: {c['pass']} pass, {c['warn']} warn, "
            f"{c['fail']} fail, {c['unmatched']} unmatched")
    return {"csv": csvs, "xlsx": str(xlsx_path) if xlsx_path else None, "summary_file": str(summary_file),
            "summary": result}


def _span(steps: list[int]) -> str:
    return "none" if not steps else f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
