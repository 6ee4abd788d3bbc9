"""``${...}`` references in stage parameters.

Forms: ``${params.NAME}``, ``${env.NAME}``, ``${env.NAME:-default}``,
``${stages.ID.outputs.KEY[.KEY...]}`` (deeper keys index dicts, or lists by number).
A string that is exactly one reference takes the referenced value with its type; a reference
embedded in text is formatted as text (strings as is, other values as JSON). ``$${`` is a
literal ``${``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_IDENT = r"[A-Za-z_][A-Za-z0-9_-]*"
_PARAMS = re.compile(rf"params\.({_IDENT})")
_ENV = re.compile(r"env\.([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.S)
_STAGES = re.compile(rf"stages\.({_IDENT})\.outputs\.([A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*)")


@dataclass(frozen=True)
class Ref:
    """One ``${...}``: ``kind`` is params, env or stages; ``keys`` the output key path."""

    kind: str
    name: str
    keys: tuple[str, ...] = ()
    default: str | None = None
    start: int = 0  # offset of "${" in the string
    text: str = ""  # the whole "${...}"


class InterpolationError(ValueError):
    """A malformed reference; ``offset`` is where in the string it starts."""

    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


def parse(text: str) -> list[str | Ref]:
    """Split a string into literal parts and ``Ref``s (raises InterpolationError)."""
    parts: list[str | Ref] = []
    buf: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$${", i):
            buf.append("${")
            i += 3
            continue
        if text.startswith("${", i):
            end = text.find("}", i + 2)
            if end < 0:
                raise InterpolationError(f"unterminated {text[i:]!r}: missing '}}'", i)
            expr = text[i + 2 : end]
            if buf:
                parts.append("".join(buf))
                buf = []
            parts.append(_ref(expr, i, text[i : end + 1]))
            i = end + 1
            continue
        buf.append(text[i])
        i += 1
    if buf:
        parts.append("".join(buf))
    return parts


def _ref(expr: str, start: int, raw: str) -> Ref:
    if m := _PARAMS.fullmatch(expr):
        return Ref("params", m[1], start=start, text=raw)
    if m := _ENV.fullmatch(expr):
        return Ref("env", m[1], default=m[2], start=start, text=raw)
    if m := _STAGES.fullmatch(expr):
        return Ref("stages", m[1], tuple(m[2].split(".")), start=start, text=raw)
    raise InterpolationError(
        f"bad reference {raw!r}: expected ${{params.NAME}}, ${{env.NAME}}, ${{env.NAME:-default}} "
        "or ${stages.ID.outputs.KEY}",
        start,
    )


def strings(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    """Every string inside a JSON-like value, with its path relative to ``value``."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from strings(v, (*path, i))


def has_refs(text: str) -> bool:
    """True when ``text`` contains a ``${`` that is not the escape ``$${``."""
    return "${" in text.replace("$${", "")


def resolve(value: Any, lookup: Callable[[Ref], Any]) -> Any:
    """``value`` with every reference replaced by ``lookup(ref)`` (which may raise)."""
    if isinstance(value, dict):
        return {k: resolve(v, lookup) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, lookup) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    parts = parse(value)
    if len(parts) == 1 and isinstance(parts[0], Ref):
        return lookup(parts[0])
    return "".join(p if isinstance(p, str) else as_text(lookup(p)) for p in parts)


def as_text(value: Any) -> str:
    """How a referenced value reads inside a longer string."""
    return value if isinstance(value, str) else json.dumps(value)


def dig(value: Any, keys: tuple[str, ...]) -> Any:
    """``value[k1][k2]...``, where a key indexes a list when it is a number; KeyError otherwise."""
    for i, key in enumerate(keys):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            raise KeyError(".".join(keys[: i + 1]))
    return value
