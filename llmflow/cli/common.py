"""Arguments and output shared by the workflow commands (run, plan, validate)."""

from __future__ import annotations

import argparse

from rich.console import Console


def add_workflow_args(parser: argparse.ArgumentParser, run_dir: bool = True) -> None:
    """WORKFLOW, ``--set NAME=VALUE`` (repeatable) and ``--run-dir DIR``."""
    parser.add_argument(
        "workflow", help="workflow YAML file, or the name of a shipped one (`llmflow workflows` lists them)"
    )
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


class _Console(Console):
    def on_broken_pipe(self) -> None:
        raise BrokenPipeError  # main() ends every command whose reader left the same way (exit 141)


def console() -> Console:
    """Rich console on stdout; no colour codes when it is not a terminal (CI logs, tests)."""
    return _Console(highlight=False, soft_wrap=True)


def verdict_line(ok: bool | str, reason: str) -> None:
    """The last line of a command: ``PASSED (reason)``, ``FAILED: reason`` or
    ``INCONCLUSIVE: reason``. ``ok`` is a bool, or an outcome status (``"pass"``, ``"fail"``,
    ``"inconclusive"``, see ``llmflow.stages.base.OUTCOMES``)."""
    status = ("pass" if ok else "fail") if isinstance(ok, bool) else ok
    if status == "pass":
        print(f"PASSED ({reason})" if reason else "PASSED", flush=True)
    elif status == "inconclusive":
        print(f"INCONCLUSIVE: {reason}", flush=True)
    else:
        print(f"FAILED: {reason}", flush=True)
