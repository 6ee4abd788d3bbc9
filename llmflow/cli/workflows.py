"""List the workflows shipped with llmflow: the names `llmflow run NAME` takes, from any directory.

`llmflow run llama2_bisect` runs the shipped workflows/llama2_bisect.yaml; a path runs that file.
--path prints where the shipped workflows/ folder is (to copy a recipe and extend it).
"""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from llmflow.cli.common import console, verdict_line


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print as JSON (name, path, description)")
    parser.add_argument("--path", action="store_true", help="print only the shipped workflows/ folder")


def execute(args: argparse.Namespace) -> int:
    from llmflow.resources import shipped_workflows, workflows_dir

    if args.path:
        print(workflows_dir())
        return 0
    found = shipped_workflows()
    if args.json:
        print(json.dumps([{"name": w.name, "path": str(w.path), "description": w.description}
                          for w in found], indent=2))
        return 0
    table = Table(box=None, header_style="bold")
    table.add_column("name", no_wrap=True)
    table.add_column("description", overflow="fold")
    for w in found:
        table.add_row(w.name, w.description)
    console().print(table)
    print(f"run one: llmflow run NAME [--set PARAM=VALUE]...   (files in {workflows_dir()})")
    verdict_line(bool(found), f"{len(found)} shipped workflow(s)" if found
                 else f"no shipped workflows in {workflows_dir()}")
    return 0 if found else 1
