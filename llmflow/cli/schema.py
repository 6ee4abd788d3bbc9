"""Write the workflow JSON Schema (for editors: yaml-language-server) built from every stage type.

Without -o it prints to stdout. --check compares with an existing file instead (exit 1 when it
is out of date). The committed copy is schemas/workflow.schema.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default=None, metavar="FILE", help="write the schema here")
    parser.add_argument("--check", action="store_true", help="compare with FILE (-o) instead of writing")


def execute(args: argparse.Namespace) -> int:
    from llmflow.errors import UserError
    from llmflow.workflow.schema import generate

    text = generate()
    if args.check:
        if not args.output:
            raise UserError("--check needs -o FILE")
        current = Path(args.output).read_text(encoding="utf-8") if Path(args.output).is_file() else ""
        if current != text:
            print(f"FAILED: {args.output} is out of date; run: llmflow schema -o {args.output}")
            return 1
        print(f"PASSED ({args.output} is up to date)")
        return 0
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0
