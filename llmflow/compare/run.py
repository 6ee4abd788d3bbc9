"""``compare_dumps``: the one library call behind the ``compare`` stage and ``llmflow compare``.

Check the options, open both dumps, pair their steps and tensors and say how (``pairing``), judge
whether enough paired (``completeness``), find where the texts part (``divergence``: rows of later
steps are marked diverged), decide the dtype that judges (the model's, recorded in
the dumps), compute every pair in parallel (``engine``), mark the layers whose error jumps over the
previous layer's (``jumps``), stream one CSV per level, derive the XLSX
(a sheet per level) from the CSVs and write ``compare_summary.json``: this module is its only
writer. Memory stays flat: rows go straight to disk, only the summary accumulates.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmflow.compare.algorithms import load_algorithms
from llmflow.compare.align import align_dumps, steps_text
from llmflow.compare.completeness import assess
from llmflow.compare.divergence import different_inputs, divergence, divergence_in_dumps, is_diverged
from llmflow.compare.engine import execute
from llmflow.compare.jumps import JumpJudge
from llmflow.compare.match import LEVELS
from llmflow.compare.options import CompareOptions, check_values
from llmflow.compare.pairing import plan_pairs
from llmflow.compare.rows import Job
from llmflow.compare.sheets import level_columns, write_sheets
from llmflow.compare.summary import SummaryBuilder, report_lines
from llmflow.compare.thresholds import coarser
from llmflow.dtypes import QUANTIZATION_DTYPES, dtype_class, dtype_name
from llmflow.errors import UserError
from llmflow.formats import DumpReader, open_dump
from llmflow.plugins import is_file_ref
from llmflow.report.tables import CsvStream
from llmflow.results.codec import to_json
from llmflow.results.compare import CompareSummary, JudgedAs, MissingStep

SUMMARY_FILE = "compare_summary.json"
XLSX_FILE = "compare.xlsx"


def output_names() -> list[str]:
    """Every file name ``compare_dumps`` may write in its ``out_dir``."""
    return [*(f"compare_{level}.csv" for level in LEVELS), XLSX_FILE, SUMMARY_FILE]


def check_options(opts: CompareOptions, flags: dict[str, str] | None = None) -> list[str]:
    """Refuse bad options before any work (UserError naming the field); the algorithms' column
    names. ``flags`` renames fields in messages (``{"target_dtype": "--target-dtype"}``)."""
    load_algorithms(opts.algorithms, opts.base_dir)  # bad refs fail here
    return check_values(opts, flags)


def _absolute_ref(ref: str, base_dir: str | Path) -> str:
    if not is_file_ref(ref):
        return ref
    path, _, attr = ref.rpartition(":")
    p = Path(path).expanduser()
    return f"{(p if p.is_absolute() else Path(base_dir) / p).resolve()}:{attr}"


def _reader(x: str | Path | DumpReader) -> DumpReader:
    return x if isinstance(x, DumpReader) else open_dump(x)


def recorded_dtype(reader: DumpReader) -> str | None:
    """The model dtype a dump recorded (llmflow's env.json: ``torch_settings.model_dtype``), if any."""
    env = reader.env() or {}
    for where in (env.get("torch_settings") or {}, env):
        value = where.get("model_dtype") if isinstance(where, dict) else None
        if isinstance(value, str) and value:
            return dtype_name(value)
    return None


def outputs_dtype(reader: DumpReader) -> str | None:
    """The float dtype most of a dump's outputs are in, for a dump that records no model dtype
    (msprobe, msit, ATB): its module (or layer) outputs', else its API calls'; None where it holds
    no float output. A bf16 model's float32 upcasts (an RMSNorm's, a softmax's) are the few: they
    carry the bf16 error of what they were computed from, and are judged at bf16 with the rest."""
    for levels in (("module", "layer"), ("api",)):
        counts = Counter(dtype_name(e.dtype) for e in reader.entries()
                         if e.kind == "output" and e.level in levels and e.dtype
                         and dtype_class(e.dtype) != "integer")
        if counts:
            return counts.most_common(1)[0][0]
    return None


def recorded_quantization(reader: DumpReader) -> str | None:
    """The dtype judging a quantized model's tensors that its dump recorded (llmflow's env.json:
    ``torch_settings.quantization``, ``w8a8``), None for a float model's dump."""
    value = ((reader.env() or {}).get("torch_settings") or {}).get("quantization")
    return value if isinstance(value, str) and value.lower() in QUANTIZATION_DTYPES.values() else None


def judging(golden: DumpReader, target: DumpReader, opts: CompareOptions) -> JudgedAs:
    """The dtype that judges the float rows and why: given, recorded in the dumps, or each tensor's;
    a quantized model's (recorded in its dump) coarsens either: its matmuls ran in int8 or int4."""
    quant = coarser(recorded_quantization(golden), recorded_quantization(target))
    quantized = (f"; a quantized checkpoint's Linear layers (recorded in its dump) judge the rows at {quant}"
                 if quant else "")
    if opts.target_dtype:
        given = coarser(opts.target_dtype, quant)
        return JudgedAs(dtype=given, given=given, recorded=None,
                        source="given (--target-dtype / target_dtype)" + quantized)
    found: dict[str, str] = {}  # side -> "<dtype> recorded" / "<dtype> in most outputs"
    dtypes: list[str | None] = []
    for side, reader in (("golden", golden), ("target", target)):
        d, how = recorded_dtype(reader), "recorded"
        if d is None:  # (msprobe, msit, ATB dumps): the dtype most of its outputs are in
            d, how = outputs_dtype(reader), "in most of its outputs"
        dtypes.append(d)
        if d is not None:
            found[side] = f"{d} {how}"
    model = coarser(coarser(*dtypes), quant)
    if model is None:
        return JudgedAs(dtype=None, given=None, recorded=None,
                        source="neither dump records its model's dtype")
    sides = " and ".join(f"{side} {d}" for side, d in found.items())
    return JudgedAs(dtype=model, given=None, recorded=model,
                    source=f"the model dtype each dump records, else the dtype most of its outputs are in "
                           f"({sides}); a coarser tensor dtype judges its own rows" + quantized)


def _pairing_hint(g_steps: list[int], t_steps: list[int], opts: CompareOptions) -> str:
    """What to check when no step pairs. A target whose steps all come after the golden's first
    (a dump that started counting at warm-up runs, msprobe's ``step: [2]``) pairs by a warmup of
    the difference: named with its value, as the CLI flag and the workflow parameter."""
    if g_steps and t_steps and not opts.warmup and not opts.pairs and min(t_steps) > min(g_steps):
        skip = min(t_steps) - min(g_steps)
        return (f"the target's steps start {skip} later: if its first {skip} step(s) were warm-up runs, "
                f"or its dump began at step {min(t_steps)}, pair with --warmup {skip} (workflow "
                f"parameter warmup: {skip}); else check steps and prefill_offset")
    return "check steps, prefill_offset, and that both dumps hold tensors"


def compare_dumps(golden: str | Path | DumpReader, target: str | Path | DumpReader, out_dir: str | Path,
                  opts: CompareOptions | None = None, *,
                  progress: Callable[[str, float | None], Any] | None = None,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Compare two dumps into ``out_dir``; returns ``{"csv": {level: path}, "xlsx", "summary_file",
    "summary"}`` (``summary``: the ``CompareSummary`` written to ``summary_file``).
    ``progress(description, total)`` returns a task with ``advance``/``update``."""
    opts = opts or CompareOptions()
    alg_names = check_options(opts)
    out = Path(out_dir)
    g_reader, t_reader = _reader(golden), _reader(target)
    problems = {side: list(r.problems()) for side, r in (("golden", g_reader), ("target", t_reader))}
    t0 = time.perf_counter()
    pairing = plan_pairs(g_reader, t_reader, step_pairs=opts.pairs, steps=opts.steps,
                         prefill_offset=opts.prefill_offset, warmup=opts.warmup, rank=opts.rank,
                         levels=opts.levels, mapping=opts.mapping, base_dir=opts.base_dir)
    pairs = pairing.pairs
    empty = _levels_without_rows(opts.levels, pairs, g_reader, t_reader)
    if not pairs and empty:  # what was asked for is not in the dumps: say that, not "check steps"
        raise UserError(f"compare: {'; '.join(empty.values())}")
    if not pairs:  # a compare of nothing must not read as a pass
        damage = next((f"; the {side} dump is damaged: {found[0]}" for side, found in problems.items()
                       if found), "")
        raise UserError(f"compare: nothing to compare: {g_reader.path} has steps "
                        f"{steps_text(g_reader.steps())}, {t_reader.path} has steps "
                        f"{steps_text(t_reader.steps())} and none pair up "
                        f"({_pairing_hint(g_reader.steps(), t_reader.steps(), opts)}){damage}")
    coverage = assess(pairing, g_reader, t_reader)
    judge_by = judging(g_reader, t_reader, opts)
    prefill = next((p.target_step for p in pairs if p.golden_step == 0), None)
    inputs_differ = different_inputs(g_reader, t_reader, prefill)
    # where the texts part: the dump stage's generation records, else the token ids every step of
    # both dumps records (all steps, not only the compared ones: a later step's ids date the part)
    parted = divergence(g_reader.path, t_reader.path)
    if parted is None and inputs_differ is None:
        every_step = opts.pairs if opts.pairs is not None else align_dumps(
            g_reader, t_reader, prefill_offset=opts.prefill_offset, warmup=opts.warmup)["pairs"]
        rank = opts.rank if opts.rank is not None else min(g_reader.ranks(), default=0)
        parted = divergence_in_dumps(g_reader, t_reader, every_step, rank=rank)
    token = parted.first_differing_token if parted else None
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused compare leaves no empty folder
    # file refs made absolute: worker processes (or dask workers) may run in another directory
    algs = [_absolute_ref(a, opts.base_dir) for a in opts.algorithms]
    job = Job(g_reader, t_reader, algs, str(opts.base_dir), opts.stats_only, opts.thresholds,
              judge_by.given, judge_by.recorded, kl=opts.kl)
    any_stats = opts.stats_only or any(
        not e.has_data for p in pairs if not p.unmatched for e in (p.golden, *p.targets) if e is not None)
    sharded = pairing.matching.tensor_parallel is not None
    streams: dict[str, CsvStream] = {}
    summary = SummaryBuilder()
    jumps = JumpJudge(opts.jump_ratio)  # (in execution order: a layer's row after the previous one's)
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
            if parted is not None:
                row["diverged"] = is_diverged(row.get("step"), token)
            jumps.judge(levels, row)
            line, line_columns = "", None  # a row of several levels is rendered once per set of columns
            for level in levels:
                stream = streams.get(level)
                if stream is None:
                    cols = level_columns(level, any_stats, not opts.stats_only, alg_names, sharded)
                    stream = streams[level] = CsvStream(out / f"compare_{level}.csv", cols)
                if stream.columns != line_columns:
                    line, line_columns = stream.render(row), stream.columns
                stream.write_line(line)
            summary.add(levels, row)
    finally:
        for s in streams.values():
            s.close()
    seconds = time.perf_counter() - t0
    order = [lv for lv in LEVELS if lv in streams]
    csvs = {lv: str(streams[lv].path) for lv in order}
    xlsx_path = out / XLSX_FILE if opts.xlsx else None
    final = Path(opts.final_dir) if opts.final_dir else out

    def named(p: str | Path) -> str:  # a path inside out_dir, as it will be found afterwards
        return str(final / Path(p).relative_to(out))

    result: CompareSummary = summary.result(
        golden_dump=str(g_reader.path), target_dump=str(t_reader.path),
        golden_format=g_reader.format, target_format=t_reader.format,
        mapping=pairing.mapping.name if pairing.mapping else None, matching=pairing.matching,
        judged_as=judge_by, divergence=parted, levels_without_rows=empty, coverage=coverage,
        problems=problems, algorithms=alg_names,
        missing_steps=[MissingStep(**m) for m in pairing.missing], pairs=len(pairs), bytes=done["bytes"],
        seconds=round(seconds, 3),
        gb_per_s=round(done["bytes"] / seconds / 1e9, 3) if seconds > 0 else None,
        csv={lv: named(p) for lv, p in csvs.items()}, xlsx=named(xlsx_path) if xlsx_path else None,
        kl=opts.kl, different_inputs=inputs_differ, stats_only=opts.stats_only)
    if xlsx_path is not None:  # (after the summary: its first sheet is the summary)
        write_sheets({lv: csvs[lv] for lv in order}, {lv: streams[lv].columns for lv in order}, xlsx_path,
                     alg_names, summary=result)
    summary_file = out / SUMMARY_FILE
    summary_file.write_text(json.dumps(to_json(result), indent=1), encoding="utf-8")
    if log is not None:
        c = result.counts
        log(f"compare: {len(pairs)} pairs in {seconds:.1f}s: {c['pass']} pass, {c['warn']} warn, "
            f"{c['fail']} fail, {c['unmatched']} unmatched")
        for line in report_lines(result):
            log(f"compare: {line}")
    return {"csv": csvs, "xlsx": str(xlsx_path) if xlsx_path else None, "summary_file": str(summary_file),
            "summary": result}


def _levels_without_rows(levels: list[str] | None, pairs: list, golden: DumpReader,
                         target: DumpReader) -> dict[str, str]:
    """Asked-for levels no pair belongs to: level -> why, in words (the dump that has none)."""
    from llmflow.compare.match import entry_levels

    asked = [lv for lv in levels or () if not any(lv in p.levels for p in pairs)]
    if not asked:
        return {}
    held = {side: {lv for e in r.entries() for lv in entry_levels(e)}
            for side, r in (("golden", golden), ("target", target))}
    out = {}
    for lv in asked:
        lacking = [side for side in ("golden", "target") if lv not in held[side]]
        which = " and ".join(f"the {side} dump" for side in lacking) or "no pair of the two dumps"
        has = sorted(held[lacking[0]] if lacking else set(), key=LEVELS.index)
        verb = "have" if len(lacking) == 2 else "has"
        out[lv] = f"level {lv}: {which} {verb} no {lv} rows" + (f" (only {', '.join(has)})" if has else "")
    return out
