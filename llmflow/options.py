"""One declaration per option: a dataclass field that carries its default, its help text, its
JSON-schema type as a stage parameter and its command-line flags; the stage's parameter schema,
the CLI's argparse arguments and the dataclass built from either are generated from it.

    levels: list[str] | None = option(
        None, "Levels to compare, one sheet each ...",
        schema={"type": ["array", "null"], "items": {"type": "string"}},
        flags=("-cl", "--cmp-level"), metavar="LEVEL")

``schema`` None or ``stage=False``: not a stage parameter; ``flags`` empty: not a flag. The
argparse argument follows the schema's type: a boolean is a switch that flips the default
(``--no-xlsx`` for a field whose default is True), an array takes one or more values, an ``enum``
lists the choices, an object is given as text that the command parses itself (JSON, or a file).
Its ``dest`` is the field's name, so ``from_args`` builds the dataclass from the parsed namespace.

This module imports nothing heavy: ``llmflow validate``, ``plan`` and ``schema`` read the
declarations without loading torch.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import MISSING, Field, field, fields
from typing import Any

#: ``option``'s default for a field every caller must give (no default).
REQUIRED: Any = MISSING

_PY_TYPES = {"integer": int, "number": float, "string": str, "object": str}


def option(default: Any, help: str, *, schema: dict[str, Any] | None = None, stage: bool = True,
           flags: tuple[str, ...] = (), metavar: str | None = None) -> Any:
    """A dataclass field declared once: ``default`` (``REQUIRED``: none), ``help`` (the stage
    property's description and the flag's help alike), ``schema`` (its JSON-schema type, without
    default and description), ``stage`` (False: a flag only, the stage gets the value another way)
    and ``flags`` (msit's short flag first)."""
    meta = {"help": help, "schema": schema, "stage": stage and schema is not None, "flags": tuple(flags),
            "metavar": metavar}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def declared(cls: type) -> list[Field]:
    """The fields of ``cls`` declared with ``option``, in declaration order."""
    return [f for f in fields(cls) if "help" in f.metadata]


def default_of(f: Field) -> Any:
    """A field's default (a fresh copy of a list or dict); ``REQUIRED`` when it has none."""
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def help_texts(cls: type) -> dict[str, str]:
    """Field name -> its help text."""
    return {f.name: f.metadata["help"] for f in declared(cls)}


def stage_properties(cls: type) -> dict[str, dict[str, Any]]:
    """JSON-schema properties of the fields a stage takes as parameters: the declared type, the
    dataclass's default and the help text as description."""
    out: dict[str, dict[str, Any]] = {}
    for f in declared(cls):
        if not f.metadata["stage"]:
            continue
        prop = dict(f.metadata["schema"])
        default = default_of(f)
        if default is not REQUIRED:
            prop["default"] = default
        prop["description"] = f.metadata["help"]
        out[f.name] = prop
    return out


def required_params(cls: type) -> list[str]:
    """The stage parameters without a default (the schema's ``required``)."""
    return [f.name for f in declared(cls) if f.metadata["stage"] and default_of(f) is REQUIRED]


def from_params(cls: type, params: dict[str, Any], **given: Any) -> Any:
    """``cls`` built from a stage's (validated) parameters, with ``given`` for the fields the
    stage derives itself (paths it reads, values from other stages); a parameter not in
    ``params`` keeps the dataclass's default."""
    taken = {f.name: params[f.name] for f in declared(cls)
             if f.metadata["stage"] and f.name in params}
    return cls(**{**taken, **given})


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """An argparse argument for every field of ``cls`` that has flags (``dest``: the field name)."""
    for f in declared(cls):
        if f.metadata["flags"]:
            parser.add_argument(*f.metadata["flags"], **_argparse_kwargs(f))


def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """``cls`` built from parsed flags, with ``given`` for the rest (and for values the command
    parses itself, such as an object given as text)."""
    taken = {f.name: getattr(args, f.name) for f in declared(cls) if f.metadata["flags"]}
    return cls(**{**taken, **given})


def flag_names(cls: type) -> dict[str, str]:
    """Field name -> its flags as error messages name them (``-cl/--cmp-level``)."""
    return {f.name: "/".join(f.metadata["flags"]) for f in declared(cls) if f.metadata["flags"]}


def bounded(kind: type, minimum: float | None = None, maximum: float | None = None) -> Any:
    """An argparse ``type`` that parses ``kind`` and refuses a value outside [minimum, maximum]
    as a usage error (``--workers 0`` would otherwise run with no worker, or be read as "all")."""

    def parse(text: str) -> Any:
        value = kind(text)  # (a ValueError reads as argparse's own "invalid int value: 'x'")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g} (got {text})")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g} (got {text})")
        return value

    parse.__name__ = kind.__name__
    return parse


def json_type(schema: dict[str, Any]) -> str:
    """The schema's type other than null (``["integer", "null"]`` -> ``"integer"``)."""
    types = schema.get("type", "string")
    types = [types] if isinstance(types, str) else list(types)
    return next((t for t in types if t != "null"), "null")


def _argparse_kwargs(f: Field) -> dict[str, Any]:
    schema = f.metadata["schema"] or {}
    default = default_of(f)
    kwargs: dict[str, Any] = {"dest": f.name, "default": default,
                              "help": f.metadata["help"].replace("%", "%%")}
    kind = json_type(schema)
    if kind == "boolean":  # a switch: given, it flips the default
        kwargs["action"] = "store_false" if default else "store_true"
    elif kind == "array":
        kwargs["nargs"] = "+"
        kwargs["type"] = _PY_TYPES.get(json_type(schema.get("items", {})), str)
    else:
        kwargs["type"] = _PY_TYPES.get(kind, str)
        if kind in ("integer", "number") and ("minimum" in schema or "maximum" in schema):
            kwargs["type"] = bounded(kwargs["type"], schema.get("minimum"), schema.get("maximum"))
    if "enum" in schema:
        kwargs["choices"] = [v for v in schema["enum"] if v is not None]
    if f.metadata["metavar"]:
        kwargs["metavar"] = f.metadata["metavar"]
    return kwargs
