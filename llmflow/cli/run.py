"""Run a workflow: stages in dependency order, unchanged ones cached, outputs under the run dir.

A failed stage skips its dependents; other branches finish; re-running resumes from the failure.
`--only` runs the named stages (what they need must already be done); `--from` re-runs a stage and
everything downstream. `--dry-run` prints the plan (running no plugin code, like `llmflow plan`).
A cached stage re-runs when its parameters, the code files it names (uses: file.py:Class, a patch
or model file.py:name) or the files it left in its directory changed. Running a workflow runs the
plugin files it names.

The run dir (default runs/<workflow name>) is a folder llmflow marks as its own (.llmflow-run-dir);
an existing folder holding other files is refused (exit 2) unless it is empty, an llmflow run dir
already, or --adopt-run-dir is given. Inside it llmflow touches only what it wrote. It may be
copied (cp -a, rsync -a: mtimes kept) or moved: its state files store paths relative to it, so
it reads its own files. llmflow never
follows a symbolic link inside it where it writes, deletes or locks (.lock, .tmp, .failed,
summary.json, a stage's dir): it refuses with exit 2 naming the link.

The last line and the exit code say what the stages concluded. Stages that judge the target
(compare, bisect, overflow-scan, weight-compare, ...) each conclude pass, inconclusive or fail;
a stage's conclusion is superseded by that of any stage that needs it (the bisect speaks for
the compare it reads), and of the rest the most severe decides:
  0  PASSED (headline)      every standing conclusion is pass, or no stage judges the target
  1  FAILED: headline       a fault was found / rows failed, or a stage crashed
  2  FAILED: reason         bad input: the workflow, a --set value, the run dir, a stage's
                            parameters (one line naming the file, field or path)
  3  INCONCLUSIVE: headline the evidence does not cover the question
A crashed stage (1) or bad input (2) beats any conclusion. Interrupted (Ctrl-C): 130.
Cached stages keep their conclusion, so a rerun ends as the first run did.
"""

from __future__ import annotations

import argparse
import logging
import sys

from llmflow.cli.common import add_workflow_args, verdict_line
from llmflow.cli.plan import add_selection_args, print_plan
from llmflow.errors import one_line
from llmflow.options import bounded


def configure(parser: argparse.ArgumentParser) -> None:
    add_workflow_args(parser)
    add_selection_args(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument(
        "--adopt-run-dir",
        action="store_true",
        help="use an existing --run-dir that holds other files and is not an llmflow run dir "
        "(llmflow adds its own entries beside them and never touches the others)",
    )
    parser.add_argument(
        "--workers",
        type=bounded(int, minimum=1),
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
        adopt_run_dir=args.adopt_run_dir,
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
    superseded = set(result.conclusion.superseded) if result.conclusion else set()
    for res in result.stages.values():
        if res.outcome and res.status in ("done", "cached"):
            note = "  (superseded by a stage that needs it)" if res.id in superseded else ""
            print(one_line(f"{res.id}: {res.outcome['status']}: {res.outcome['headline']}") + note)
            if res.outcome.get("next") and res.id not in superseded:
                print(one_line(f"  next: {res.outcome['next']}"))
    print(f"run dir: {result.run_dir}  (summary: {result.run_dir / 'summary.json'})")
    for res in result.stages.values():  # the page to open next, just above the verdict
        if res.type == "report" and res.status in ("done", "cached") and res.outputs.get("html"):
            print(f"report: {res.outputs['html']}")
    verdict_line(result.verdict, result.reason)
    return result.exit_code
