"""The workflow JSON Schema (draft-07), built from each stage type's ``params_schema``.

Two flavours from one builder:
  * ``structural_schema()``: the file's shape with every stage's ``with:`` left open. The loader
    validates each YAML file against it (before include/extends merging), and stage parameters
    are checked separately against the stage's own schema so that ``${...}`` values can wait
    until run time.
  * ``workflow_schema(stage_types)``: the same plus, for each registered type, ``if uses == X then
    with: <X's params_schema>``. That file (``schemas/workflow.schema.json``) is for editors
    (yaml-language-server completion and hover); each parameter also accepts a whole ``${...}``.

``schema_errors`` turns jsonschema errors into ``FILE:LINE:COL`` errors using the mark map.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from llmflow.plugins import suggest
from llmflow.workflow.marks import MarkMap, ValidationError

NAME_PATTERN = "^[A-Za-z_][A-Za-z0-9_-]*$"
FILE_REF_PATTERN = r"^.+\.py:[A-Za-z_][A-Za-z0-9_]*$"
PARAM_TYPES = ["string", "integer", "number", "boolean", "array", "object", "null"]

_INTERPOLATION = {
    "type": "string",
    "pattern": r"^\$\{[^}]+\}$",
    "description": "a ${params.X}, ${env.X} or ${stages.ID.outputs.KEY} reference",
}

_PARAM = {
    "type": "object",
    "additionalProperties": False,
    "description": "A workflow parameter, overridable with --set NAME=VALUE.",
    "properties": {
        "type": {"anyOf": [{"enum": PARAM_TYPES}, {"type": "array", "items": {"enum": PARAM_TYPES},
                                                   "minItems": 1, "uniqueItems": True}],
                 "description": "JSON type of the value, or a list of them ([integer, \"null\"]: optional)."},
        "default": {"description": "Value used when --set does not give one."},
        "description": {"type": "string", "description": "What the parameter means."},
        "enum": {"type": "array", "minItems": 1, "description": "The allowed values."},
        "minimum": {"type": "number", "description": "Smallest allowed number."},
        "maximum": {"type": "number", "description": "Largest allowed number."},
        "format": {"enum": ["path"], "description": (
            "path: a file or folder (or file.py:name); a relative --set value is read from the current "
            "directory, unless only this file's directory holds it; values in the YAML from this "
            "file's directory.")},
    },
}


def _stage(stage_types: dict[str, Any]) -> dict[str, Any]:
    uses: dict[str, Any] = {
        "type": "string",
        "description": "A stage type (llmflow stages) or path/file.py:ClassName relative to this file.",
    }
    if stage_types:
        uses["anyOf"] = [{"enum": sorted(stage_types)}, {"pattern": FILE_REF_PATTERN}]
    schema: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "uses": uses,
            "with": {"type": "object", "description": "The stage type's parameters."},
            "needs": {
                "type": "array",
                "items": {"type": "string", "pattern": NAME_PATTERN},
                "uniqueItems": True,
                "description": "Stages that must finish first (and whose outputs this one reads).",
            },
            "description": {"type": "string", "description": "What this stage is for."},
        },
    }
    branches = []
    for name in sorted(stage_types):
        params = with_schema_for_editors(stage_types[name].params_schema)
        doc = stage_types[name].doc()
        if doc:
            params["description"] = doc
        branches.append(
            {
                "if": {"properties": {"uses": {"const": name}}, "required": ["uses"]},
                "then": {"properties": {"with": params}},
            }
        )
    if branches:
        schema["allOf"] = branches
    return schema


def with_schema_for_editors(params_schema: dict[str, Any]) -> dict[str, Any]:
    """A stage's params schema where every parameter may also be one whole ``${...}`` reference;
    description and default are hoisted so editors still show them."""
    schema = copy.deepcopy(params_schema)
    props = schema.get("properties", {})
    for name, prop in list(props.items()):
        hoisted = {k: prop[k] for k in ("description", "default") if k in prop}
        props[name] = {**hoisted, "anyOf": [prop, {"$ref": "#/definitions/interpolation"}]}
    return schema


def workflow_schema(stage_types: dict[str, Any] | None = None) -> dict[str, Any]:
    """The workflow file schema; ``stage_types`` (name -> Stage class) adds per-type ``with:``."""
    stage_types = stage_types or {}
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "llmflow workflow",
        "description": "A DAG of stages: llmflow run FILE. Generated by `llmflow schema`; do not edit.",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "name": {
                "type": "string",
                "pattern": "^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
                "description": "Workflow name; the default run dir is runs/<name>.",
            },
            "description": {"type": "string", "description": "What the workflow does."},
            "extends": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
                "description": "Base recipe file(s), relative to this file; this file overrides them.",
            },
            "include": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Recipe files whose params and stages are added (ids must not clash).",
            },
            "params": {
                "type": "object",
                "propertyNames": {"pattern": NAME_PATTERN},
                "additionalProperties": {"$ref": "#/definitions/param"},
                "description": "Parameters, referenced as ${params.NAME}.",
            },
            "stages": {
                "type": "object",
                "propertyNames": {"pattern": NAME_PATTERN},
                "additionalProperties": {"$ref": "#/definitions/stage"},
                "description": "Stages by id, run in dependency order.",
            },
        },
        "definitions": {
            "param": _PARAM,
            "stage": _stage(stage_types),
            "interpolation": _INTERPOLATION,
        },
    }


def structural_schema() -> dict[str, Any]:
    """The workflow schema without per-stage parameter schemas (see module docstring)."""
    return workflow_schema({})


def _dotted(path: Iterable[Any]) -> str:
    return ".".join(str(p) for p in path)


def schema_errors(
    schema: dict[str, Any], instance: Any, marks: MarkMap, base: tuple = (), skip: Iterable[tuple] = ()
) -> list[ValidationError]:
    """Validate ``instance`` (found at ``base`` in the document) and map each error to a mark.

    Errors at or under a path in ``skip`` (values only known at run time) are dropped.
    """
    skip = [tuple(s) for s in skip]
    validator = jsonschema.Draft7Validator(schema)
    out: list[ValidationError] = []
    for err in sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path]):
        rel = tuple(err.absolute_path)
        if any(rel[: len(s)] == s for s in skip):
            continue
        path = (*base, *rel)
        if err.validator in ("anyOf", "oneOf") and err.context:
            deeper = best_match(err.context)
            if deeper.validator != "type":
                err = deeper
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = err.schema.get("properties", {})
            for key in err.instance:
                if key not in known and not _pattern_allows(err.schema, key):
                    msg = f"unknown key {key!r}"
                    msg += f" in {_dotted(path)}" if path else ""
                    out.append(ValidationError(msg + suggest(key, known), marks.key((*path, key))))
            continue
        if err.validator == "propertyNames":
            out.append(
                ValidationError(
                    f"invalid name {err.instance!r} in {_dotted(path)}: use letters, digits, '_' and '-', "
                    "starting with a letter or '_'",
                    marks.key((*path, err.instance)),
                )
            )
            continue
        if err.validator == "required":
            out.append(ValidationError(f"{_dotted(path) or 'document'}: {err.message}", marks.key(path)))
            continue
        prefix = f"{_dotted(path)}: " if path else ""
        out.append(ValidationError(prefix + err.message, marks.value(path)))
    return out


def _pattern_allows(schema: dict[str, Any], key: str) -> bool:
    import re

    return any(re.search(p, key) for p in schema.get("patternProperties", {}))


def generate() -> str:
    """The text of ``schemas/workflow.schema.json``: every registered stage type must import."""
    import json

    from llmflow.errors import UserError
    from llmflow.workflow.registry import load_registered

    ok, failed = load_registered()
    if failed:
        raise UserError(
            f"cannot build the schema: stage type(s) {', '.join(sorted(failed))} fail to import "
            "('llmflow stages' shows why)"
        )
    return json.dumps(workflow_schema(ok), indent=2) + "\n"
