"""Arguments and output shared by the workflow commands (run, plan, validate)."""

from __future__ import annotations

import argparse

from rich.console import Console


def add_workflow_args(parser: argparse.ArgumentParser, run_dir: bool = True) -> None:
    """WORKFLOW, ``--set NAME=VALUE`` (repeatable) and ``--run-dir DIR``."""
    parser.add_argument("workflow", help="workflow YAML file")
    parser.add_argument(
        "--set",
        dest="set_params",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a workflow param (VALUE is read as YAML: 3, true, [1, 2])",
    )
    if run_dir:
        parser.add_argument(
            "--run-dir",
            default=None,
            metavar="DIR",
            help="where stage outputs go (default: runs/<workflow name>)",
        )


def console() -> Console:
    """Rich console on stdout; no colour codes when it is not a terminal (CI logs, tests)."""
    return Console(highlight=False, soft_wrap=True)


def verdict_line(ok: bool, reason: str) -> None:
    """The last line of a command: ``PASSED ...`` or ``FAILED: reason``."""
    print(f"PASSED ({reason})" if ok and reason else "PASSED" if ok else f"FAILED: {reason}", flush=True)
