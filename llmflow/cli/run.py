"""Run a workflow: stages in dependency order, unchanged ones cached, outputs under the run dir.

A failed stage skips its dependents; other branches finish; re-running resumes from the failure.
`--only` runs the named stages (what they need must already be done); `--from` re-runs a stage and
everything downstream. `--dry-run` prints the plan. Ends with PASSED or FAILED (reason).
"""

from __future__ import annotations

import argparse
import logging
import sys

from llmflow.cli.common import add_workflow_args, verdict_line
from llmflow.cli.plan import add_selection_args, print_plan


def configure(parser: argparse.ArgumentParser) -> None:
    add_workflow_args(parser)
    add_selection_args(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="run up to N independent stages at once (default 1)",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "rich", "plain"),
        default="auto",
        help="live display (rich), log lines (plain), or rich only on a terminal",
    )


def execute(args: argparse.Namespace) -> int:
    from llmflow.resources import resolve_workflow
    from llmflow.workflow import run_workflow
    from llmflow.workflow.progress import PlainReporter, RichReporter, default_reporter

    reporter = {"rich": RichReporter, "plain": PlainReporter}.get(args.progress, default_reporter)()
    result = run_workflow(
        resolve_workflow(args.workflow),
        set_params=args.set_params,
        run_dir=args.run_dir,
        only=args.only,
        from_stage=args.from_stage,
        force=args.force,
        dry_run=args.dry_run,
        workers=args.workers,
        reporter=reporter,
    )
    if args.dry_run:
        print_plan(result.plan)
        verdict_line(True, f"dry run, {sum(i.action == 'run' for i in result.plan)} stage(s) would run")
        return 0
    for res in result.failed:
        # a stage's own crash is worth its traceback; bad input (UserError) only with debug
        if res.traceback and (not res.user_error or logging.getLogger().isEnabledFor(logging.DEBUG)):
            print(res.traceback, file=sys.stderr)
        print(f"stage {res.id} failed: {res.error}")
    print(f"run dir: {result.run_dir}  (summary: {result.run_dir / 'summary.json'})")
    verdict_line(result.exit_code == 0, result.reason)
    return result.exit_code
