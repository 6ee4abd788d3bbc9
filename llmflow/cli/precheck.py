"""Check every op of one API dump without a golden: replay it on the CPU and judge its output.

  llmflow precheck DUMP [-o OUT] [--repro] [--repro-call NAME]... [--perturb]
                   [--reference NAME=file.py:func]...

Each API call of the dump (dumped with mode api, data_mode tensor; dump_weight lets Linear calls
be checked too; or each leaf operation of an ATB tensor dump, with the model json's params) is
run on the CPU in float64 (the reference) and in the dump's dtype (the benchmark); the target's
recorded output fails when its error is ``--fail-ratio`` times the benchmark's, or breaks
msprobe's small-value, thousandth-ratio or bit-exactness rules. Writes
precheck.csv/.xlsx/.json into OUT (default: precheck_out). ``--repro`` adds, per failing call, a
folder with its inputs and a standalone script (``--repro-call NAME``: for that call too,
whatever its status; ``all``: every call); ``--perturb`` flags calls whose output moves far
more than their inputs under rounding-size perturbations. Exit 1 when a call fails, 3 when too
little could be checked, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmflow.cli.common import console, verdict_line
from llmflow.errors import EXIT_BAD_INPUT, UserError

EXIT = {"pass": 0, "fail": 1, "inconclusive": 3}


def configure(parser: argparse.ArgumentParser) -> None:
    from llmflow.checks.precheck_options import DEFAULT_FAIL_RATIO, DEFAULT_MIN_CHECKED, DEFAULT_PERTURB_RATIO

    parser.add_argument("dump", help="an llmflow API dump with tensors, an msprobe L1/mix tensor dump or "
                        "an ATB tensor dump with its model json (or the folder holding one)")
    parser.add_argument("-o", "--output", default="precheck_out",
                        help="output folder (default: precheck_out)")
    parser.add_argument("--repro", action="store_true", help="a repro folder with a standalone script per "
                        "failing call")
    parser.add_argument("--repro-call", action="append", default=[], metavar="NAME",
                        help="also a repro folder for this call, whatever its status: its name or record "
                        "as in precheck.csv (every step it runs at), or 'all' for every call that replays; "
                        "repeatable")
    parser.add_argument("--perturb", action="store_true", help="also flag ill-conditioned calls by "
                        "perturbing their inputs at the dtype's rounding scale")
    parser.add_argument("--reference", action="append", default=[], metavar="NAME=FILE.py:FUNC",
                        help="the CPU reference of API NAME (a custom kernel), repeatable")
    parser.add_argument("--fail-ratio", type=float, default=DEFAULT_FAIL_RATIO,
                        help=f"fail a call whose error is this many times the benchmark's (default "
                        f"{DEFAULT_FAIL_RATIO:g})")
    parser.add_argument("--perturb-ratio", type=float, default=DEFAULT_PERTURB_RATIO,
                        help=f"flag a call whose output moves this many times its inputs (default "
                        f"{DEFAULT_PERTURB_RATIO:g})")
    parser.add_argument("--min-checked", type=float, default=DEFAULT_MIN_CHECKED,
                        help=f"inconclusive below this share of calls checked (default "
                        f"{DEFAULT_MIN_CHECKED:g})")


def parse_references(items: list[str]) -> dict[str, str]:
    """``["NAME=file.py:func", ...]`` -> {NAME: ref}; a malformed item is a ``UserError``."""
    found: dict[str, str] = {}
    for item in items:
        name, sep, ref = item.partition("=")
        if not sep or not name.strip() or not ref.strip():
            raise UserError(f"--reference {item!r}: expected NAME=path/to/file.py:function")
        found[name.strip()] = ref.strip()
    return found


def execute(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from llmflow.checks.precheck import call_label
    from llmflow.checks.precheck_files import OUTPUT_NAMES, run_precheck
    from llmflow.checks.precheck_options import PrecheckOptions
    from llmflow.checks.references import load_references
    from llmflow.compare.output import StagedDir

    if not Path(args.dump).exists():
        raise UserError(f"{args.dump}: no such dump")
    options = PrecheckOptions(fail_ratio=args.fail_ratio, perturb=args.perturb,
                              perturb_ratio=args.perturb_ratio, min_checked=args.min_checked,
                              references=load_references(parse_references(args.reference)))
    out = Path(args.output)
    # -o checked before any work (as compare's): not the dump nor inside it, no file of the user's
    # in the way; the files appear in OUT all together when the precheck is done, or not at all
    staged = StagedDir(out, "-o", names=OUTPUT_NAMES, inputs={"dump": args.dump}, suggest="precheck_out")
    con = console()
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console_err(), transient=True, disable=not sys.stderr.isatty())
    with staged as tmp, bar:
        def progress(description: str, total: float | None) -> object:
            task_id = bar.add_task(description, total=total)
            return _Task(bar, task_id)
        result = run_precheck(args.dump, tmp, options, repro=args.repro,
                              repro_calls=args.repro_call, progress=progress)
    result["files"] = {kind: str(out / Path(path).name) for kind, path in result["files"].items()}
    t = result["totals"]
    con.print(f"{t['calls']} calls: {t['checked']} checked ({t['pass']} pass, {t['warn']} warn, "
              f"{t['fail']} fail), {t['not checked']} not checked")
    for row in [r for r in result["rows"] if r["status"] == "fail"][:10]:
        con.print(f"  fail {call_label(row)} (step {row['step']}): ratio {row['ratio']:.3g}; {row['reason']}")
    first = result["first_fail"]
    if first is not None:
        where = f" in module {first['module']}" if first["module"] else " (the dump records no module)"
        con.print(f"first failing call in model order: {call_label(first)}{where} "
                  f"(step {first['step']}, rank {first['rank']})")
    for name in result["perturbed"][:10]:
        con.print(f"  perturbation flags {name}")
    for rep in result["repros"][:10]:
        con.print(f"  repro: {out / rep['script']}")
    if len(result["repros"]) > 10:
        con.print(f"  ... {len(result['repros']) - 10} more repro folders (precheck.json lists them)")
    for miss in result["repros_missing"]:
        con.print(f"  no repro for {miss['name']}: {miss['why']}")
    con.print(f"tables: {result['files']['csv']}, {result['files']['xlsx']}, {result['files']['json']}")
    if result.get("next"):
        con.print(f"next: {result['next']}")
    verdict_line(result["status"], result["headline"].removeprefix("precheck: "))
    return EXIT.get(result["status"], EXIT_BAD_INPUT)


def console_err():  # noqa: ANN201 (a rich Console)
    from rich.console import Console

    return Console(stderr=True)


class _Task:
    def __init__(self, bar: object, task_id: object):
        self.bar, self.task_id = bar, task_id

    def advance(self, n: float = 1) -> None:
        self.bar.advance(self.task_id, n)  # type: ignore[attr-defined]
