"""Show what `llmflow run` would do: stages in order, and whether each runs (and why) or is cached.

Reasons: new, forced, previous run failed, upstream changed (a stage it needs runs first: the run
may then find the same result and keep it cached), stage type or version changed, code changed (the
content of a file.py the stage names), input changed, parameters changed: NAMES, outputs changed on
disk (a file the stage left in its directory was deleted, modified or added). Takes the same
--set/--run-dir/--only/--from/--force as `run`.

Planning runs no code from the workflow: local plugin stages (file.py:Class) are read, not
imported, as by `llmflow validate`; --trust-plugins imports them.
"""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from llmflow.cli.common import add_workflow_args, console, verdict_line
from llmflow.cli.validate import add_trust_arg


def add_selection_args(parser: argparse.ArgumentParser) -> None:
    """``--only``, ``--from`` and ``--force`` (shared with ``run``)."""
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="STAGE",
        help="run only these stages (repeatable; unchanged ones stay cached unless --force); "
        "what they need must have completed before",
    )
    parser.add_argument(
        "--from",
        dest="from_stage",
        default=None,
        metavar="STAGE",
        help="re-run this stage and everything downstream of it",
    )
    parser.add_argument("--force", action="store_true", help="re-run every selected stage")


def configure(parser: argparse.ArgumentParser) -> None:
    add_workflow_args(parser)
    add_selection_args(parser)
    add_trust_arg(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def print_plan(items: list) -> None:
    """The plan as a table."""
    table = Table(box=None, header_style="bold")
    for col in ("#", "stage", "type", "action", "reason"):
        table.add_column(col, overflow="fold")  # CI logs are 80 columns: wrap, never cut
    styles = {"run": "cyan", "cached": "blue", "skip": "dim"}
    for i, item in enumerate(items, 1):
        table.add_row(str(i), item.stage, item.type, f"[{styles[item.action]}]{item.action}", item.reason)
    console().print(table)


def execute(args: argparse.Namespace) -> int:
    from llmflow.resources import resolve_workflow
    from llmflow.workflow import plan_workflow

    items = plan_workflow(
        resolve_workflow(args.workflow),
        set_params=args.set_params,
        run_dir=args.run_dir,
        only=args.only,
        from_stage=args.from_stage,
        force=args.force,
        trust_plugins=args.trust_plugins,
    )
    if args.json:
        print(json.dumps([i.to_json() for i in items], indent=2))
        return 0
    print_plan(items)
    n_run = sum(i.action == "run" for i in items)
    verdict_line(True, f"{n_run} to run, {sum(i.action == 'cached' for i in items)} cached")
    return 0
