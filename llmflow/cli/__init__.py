"""The ``llmflow`` command: one module per subcommand, each a thin adapter onto a library call.

Every tool module in ``TOOLS`` has a docstring (its help; the first line is the summary),
``configure(parser)`` and ``execute(args) -> int``. Tools are imported one by one and a tool that
fails to import is reported when used, so one broken tool never takes the others down.

Every command ends with one last line, PASSED (...), FAILED: ... or INCONCLUSIVE: ..., and exits
  0    PASSED: the target matches (for ``run``: every conclusion that stands is pass, or no stage
       judges the target; ``validate``: the workflow is valid)
  1    FAILED: a fault was found, compared rows failed, or a stage crashed
  2    FAILED: bad input (a ``UserError`` anywhere): one line naming the file, field or path
  3    INCONCLUSIVE: the evidence does not cover the question
  130  interrupted (Ctrl-C)
  143  terminated (SIGTERM, as sent by timeout, Slurm or Kubernetes; cleaned up as for Ctrl-C)
``llmflow run --help`` says how a run's stage conclusions add up to its exit code. A
``UserError`` prints one line, no traceback (``--log-level debug`` shows it).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from types import ModuleType
from typing import Any, NoReturn

from llmflow import __version__, interrupts
from llmflow.errors import EXIT_BAD_INPUT, EXIT_FAILED, ComputeError, UserError, one_line

EXIT_PIPE_CLOSED = 141  # as a shell reports a command that SIGPIPE ended (128 + 13)

TOOLS = {
    "run": "llmflow.cli.run",
    "workflows": "llmflow.cli.workflows",
    "validate": "llmflow.cli.validate",
    "plan": "llmflow.cli.plan",
    "stages": "llmflow.cli.stages",
    "schema": "llmflow.cli.schema",
    "compare": "llmflow.cli.compare",
    "inspect": "llmflow.cli.inspect",
    "precheck": "llmflow.cli.precheck",
}

# fatal and critical: msit's two names of the top level
LOG_LEVELS = ("debug", "info", "warning", "error", "fatal", "critical")


def _import_tool(module: str) -> ModuleType | str:
    """The tool module, or the reason it cannot be used."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return "not installed in this version"
        return f"failed to import: {type(exc).__name__}: {exc}"
    except Exception as exc:  # a broken tool is reported when used, see module docstring
        return f"failed to import: {type(exc).__name__}: {exc}"


class _Parser(argparse.ArgumentParser):
    """argparse ending a usage error as every command ends: its usage and the error on stderr,
    then a last ``FAILED:`` line, exit 2 (bad input). Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"FAILED: {self.prog}: {message}", flush=True)
        sys.exit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    """The full parser; a tool that does not import gets a subcommand that explains why."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,
        help="how much to log (debug also shows tracebacks)",
    )
    parser = _Parser(
        prog="llmflow",
        parents=[common],
        description="Find where an LLM's numbers go wrong on new hardware: declarative dump, compare "
        "and bisect workflows.",
    )
    parser.add_argument("--version", action="version", version=f"llmflow {__version__}")
    sub = parser.add_subparsers(dest="tool", metavar="COMMAND")
    for name, module_name in TOOLS.items():
        tool = _import_tool(module_name)
        if isinstance(tool, str):
            if tool == "not installed in this version":
                continue
            p = sub.add_parser(name, parents=[common], help=f"(unavailable: {tool})")
            p.set_defaults(_broken=f"llmflow {name}: {tool}")
            p.add_argument("rest", nargs=argparse.REMAINDER)
            continue
        doc = (tool.__doc__ or "").strip()
        p = sub.add_parser(
            name,
            parents=[common],
            help=doc.splitlines()[0] if doc else None,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        tool.configure(p)
        p.set_defaults(_tool=tool)
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``llmflow`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "info")
    _setup_logging(level)
    if getattr(args, "_broken", None):
        print(f"error: {args._broken}", file=sys.stderr)
        print("FAILED: command unavailable")
        return 2
    tool: Any = getattr(args, "_tool", None)
    if tool is None:
        parser.print_help()
        print("FAILED: no command given", flush=True)
        return EXIT_BAD_INPUT
    try:
        with interrupts.sigterm_as_interrupt():
            return int(tool.execute(args))
    except KeyboardInterrupt as exc:
        interrupts.stop_children()
        if level == "debug":
            traceback.print_exc()
        if isinstance(exc, interrupts.Terminated):
            print("FAILED: terminated (SIGTERM)", flush=True)
            return interrupts.EXIT_TERMINATED
        print("FAILED: interrupted", flush=True)
        return 130
    except BrokenPipeError:  # the reader of our output left (``llmflow inspect DUMP | head``)
        # what is still buffered goes nowhere rather than to a second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    except ComputeError as exc:
        if level == "debug":
            traceback.print_exc()
        print(f"error: {one_line(exc)}", file=sys.stderr)
        print(f"FAILED: {one_line(exc)}", flush=True)
        return EXIT_FAILED
    except UserError as exc:
        if level == "debug":
            traceback.print_exc()
        errors = getattr(exc, "errors", None)
        for line in errors if errors else [exc]:
            print(one_line(line) if errors else f"error: {one_line(line)}", file=sys.stderr)
        reason = one_line(exc) if not errors else one_line(errors[0]) if len(errors) == 1 else \
            f"{len(errors)} problem(s) in the workflow, first: {one_line(errors[0])}"
        print(f"FAILED: {reason}", flush=True)
        return EXIT_BAD_INPUT
