"""Compare a golden dump with a target dump (or two tensor files), msit llm compare's flags.

  llmflow compare -gp GOLDEN -mp MY [-o OUT] [-cl LEVEL ...] [-st] [-alg FILE.py:FUNC ...]
                  [-mf MAPPING] [-r RANK] [--workers N] [--prefill-offset N] [--target-dtype DTYPE]

GOLDEN and MY are dump directories of any format llmflow reads (llmflow, msit, ATB, msprobe), or
the dump_path a dump was written under when it holds one dump: the steps are aligned, the tensors
matched (by name, through the op-mapping file -mf or one picked for an ATB dump, or by topology
order), every pair compared in parallel, and OUT gets compare_<level>.csv, compare.xlsx and
compare_summary.json, all at once when the compare ends. Rows are judged at the model dtype the
dumps record (--target-dtype overrides). Two tensor files (.safetensors, .npy, .pt/.pth) are
compared directly and their metrics printed.

The last line is PASSED; FAILED when rows fail (exit 1); INCONCLUSIVE when no row fails but a dump
reports problems (exit 3); FAILED when the compare is otherwise incomplete (most golden rows found
no partner, a golden decoder layer the target never reached, or only the logits paired; exit 1).
"""

from __future__ import annotations

import argparse
import logging
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmflow.cli import LOG_LEVELS
from llmflow.cli.common import console, verdict_line
from llmflow.compare.options import CompareOptions
from llmflow.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INCONCLUSIVE, EXIT_PASSED, UserError
from llmflow.options import add_flags, flag_names, from_args

if TYPE_CHECKING:
    from llmflow.results.compare import CompareSummary

log = logging.getLogger("llmflow.compare")  # -l/--log-level: debug adds each phase's timing
_EXIT = {"pass": EXIT_PASSED, "fail": EXIT_FAILED, "inconclusive": EXIT_INCONCLUSIVE}


class _WeightsElsewhere(argparse.Action):
    """msit's ``-w``: weights are compared by the ``weight_check`` workflow; say so in one line and
    stop (exit 2) before argparse asks for anything else."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"error: {option_string}: weights are compared by the weight_check workflow: llmflow run "
              "weight_check --set golden=GOLDEN_WEIGHTS --set target=MY_WEIGHTS", file=sys.stderr)
        print("FAILED: -w: run the weight_check workflow", flush=True)
        parser.exit(EXIT_BAD_INPUT)


def configure(parser: argparse.ArgumentParser) -> None:
    # (msprobe's short spelling too: msprobe compare -tp TARGET -gp GOLDEN -o OUT)
    parser.add_argument("-gp", "--golden-path", required=True, help="golden dump directory or tensor file")
    parser.add_argument("-mp", "--my-path", "-tp", dest="my_path", required=True,
                        help="target dump directory or tensor file (msprobe's -tp)")
    parser.add_argument("-o", "--output", default=None,
                        help="output directory (default: ./llmflow_compare_<timestamp>)")
    parser.add_argument("-l", dest="log_level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                        help="msit's short form of --log-level")
    parser.add_argument("-w", "--weight", nargs="?", action=_WeightsElsewhere, metavar="WEIGHTS",
                        help="msit's weight compare: not done here; prints the weight_check workflow "
                             "command that compares two checkpoints and exits 2")
    add_flags(parser, CompareOptions)  # -cl -st -alg -mf -r and the rest, declared with the options


def _thresholds(text: str | None) -> tuple[dict | None, str]:
    """The --thresholds mapping, from a file or inline JSON/YAML, and how to name it in errors
    (it is validated with the other options)."""
    if not text:
        return None, "--thresholds"
    import yaml

    p = Path(text)
    where = "--thresholds"
    try:
        if p.is_file():
            where = f"--thresholds {p}"
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{where}: not valid JSON/YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping {{metric: {{warn, fail}}}}, got {data!r}")
    return data, where


def _kind(path: str, flag: str) -> str:
    """"tensor" for a tensor file, "dump" otherwise; a path that is neither a regular file nor a
    directory (a FIFO, a socket, a device) is refused by name, without opening it."""
    from llmflow.compare.files import SUFFIXES

    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError as exc:
        raise UserError(f"{flag} {p}: no such file or directory") from exc
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file"
        raise UserError(f"{flag} {p}: {what}, not a regular file or directory")
    return "tensor" if stat.S_ISREG(mode) and p.suffix.lower() in SUFFIXES else "dump"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else str(v)


# the compact table of a tensor-file compare: one row per tensor
FILE_COLUMNS = (("name", "name"), ("shape", "golden_shape"), ("dtype", "dtypes"),
                ("cosine", "cosine_similarity"), ("max abs err", "max_absolute_error"),
                ("verdict", "verdict"), ("why", "reason"))


def _files(args: argparse.Namespace, thresholds: dict | None) -> int:
    from rich.table import Table

    from llmflow.compare.completeness import paired_too_little
    from llmflow.compare.files import compare_files

    rows = compare_files(args.golden_path, args.my_path, algorithms=args.algorithms,
                         thresholds=thresholds, target_dtype=args.target_dtype, kl=args.kl == "all")
    con = console()
    paired = sum(1 for r in rows if r.get("verdict") != "unmatched")
    alone = sum(1 for r in rows if r.get("code") == "unmatched_golden")
    if len(rows) == 1:  # one tensor: every metric, one per line
        table = Table(title=f"{args.golden_path} vs {args.my_path}")
        table.add_column("metric")
        table.add_column(str(rows[0]["name"]))
        for k, v in rows[0].items():
            if k != "name":
                table.add_row(k, _fmt(v))
    else:
        table = Table(title=f"{args.golden_path} vs {args.my_path}: {paired} tensors paired by name")
        for label, _ in FILE_COLUMNS:
            table.add_column(label, justify="right" if label in ("cosine", "max abs err") else "left")
        for r in rows:
            shape = r.get("golden_shape") if r.get("golden_shape") == r.get("target_shape") else \
                f"{r.get('golden_shape')} vs {r.get('target_shape')}" if "golden_shape" in r else ""
            dtypes = r.get("golden_dtype") if r.get("golden_dtype") == r.get("target_dtype") else \
                f"{r.get('golden_dtype')} vs {r.get('target_dtype')}" if "golden_dtype" in r else ""
            cells = {**r, "golden_shape": "x".join(map(str, shape)) if isinstance(shape, list) else shape,
                     "dtypes": dtypes, "reason": r.get("reason") if r.get("verdict") != "pass" else ""}
            table.add_row(*(_fmt(cells.get(key)) for _, key in FILE_COLUMNS))
    con.print(table)
    if args.output:  # (a user who gave -o looks for files there: say there are none)
        print(f"-o {args.output}: nothing written there; two tensor files are compared on screen only")
    fails = [r["name"] for r in rows if r.get("verdict") == "fail"]
    incomplete = paired_too_little(paired, alone)
    if fails:
        verdict_line(False, f"{len(fails)} of {paired} tensors fail")
    elif incomplete:
        verdict_line(False, f"incomplete: {alone} of {paired + alone} golden tensors have no tensor of their "
                            "name in the target")
    elif paired and all(r.get("code") == "empty_tensor" for r in rows if r.get("verdict") != "unmatched"):
        # (zero elements on both sides compare nothing: no evidence the target matches)
        verdict_line("inconclusive", f"nothing compared: the {paired} paired tensor(s) hold no elements "
                                     "on either side")
        return EXIT_INCONCLUSIVE
    else:
        verdict_line(True, f"{paired} tensors" + (f", {alone} golden only" if alone else ""))
    return EXIT_FAILED if fails or incomplete else EXIT_PASSED


def execute(args: argparse.Namespace) -> int:
    from llmflow.compare.output import StagedDir
    from llmflow.compare.run import check_options, compare_dumps, output_names
    from llmflow.compare.summary import report_lines
    from llmflow.formats import open_dump

    kinds = (_kind(args.golden_path, "-gp"), _kind(args.my_path, "-mp"))
    thresholds, where = _thresholds(args.thresholds)
    opts = from_args(CompareOptions, args, thresholds=thresholds, base_dir=".")
    # bad flags fail here, before any dump is read
    check_options(opts, {**flag_names(CompareOptions), "thresholds": where})
    if kinds == ("tensor", "tensor"):
        return _files(args, thresholds)
    if "tensor" in kinds:
        tensor = args.golden_path if kinds[0] == "tensor" else args.my_path
        raise UserError(f"{tensor}: a tensor file compares with another tensor file, "
                        "not with a dump directory")
    con = console()
    quiet = log.getEffectiveLevel() > logging.INFO  # -l warning/error: the tables and the verdict only
    out = Path(args.output or f"llmflow_compare_{time.strftime('%Y%m%d_%H%M%S')}")
    # -o checked before any work: not an input, not inside one, no file of the user's in the way
    staged = StagedDir(out, "-o", names=output_names(), inputs={"-gp": args.golden_path, "-mp": args.my_path})
    with _progress(con, quiet) as bar:
        # the bar is up from the start: reading the indexes of a big dump takes seconds
        reading = bar.add_task("reading indexes", total=2)
        readers = []
        for side, path in (("golden", args.golden_path), ("target", args.my_path)):
            t0 = time.perf_counter()
            reader = open_dump(path)
            n = len(reader.entries())
            readers.append(reader)
            bar.advance(reading)
            log.debug("%s: %d entries indexed in %.2f s", side, n, time.perf_counter() - t0)
            if not quiet:
                con.print(f"{side}: {reader.path} ({reader.format} dump)")
        pairing = bar.add_task("pairing", total=None)
        started = time.perf_counter()

        def progress(description: str, total: float | None) -> _Task:
            bar.update(pairing, total=1, completed=1)  # the compare asks for its bar once paired
            log.debug("paired: %s pairs in %.2f s", total, time.perf_counter() - started)
            return _Task(bar, bar.add_task(description, total=total))

        opts.final_dir = str(staged.out)
        with staged as tmp:
            result = compare_dumps(readers[0], readers[1], tmp, opts, progress=progress, log=log.debug)
    summary = result["summary"]
    _print_summary(con, summary, staged.out)
    for line in report_lines(summary):
        con.print(line)
    if summary.outcome.next:
        con.print(f"next: {summary.outcome.next}")
    verdict_line(summary.outcome.status, summary.outcome.headline)
    return _EXIT.get(summary.outcome.status, EXIT_BAD_INPUT)


class _Task:
    """One bar of a rich Progress, as ``compare_dumps``'s ``progress`` callback returns it."""

    def __init__(self, bar: Any, task_id: Any):
        self.bar, self.id = bar, task_id

    def advance(self, n: float = 1) -> None:
        self.bar.advance(self.id, n)

    def update(self, **kwargs: Any) -> None:
        self.bar.update(self.id, **kwargs)


def _progress(con: Any, quiet: bool) -> Any:
    """The compare's progress bars (reading indexes, pairing, comparing), drawn on a terminal
    only and cleared when done; none with ``-l warning`` or above."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=con, transient=True, disable=quiet)


def _print_summary(con: Any, summary: CompareSummary, out: Path) -> None:
    from rich.table import Table

    table = Table(title="compare")
    for col in ("level", "rows", "pass", "warn", "fail", "unmatched", "first failing row"):
        table.add_column(col)
    for level, s in summary.levels.items():
        ff = s.first_fail
        why = str(ff.reason or ff.code).split("; ")[0] if ff else ""
        first = f"step {ff.step} {ff.name} {ff.kind} {ff.index}: {why}" if ff else ""
        table.add_row(level, str(s.rows), *(str(s.counts.get(k, 0)) for k in ("pass", "warn", "fail")),
                      f"{s.unmatched_golden} golden / {s.unmatched_target} target", first)
    con.print(table)
    lg = summary.logits
    if lg:
        first_step = lg.first_token_mismatch_step
        tokens = f"first differing token at step {first_step}" if first_step is not None else \
            "all greedy tokens agree"
        con.print(f"logits: top-1 agreement {lg.top1_agreement:.1%}; {tokens}")
    con.print(f"{summary.pairs} pairs, {summary.bytes / 1e9:.3f} GB in {summary.seconds:.1f}s "
              f"({summary.gb_per_s or 0:.2f} GB/s); tables in {out}")
