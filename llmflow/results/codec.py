"""Result records as JSON, and back: one codec for every type that crosses a file.

A result type is a plain dataclass whose fields are annotated with JSON-shaped types: ``int``,
``float``, ``str``, ``bool``, ``None``, ``X | None``, ``list[X]``, ``dict[str, X]``,
``Literal[...]``, another result dataclass, or ``Any`` (free JSON, left as it is). ``to_json``
writes an instance as JSON values, ``from_json`` reads them back into the same type (checking each
field's type and naming the path of the first wrong one), and ``json_schema`` derives the JSON
schema of the file from the same annotations, so the committed schemas cannot drift from the code.

Floats JSON cannot hold (inf, nan) are written as the strings ``"inf"``, ``"-inf"``, ``"nan"``
and read back as floats. A field's description in the schema comes from
``field(metadata={"doc": ...})``, a type's from its docstring.

Why not a library: dataclasses are already the project's record type, the rules above fit in
this file, and the modules that read results (``validate``, the report) must import fast.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from typing import Any, Literal, TypeVar, Union

from llmflow.errors import UserError

T = TypeVar("T")

_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class RecordError(UserError):
    """A results file whose content does not fit its type: the message names the field's path."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


# --------------------------------------------------------------------------- writing


def to_json(obj: Any) -> Any:
    """``obj`` (a result dataclass, or lists/dicts of them and JSON values) as JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    if hasattr(obj, "item") and callable(obj.item):  # a numpy or torch scalar
        return to_json(obj.item())
    return str(obj)  # a dtype, a device, a path: its name


# --------------------------------------------------------------------------- reading


def from_json(cls: type[T], data: Any, *, where: str = "") -> T:
    """``data`` (JSON values) read back as ``cls``. A missing required field, an unknown field or
    a value of the wrong type raises ``RecordError`` naming its path (``where`` prefixes it)."""
    return _read(cls, data, where or cls.__name__)


def _fail(path: str, what: str) -> RecordError:
    return RecordError(f"{path}: {what}")


def _read(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _read_record(tp, value, path)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        arms = [arg for arg in args if arg is not type(None)]
        if len(arms) == 1:  # ``X | None``: X's own error, naming the field inside X
            return _read(arms[0], value, path)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _read(arg, value, path)
            except RecordError:
                continue
        raise _fail(path, f"{value!r} fits none of {_name(tp)}")
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise _fail(path, f"{value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _fail(path, f"expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return [_read(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(path, f"expected an object, got {type(value).__name__}")
        args = typing.get_args(tp)
        item = args[1] if len(args) == 2 else Any
        return {k: _read(item, v, f"{path}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str) and value in _NON_FINITE:
            return _NON_FINITE[value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _fail(path, f"expected a number, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _fail(path, f"expected an integer, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _fail(path, f"expected true or false, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _fail(path, f"expected text, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise _fail(path, f"expected null, got {value!r}")
    raise TypeError(f"{path}: a result field of type {tp!r} has no JSON form")  # a bug in a record


def _read_record(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise _fail(path, f"expected an object, got {type(value).__name__}")
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise _fail(path, f"unknown field {unknown[0]!r}")
    kwargs = {}
    for name, f in known.items():
        if name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _fail(f"{path}.{name}", "missing")
            continue
        kwargs[name] = _read(hints[name], value[name], f"{path}.{name}")
    return cls(**kwargs)


# --------------------------------------------------------------------------- schema


def json_schema(cls: type, *, title: str, description: str | None = None) -> dict[str, Any]:
    """The draft-07 JSON schema of ``cls`` as ``to_json`` writes it: every nested result type a
    definition, unknown fields refused, fields without a default required."""
    defs: dict[str, Any] = {}
    root = _schema(cls, defs)
    out: dict[str, Any] = {"$schema": "http://json-schema.org/draft-07/schema#", "title": title}
    out.update(defs.pop(cls.__name__))
    if description:  # (in place of the type's docstring)
        out["description"] = description
    if defs:
        out["definitions"] = dict(sorted(defs.items()))
    assert root == {"$ref": f"#/definitions/{cls.__name__}"}
    return _rebase(out, cls.__name__)


def _rebase(schema: Any, root_name: str) -> Any:
    """References to the root type point at the document itself (``#``)."""
    if isinstance(schema, dict):
        if schema.get("$ref") == f"#/definitions/{root_name}":
            return {"$ref": "#"}
        return {k: _rebase(v, root_name) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase(v, root_name) for v in schema]
    return schema


def _doc(cls: type) -> str | None:
    doc = inspect.getdoc(cls)
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature
        return None
    return " ".join(doc.split("\n\n")[0].split())


def _schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    if tp is Any:
        return {}
    if dataclasses.is_dataclass(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # placed first: a type that refers to itself stops here
            hints = _hints(tp)
            props: dict[str, Any] = {}
            required = []
            for f in dataclasses.fields(tp):
                if not f.init:
                    continue
                prop = _schema(hints[f.name], defs)
                if f.metadata.get("doc"):
                    prop = {**prop, "description": f.metadata["doc"]}
                props[f.name] = prop
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    required.append(f.name)
            body: dict[str, Any] = {"type": "object"}
            if _doc(tp):
                body["description"] = _doc(tp)
            if required:
                body["required"] = required
            body["additionalProperties"] = False
            body["properties"] = props
            defs[name] = body
        return {"$ref": f"#/definitions/{name}"}
    if _is_union(tp):
        return {"anyOf": [_schema(a, defs) for a in typing.get_args(tp)]}
    origin = typing.get_origin(tp)
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return {"type": "array", "items": _schema(item, defs)}
    if origin is dict:
        args = typing.get_args(tp)
        return {"type": "object", "additionalProperties": _schema(args[1], defs) if len(args) == 2 else {}}
    simple = {int: {"type": "integer"}, str: {"type": "string"}, bool: {"type": "boolean"},
              type(None): {"type": "null"},
              float: {"anyOf": [{"type": "number"}, {"enum": sorted(_NON_FINITE)}]}}
    if tp in simple:
        return dict(simple[tp])
    raise TypeError(f"a result field of type {tp!r} has no JSON form")


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
