"""Check a workflow without running it: every problem as FILE:LINE:COL: message.

Checks the YAML, unknown keys, include/extends files, stage types, needs (unknown ids, cycles),
${...} references and each stage's parameters (literal values now; values computed from other
stages' outputs when the run gets there). Exit 0 when valid, 2 otherwise.
"""

from __future__ import annotations

import argparse

from llmflow.cli.common import add_workflow_args, verdict_line


def configure(parser: argparse.ArgumentParser) -> None:
    add_workflow_args(parser, run_dir=False)


def execute(args: argparse.Namespace) -> int:
    from llmflow.resources import resolve_workflow
    from llmflow.workflow import validate_workflow

    errors = validate_workflow(resolve_workflow(args.workflow), set_params=args.set_params)
    for err in errors:
        print(err)
    if errors:
        verdict_line(False, f"{len(errors)} problem(s) in {args.workflow}")
        return 2
    verdict_line(True, f"{args.workflow} is valid")
    return 0
