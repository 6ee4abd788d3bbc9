"""Write a JSON Schema: the workflow's (for editors: yaml-language-server), built from every stage
type, or a result file's (``--kind summary``: summary.json, ``--kind verdict``: a bisect's
verdict.json), generated from its types.

Without -o it prints to stdout. -o replaces only a file that is this kind of schema already (an
older copy); any other existing file is the user's and is refused. --check compares with an
existing file instead (exit 1 when it is out of date). The committed copies are
schemas/<kind>.schema.json.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from llmflow.errors import UserError


def _workflow_schema() -> str:
    from llmflow.workflow.schema import generate

    return generate()


def _verdict_schema() -> str:
    from llmflow.results.schemas import verdict_schema

    return json.dumps(verdict_schema(), indent=2) + "\n"


def _summary_schema() -> str:
    from llmflow.results.schemas import summary_schema

    return json.dumps(summary_schema(), indent=2) + "\n"


#: --kind -> the text of that schema (imported when asked for: ``schema`` starts fast)
KINDS: dict[str, Callable[[], str]] = {"workflow": _workflow_schema, "summary": _summary_schema,
                                       "verdict": _verdict_schema}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default=None, metavar="FILE", help="write the schema here")
    parser.add_argument("--check", action="store_true", help="compare with FILE (-o) instead of writing")
    parser.add_argument("--kind", choices=sorted(KINDS), default="workflow",
                        help="which schema: a workflow file's (default) or a result file's")


def _check_target(path: Path, kind: str = "workflow") -> None:
    """UserError unless ``path`` can be a schema file: missing, or a regular file."""
    if path.is_dir():
        raise UserError(f"-o {path}: is a directory; give a file name (e.g. {path / f'{kind}.schema.json'})")
    if path.exists() and not path.is_file():
        raise UserError(f"-o {path}: not a regular file")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"-o {path}: {parent} is a file, not a directory")


def _title(text: str) -> object:
    """The ``title`` of a JSON schema's text (None: not a JSON object)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc.get("title") if isinstance(doc, dict) else None


def _write(path: Path, text: str, kind: str) -> None:
    """Write beside, then rename over: an interrupted write leaves the old file whole. An existing
    file is replaced only when it is the same kind of schema (its title)."""
    from llmflow.atomic import atomic_write_text

    _check_target(path, kind)
    if path.exists():
        try:
            old = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            old = ""
        if _title(old) != _title(text):
            raise UserError(f"-o {path}: exists and is not an llmflow {kind} schema; refusing to replace it "
                            "(give a new file name)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)  # (a temporary file of its own, removed on any failure)
    except OSError as exc:
        raise UserError(f"-o {path}: cannot write it ({exc.strerror or exc})") from None


def execute(args: argparse.Namespace) -> int:
    if args.check and not args.output:
        raise UserError("--check needs -o FILE")
    if args.output:
        _check_target(Path(args.output), args.kind)  # a bad -o fails before the schema is built
    text = KINDS[args.kind]()
    if args.check:
        path = Path(args.output)
        try:
            current = path.read_text(encoding="utf-8") if path.is_file() else ""
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"-o {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
        if current != text:
            kind = f" --kind {args.kind}" if args.kind != "workflow" else ""
            print(f"FAILED: {args.output} is out of date; run: llmflow schema{kind} -o {args.output}")
            return 1
        print(f"PASSED ({args.output} is up to date)")
        return 0
    if args.output:
        _write(Path(args.output), text, args.kind)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0
