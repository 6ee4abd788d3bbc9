"""List stage types: what each does and its parameters (name, type, default).

Lists every registered stage type (entry-point group llmflow.stages, from any installed package);
give names or path/file.py:Class refs to show only those. A stage type that fails to import is
listed with its error.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from llmflow.cli.common import console


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="STAGE", help="only these stage types (or file.py:Class)")
    parser.add_argument("--json", action="store_true", help="print as JSON")


def describe(cls: Any) -> dict[str, Any]:
    """A stage class as JSON: doc, version, params (name, type, default, description), outputs."""
    props = cls.params_schema.get("properties", {})
    required = set(cls.params_schema.get("required", []))
    params = []
    for name, prop in props.items():
        ptype = prop.get("type") or "|".join(
            str(p.get("type", "?")) for p in prop.get("anyOf", prop.get("oneOf", []))
        )
        params.append(
            {
                "name": name,
                "type": ptype if isinstance(ptype, str) else "|".join(ptype),
                "default": prop.get("default"),
                "required": name in required,
                "description": prop.get("description", ""),
            }
        )
    return {"doc": cls.doc(), "version": cls.version, "params": params, "outputs": dict(cls.outputs)}


def execute(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmflow.errors import UserError
    from llmflow.workflow.registry import registered_names, resolve_stage

    out: dict[str, dict[str, Any]] = {}
    for name in args.names or registered_names():
        try:
            out[name] = describe(resolve_stage(name, Path.cwd()))
        except UserError as exc:
            out[name] = {"error": str(exc)}
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    con = console()
    for name, info in out.items():
        if "error" in info:
            con.print(f"[bold]{name}[/bold]  [red]unavailable: {info['error']}[/red]")
            continue
        con.print(f"[bold]{name}[/bold]  {info['doc']}")
        if info["params"]:
            table = Table(box=None, show_header=False, padding=(0, 2))
            for p in info["params"]:
                default = "(required)" if p["required"] else json.dumps(p["default"], default=str)
                table.add_row(f"  {p['name']}", p["type"], default, p["description"])
            con.print(table)
        if info["outputs"]:
            con.print("  outputs: " + ", ".join(info["outputs"]), style="dim")
    return 0
