"""Read a ``file.py:ClassName`` stage's declarations without running the file.

Validating (``llmflow validate``) and planning (``llmflow plan``) a workflow someone sent you must
not execute code from it, so a local plugin's class is found with ``ast``: its ``type``,
``version``, ``params_schema`` and ``outputs`` must be literals in the class body (or names of
module-level literals), and its bases must be ``Stage``. Anything else (a computed schema, a base
class of its own) cannot be known without importing the file: ``StaticReadError`` says so, and
the user decides (``--trust-plugins``). ``llmflow run`` imports plugins: running one is what it
is for.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from llmflow.errors import UserError
from llmflow.stages.base import Stage

MAX_PLUGIN_BYTES = 4 << 20
FIELDS = ("type", "version", "params_schema", "outputs")


class StaticReadError(UserError):
    """The class cannot be read without executing its file."""


def read_stage_class(path: Path, name: str, ref: str) -> type[Stage]:
    """A ``Stage`` subclass carrying the declarations of class ``name`` in ``path``, which is
    parsed, never imported; its ``run`` refuses to run. ``ref`` is the reference as written."""
    tree = _parse(path, ref)
    consts = _module_literals(tree)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        raise StaticReadError(f"{ref}: {path.name} defines no top-level class {name!r} (one made at "
                              "import time is only known by importing the file)")
    where = f"{ref} ({path.name}:{cls.lineno})"
    if not cls.bases:
        raise UserError(f"{where}: not a llmflow.stages.base.Stage subclass")
    for base in cls.bases:
        base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if base_name != "Stage":
            raise StaticReadError(
                f"{where}: its base {ast.unparse(base)!r} is not Stage, so its declarations are "
                "only known by importing the file"
            )
    found: dict[str, Any] = {}
    for node in cls.body:
        target, value = _assignment(node)
        if target in FIELDS and value is not None:
            try:
                found[target] = _literal(value, consts)
            except (ValueError, TypeError, RecursionError):
                raise StaticReadError(
                    f"{where}: {target} is computed ({path.name}:{node.lineno}), so it is only known "
                    "by importing the file"
                ) from None
    return _static_class(name, found, ast.get_docstring(cls) or "", ref)


def _parse(path: Path, ref: str) -> ast.Module:
    try:
        size = path.stat().st_size
        if size > MAX_PLUGIN_BYTES:
            raise UserError(f"{ref}: {path} is {size} bytes, larger than a plugin file may be")
        source = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{ref}: cannot read {path} ({exc.strerror or exc})") from None
    try:
        return ast.parse(source, filename=str(path))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        line = getattr(exc, "lineno", None)
        raise UserError(f"{ref}: {path.name}{f':{line}' if line else ''}: not valid Python "
                        f"({getattr(exc, 'msg', None) or type(exc).__name__})") from None


def _assignment(node: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id, node.value
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id, node.value
    return None, None


def _module_literals(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level ``NAME = <expr>`` (the last one wins, as at import)."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        target, value = _assignment(node)
        if target and value is not None:
            out[target] = value
    return out


def _literal(node: ast.expr, consts: dict[str, ast.expr], depth: int = 0) -> Any:
    """``ast.literal_eval`` that also follows names of module-level literals and ``{**NAME}``."""
    if depth > 32:
        raise ValueError("too deep")
    if isinstance(node, ast.Name) and node.id in consts:
        return _literal(consts[node.id], consts, depth + 1)
    if isinstance(node, ast.Dict):
        out: dict[Any, Any] = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if k is None:  # {**OTHER}
                merged = _literal(v, consts, depth + 1)
                if not isinstance(merged, dict):
                    raise ValueError("** of a non-dict")
                out.update(merged)
            else:
                out[_literal(k, consts, depth + 1)] = _literal(v, consts, depth + 1)
        return out
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(v, consts, depth + 1) for v in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    return ast.literal_eval(node)


def _static_class(name: str, found: dict[str, Any], doc: str, ref: str) -> type[Stage]:
    def run(self: Stage, ctx: Any) -> dict[str, Any]:
        raise RuntimeError(f"{ref} was read without importing it; it cannot run")

    attrs: dict[str, Any] = {"__doc__": doc, "run": run, "static_ref": ref, **found}
    attrs["version"] = str(attrs.get("version", Stage.version))
    return type(name, (Stage,), attrs)
