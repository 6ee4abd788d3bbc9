"""Check a workflow without running it: every problem as FILE:LINE:COL: message.

Checks the YAML, unknown keys, include/extends files, stage types, needs (unknown ids, cycles),
${...} references and each stage's parameters (literal values now; values computed from other
stages' outputs when the run gets there). Exit 0 when valid, 2 otherwise.

Validating runs no code from the workflow: a local plugin stage (uses: file.py:Class) is read,
not imported, so its type, version, params_schema and outputs must be literals in the class body
(or module-level literals it names) and its base must be Stage. A class that cannot be read that
way is reported as a problem saying so; --trust-plugins imports such files instead (only for
files you trust: importing runs them). Installed stage types are installed code and are
imported as usual. The YAML itself is loaded within bounds (size, nesting depth, values after
alias expansion), so a hostile file is refused quickly.
"""

from __future__ import annotations

import argparse

from llmflow.cli.common import add_workflow_args, verdict_line


def add_trust_arg(parser: argparse.ArgumentParser) -> None:
    """``--trust-plugins`` (validate, plan)."""
    parser.add_argument(
        "--trust-plugins",
        action="store_true",
        help="import file.py:Class stage plugins (runs their code) instead of reading them statically",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    add_workflow_args(parser, run_dir=False)
    add_trust_arg(parser)


def execute(args: argparse.Namespace) -> int:
    from llmflow.resources import resolve_workflow
    from llmflow.workflow import params_to_set, validate_workflow

    path = resolve_workflow(args.workflow)
    errors = validate_workflow(path, set_params=args.set_params,
                               trust_plugins=args.trust_plugins)
    for err in errors:
        print(err)
    if errors:
        verdict_line(False, f"{len(errors)} problem(s) in {args.workflow}")
        return 2
    needed = params_to_set(path, args.set_params)
    to_give = f"; a run needs {', '.join(f'--set {name}=VALUE' for name in needed)}" if needed else ""
    verdict_line(True, f"{args.workflow} is valid{to_give}")
    return 0
