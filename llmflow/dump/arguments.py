"""A call's arguments rebuilt from the labelled leaves a dump writes.

The recorder's walk (``recorder.walk_inputs``) flattens a call's inputs into leaves labelled
``"0"``, ``"1.0"`` (positional, nested) and ``"kw:name"``, ``"kw:name.0"`` (keyword). Replaying the
call from a dump needs the structure back: ``rebuild_arguments`` nests the leaves again into
positional and keyword arguments (lists become tuples, as the calls had them). Non-tensor leaves
come as their JSON value and Python type name; ``decode_value`` turns the ones a replay can use
back into values (plain scalars, and the torch dtypes, devices and memory formats the dump
records by name) and says why for the others. Module replay (``llmflow.localize.calls``) and the
op precheck (``llmflow.checks.precheck``) share this.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from llmflow.dtypes import torch_dtype

SIMPLE_TYPES = ("NoneType", "bool", "int", "float", "str")
#: empty sequences, recorded by their length (0) and their type's name (``torch.zeros(())``'s
#: size); a sequence nested too deep to walk has no value
EMPTY_SEQUENCES: dict[str, type] = {"tuple": tuple, "list": list, "Size": torch.Size}
#: torch values a dump records by name, and the torch type each name must resolve to
NAMED_TYPES: dict[str, type] = {"dtype": torch.dtype, "memory_format": torch.memory_format,
                                "layout": torch.layout}


class Unrebuildable(ValueError):
    """A recorded non-tensor input a replay cannot rebuild (the message says which and why)."""


def is_cache_type(pytype: str | None) -> bool:
    """Does a dump's recorded type name denote a KV cache (``DynamicCache``, ``StaticCache`` ...)?"""
    return bool(pytype) and pytype.endswith("Cache")  # type: ignore[union-attr]


def decode_value(json_value: Any, pytype: str | None) -> Any:
    """The value of a recorded non-tensor input; ``Unrebuildable`` for one a dump cannot hold.

    A dtype/memory format named ``"torch.float32"`` is looked up as an attribute of ``torch``
    (never evaluated) and must be of that kind; a device is rebuilt by ``torch.device``."""
    if pytype in SIMPLE_TYPES or pytype is None:
        return json_value
    if json_value == 0 and pytype in EMPTY_SEQUENCES:  # (the only sequences a dump records whole)
        return EMPTY_SEQUENCES[pytype]()
    if isinstance(json_value, str) and pytype in NAMED_TYPES:
        found = (torch_dtype(json_value) if pytype == "dtype"
                 else getattr(torch, json_value.removeprefix("torch."), None))
        if isinstance(found, NAMED_TYPES[pytype]):
            return found
    if isinstance(json_value, str) and pytype == "device":
        try:
            return torch.device(json_value)
        except (RuntimeError, ValueError):
            pass
    raise Unrebuildable(f"a {pytype} value" + (f" {json_value!r}" if json_value is not None else ""))


def _set_path(root: dict[str, Any], parts: list[str], value: Any) -> None:
    node = root
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _freeze(node: Any) -> Any:
    """Nested dicts keyed "0", "1", ... -> tuples (the structure the call was made with);
    dicts with other keys stay dicts."""
    if isinstance(node, dict):
        if all(k.isdigit() for k in node):
            return tuple(_freeze(node[k]) for k in sorted(node, key=int))
        return {k: _freeze(v) for k, v in node.items()}
    return node


def rebuild_arguments(leaves: Iterable[tuple[str, Any]]) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments from ``(index, value)`` leaves as the dump labels them."""
    pos: dict[str, Any] = {}
    kw: dict[str, Any] = {}
    for index, value in leaves:
        if index.startswith("kw:"):
            _set_path(kw, index[3:].split("."), value)
        else:
            _set_path(pos, index.split("."), value)
    return (list(_freeze(pos)) if pos else []), {k: _freeze(v) for k, v in kw.items()}
