"""Compare a golden dump with a target dump (or two tensor files), msit llm compare's flags.

  llmflow compare -gp GOLDEN -mp MY [-o OUT] [-cl LEVEL ...] [-st] [-alg FILE.py:FUNC ...]
                  [-mf MAPPING] [-r RANK] [--workers N] [--prefill-offset N]

GOLDEN and MY are dump directories of any format llmflow reads (llmflow, msit, ATB, msprobe):
the steps are aligned, the tensors matched (by name, through the op-mapping file -mf, or by
topology order), every pair compared in parallel, and OUT gets compare_<level>.csv, compare.xlsx
and compare_summary.json. Two tensor files (.safetensors, .npy, .pt/.pth) are compared directly
and their metrics printed. The last line is PASSED, or FAILED when any row fails (exit 1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from llmflow.cli.common import console, verdict_line
from llmflow.errors import UserError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-gp", "--golden-path", required=True, help="golden dump directory or tensor file")
    parser.add_argument("-mp", "--my-path", required=True, help="target dump directory or tensor file")
    parser.add_argument("-o", "--output", default=None,
                        help="output directory (default: ./llmflow_compare_<timestamp>)")
    parser.add_argument("-cl", "--cmp-level", nargs="+", default=None, metavar="LEVEL",
                        help="levels: logits layer module api save (default: all present)")
    parser.add_argument("-st", "--stats", action="store_true", help="compare statistics only")
    parser.add_argument("-alg", "--custom-algorithms", nargs="+", default=[], metavar="FILE.py:FUNC",
                        help="custom algorithms func(golden, target) -> (value, message)")
    parser.add_argument("-mf", "--op-mapping-file", default=None, metavar="MAPPING",
                        help="op-mapping YAML/JSON file or a mapping name (atb-llama)")
    parser.add_argument("-r", "--rank", type=int, default=None, help="compare only this rank")
    parser.add_argument("--workers", type=int, default=None,
                        help="parallel workers (default: CPU cores): processes for many small pairs, "
                        "threads in this process otherwise")
    parser.add_argument("--steps", type=int, nargs="+", default=None, help="golden steps to compare")
    parser.add_argument("--prefill-offset", type=int, default=0,
                        help="target folders holding prefill + first decode (ATB: 1)")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up folders at the start of the target")
    parser.add_argument("--target-dtype", default=None,
                        help="dtype whose thresholds judge (default: each tensor's own)")
    parser.add_argument("--thresholds", default=None, metavar="JSON|FILE",
                        help="verdict limits as JSON or a YAML/JSON file: {metric: {warn, fail}}")
    parser.add_argument("--executor", choices=["local", "dask"], default="local")
    parser.add_argument("--scheduler-address", default=None, help="dask scheduler for --executor dask")
    parser.add_argument("--no-xlsx", action="store_true", help="write CSV only")


def _thresholds(text: str | None) -> dict | None:
    if not text:
        return None
    import yaml

    p = Path(text)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) if p.is_file() else yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"--thresholds: not valid JSON/YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise UserError(f"--thresholds: expected a mapping, got {data!r}")
    return data


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else str(v)


def _files(args: argparse.Namespace) -> int:
    from rich.table import Table

    from llmflow.compare.files import compare_files

    rows = compare_files(args.golden_path, args.my_path, algorithms=args.custom_algorithms,
                         thresholds=_thresholds(args.thresholds), target_dtype=args.target_dtype)
    table = Table(title=f"{args.golden_path} vs {args.my_path}")
    table.add_column("metric")
    for r in rows:
        table.add_column(str(r["name"]))
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "name"))
    for k in keys:
        table.add_row(k, *(_fmt(r.get(k)) for r in rows))
    console().print(table)
    fails = [r["name"] for r in rows if r.get("verdict") == "fail"]
    verdict_line(not fails, f"{len(fails)} of {len(rows)} tensors fail" if fails else f"{len(rows)} tensors")
    return 1 if fails else 0


def execute(args: argparse.Namespace) -> int:
    from llmflow.compare.align import align_dumps
    from llmflow.compare.files import is_tensor_file
    from llmflow.compare.run import CompareOptions, compare_dumps
    from llmflow.formats import open_dump

    if is_tensor_file(args.golden_path) and is_tensor_file(args.my_path):
        return _files(args)
    golden, target = open_dump(args.golden_path), open_dump(args.my_path)
    aligned = align_dumps(golden, target, prefill_offset=args.prefill_offset, warmup=args.warmup,
                          steps=args.steps)
    out = Path(args.output or f"llmflow_compare_{time.strftime('%Y%m%d_%H%M%S')}")
    opts = CompareOptions(pairs=aligned["pairs"], levels=args.cmp_level,
                          thresholds=_thresholds(args.thresholds), algorithms=list(args.custom_algorithms),
                          mapping=args.op_mapping_file,
                          executor=args.executor, scheduler_address=args.scheduler_address,
                          workers=args.workers, rank=args.rank, steps=args.steps, stats_only=args.stats,
                          target_dtype=args.target_dtype, base_dir=".", xlsx=not args.no_xlsx)
    con = console()
    with con.status("comparing ..."):
        result = compare_dumps(golden, target, out, opts)
    summary = result["summary"]
    summary["missing_steps"] = aligned["missing"]
    Path(result["summary_file"]).write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")
    _print_summary(con, summary, result)
    c = summary["counts"]
    if c["fail"]:
        first = next((s["first_fail"] for s in summary["levels"].values() if s.get("first_fail")), None)
        where = f"; first: {first['name']} (step {first['step']})" if first else ""
        verdict_line(False, f"{c['fail']} of {summary['pairs']} rows fail{where}")
        return 1
    verdict_line(True, f"{summary['pairs']} rows, {c['warn']} warn, {c['unmatched']} unmatched")
    return 0


def _print_summary(con: Any, summary: dict[str, Any], result: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="compare")
    for col in ("level", "rows", "pass", "warn", "fail", "unmatched", "first failing row"):
        table.add_column(col)
    for level, s in summary["levels"].items():
        ff = s.get("first_fail")
        table.add_row(level, str(s["rows"]), *(str(s["counts"].get(k, 0)) for k in ("pass", "warn", "fail")),
                      f"{s['unmatched_golden']} golden / {s['unmatched_target']} target",
                      f"step {ff['step']} {ff['name']} {ff['kind']} {ff['index']}" if ff else "")
    con.print(table)
    lg = summary.get("logits")
    if lg:
        first = lg["first_token_mismatch_step"]
        tokens = f"first differing token at step {first}" if first is not None else "all greedy tokens agree"
        con.print(f"logits: top-1 agreement {lg['top1_agreement']:.1%}; {tokens}")
    missing: dict[str, list] = {}
    for m in summary.get("missing_steps") or []:  # one line per side, not one per step
        step = m.get("golden_step", m.get("target_step"))
        missing.setdefault(m.get("side", "?"), []).append(step)
    for side, steps in missing.items():
        shown = ", ".join(map(str, steps[:10])) + (f" ... ({len(steps)} in all)" if len(steps) > 10 else "")
        other = "golden" if side == "target" else "target"
        con.print(f"{other} steps with no {side} step: {shown}")
    con.print(f"{summary['pairs']} pairs, {summary['bytes'] / 1e9:.3f} GB in {summary['seconds']:.1f}s "
              f"({summary['gb_per_s'] or 0:.2f} GB/s); tables in {Path(result['summary_file']).parent}")
