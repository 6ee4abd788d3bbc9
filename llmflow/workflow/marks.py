"""YAML loading that remembers where every key and value came from.

Every error about a workflow is reported as ``FILE:LINE:COL: message`` (1-based), so the loader
uses ``yaml.compose`` (a node tree with marks) instead of ``yaml.safe_load`` and converts the tree
to plain JSON-like values itself, recording a ``Mark`` for every value and every mapping key under
its *path* in the document: ``("stages", "dump", "with", "model")``. Paths stay valid through
``include:``/``extends:`` merging, and each mark names the file that defined the node.

A workflow may come from someone else, so loading is bounded: at most ``MAX_YAML_BYTES`` of text,
collections nested at most ``MAX_DEPTH`` deep (checked while composing, before any recursion can
run away), and at most ``MAX_VALUES`` values once aliases are expanded (a "billion laughs" file
of a few hundred bytes otherwise grows to gigabytes). Going past a bound is one error, not a hang.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmflow.errors import UserError, one_line

Path_ = tuple  # a path in a document: keys (str) and list indices (int)

MAX_YAML_BYTES = 2 << 20
MAX_DEPTH = 64
MAX_VALUES = 100_000

_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"


@dataclass(frozen=True)
class Mark:
    """Where a node starts: ``file`` as shown to the user, 1-based ``line`` and ``col``.

    ``style`` is the scalar style (None plain, ``'"'``/``"'"`` quoted, ``"|"``/``">"`` block) and
    ``one_line`` whether the node fits on one line; both let ``at_offset`` point inside a string.
    """

    file: str
    line: int
    col: int
    style: str | None = None
    one_line: bool = True

    def at_offset(self, text: str, offset: int) -> Mark:
        """The mark of character ``offset`` of the scalar ``text`` this mark starts, when exact."""
        if not self.one_line or self.style not in (None, '"', "'"):
            return self
        if self.style is None:
            return Mark(self.file, self.line, self.col + offset, self.style)
        if any(c in text[:offset] for c in "\\'\""):
            return self  # escapes make the source and value columns differ
        return Mark(self.file, self.line, self.col + 1 + offset, self.style)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class ValidationError:
    """One problem in a workflow. ``mark`` is None for problems outside any file (``--set``)."""

    message: str
    mark: Mark | None = None

    def __str__(self) -> str:
        return one_line(f"{self.mark}: {self.message}" if self.mark else self.message)


class WorkflowError(UserError):
    """A workflow that cannot be loaded or run; carries every ``ValidationError`` found."""

    def __init__(self, errors: list[ValidationError]):
        self.errors = list(errors)
        more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
        super().__init__(f"{self.errors[0]}{more}" if self.errors else "invalid workflow")


@dataclass
class MarkMap:
    """Path -> Mark for values (``values``) and for mapping keys (``keys``)."""

    values: dict[Path_, Mark] = field(default_factory=dict)
    keys: dict[Path_, Mark] = field(default_factory=dict)

    def value(self, path: Path_) -> Mark | None:
        """The mark of the value at ``path``, else of its nearest marked ancestor."""
        path = tuple(path)
        while True:
            if path in self.values:
                return self.values[path]
            if not path:
                return None
            path = path[:-1]

    def key(self, path: Path_) -> Mark | None:
        """The mark of the key naming ``path`` (falls back to the value's mark)."""
        path = tuple(path)
        return self.keys.get(path) or self.value(path)

    def drop(self, *prefixes: Path_) -> None:
        """Forget every mark at or under any of ``prefixes`` (those subtrees are being replaced):
        one pass over the marks whatever their number (a file of thousands of stages)."""
        under = _under(prefixes)
        for table in (self.values, self.keys):
            for p in [p for p in table if under(p)]:
                del table[p]

    def copy_from(self, other: MarkMap, *prefixes: Path_) -> None:
        """Take ``other``'s marks at or under any of ``prefixes`` (those subtrees now come from
        there), in one pass over ``other``'s marks."""
        under = _under(prefixes)
        for mine, theirs in ((self.values, other.values), (self.keys, other.keys)):
            for p, m in theirs.items():
                if under(p):
                    mine[p] = m


def _under(prefixes: tuple[Path_, ...]) -> Callable[[tuple], bool]:
    """Is a path at or under one of ``prefixes``? (a set lookup per prefix length)"""
    by_length: dict[int, set[tuple]] = {}
    for prefix in prefixes:
        by_length.setdefault(len(prefix), set()).add(tuple(prefix))
    return lambda p: any(p[:n] in heads for n, heads in by_length.items())


def _mark(node: yaml.Node, display: str) -> Mark:
    start, end = node.start_mark, node.end_mark
    style = getattr(node, "style", None) if isinstance(node, yaml.ScalarNode) else None
    return Mark(display, start.line + 1, start.column + 1, style, start.line == end.line)


def _yaml_error(exc: yaml.YAMLError, display: str) -> ValidationError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    msg = f"invalid YAML: {problem}" + (f" ({context})" if context else "")
    if mark is None:
        return ValidationError(msg, Mark(display, 1, 1))
    return ValidationError(msg, Mark(display, mark.line + 1, mark.column + 1))


class YamlTooBig(UserError):
    """YAML past a loading bound (size, depth, expanded values); ``error`` says where."""

    def __init__(self, error: ValidationError):
        super().__init__(str(error))
        self.error = error


class _TooDeep(yaml.composer.ComposerError):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` whose composer refuses collections nested deeper than ``MAX_DEPTH``."""

    depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _TooDeep(
                    None, None, f"collections nested deeper than {MAX_DEPTH} levels", mark
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _Converter:
    """Node tree -> plain values + marks, collecting problems instead of stopping at the first."""

    def __init__(self, display: str):
        self.display = display
        self.marks = MarkMap()
        self.errors: list[ValidationError] = []
        self._scalars = yaml.constructor.SafeConstructor()
        self._open: set[int] = set()  # collections being converted: a recursive alias is an error
        self._values = 0

    def convert(self, node: yaml.Node, path: Path_) -> Any:
        self._values += 1
        if self._values > MAX_VALUES:
            raise YamlTooBig(
                ValidationError(
                    f"more than {MAX_VALUES} values once YAML aliases are expanded; refusing to load",
                    _mark(node, self.display),
                )
            )
        self.marks.values[path] = _mark(node, self.display)
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            if id(node) in self._open:
                self._error(node, "recursive YAML alias")
                return None
            self._open.add(id(node))
            try:
                if isinstance(node, yaml.MappingNode):
                    return self._mapping(node, path)
                if node.tag != _SEQ_TAG:
                    self._error(node, f"unsupported YAML tag {node.tag!r}")
                return [self.convert(item, (*path, i)) for i, item in enumerate(node.value)]
            finally:
                self._open.discard(id(node))
        try:
            value = self._scalars.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            self._error(node, f"unsupported YAML value: {getattr(exc, 'problem', exc)}")
            return None
        if isinstance(value, (datetime.date, datetime.datetime)):
            return value.isoformat()  # keep values JSON: dates are text to llmflow
        if isinstance(value, bytes):
            self._error(node, "binary YAML values are not supported")
            return None
        return value

    def _mapping(self, node: yaml.MappingNode, path: Path_) -> dict[str, Any]:
        if node.tag != _MAP_TAG:
            self._error(node, f"unsupported YAML tag {node.tag!r}")
        out: dict[str, Any] = {}
        seen: dict[str, Mark] = {}
        for key_node, value_node in node.value:
            key_mark = _mark(key_node, self.display)
            if key_node.tag == "tag:yaml.org,2002:merge":
                self._error(key_node, "YAML merge keys ('<<') are not supported; use 'extends:'")
                continue
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                self._error(key_node, "mapping keys must be strings")
                continue
            key = key_node.value
            if key in seen:
                self._error(key_node, f"duplicate key {key!r} (first defined at line {seen[key].line})")
                continue
            seen[key] = key_mark
            self.marks.keys[(*path, key)] = key_mark
            out[key] = self.convert(value_node, (*path, key))
        return out

    def _error(self, node: yaml.Node, message: str) -> None:
        self.errors.append(ValidationError(message, _mark(node, self.display)))


def load_yaml(path: Path, display: str) -> tuple[Any, MarkMap, list[ValidationError]]:
    """Parse one YAML file into (data, marks, errors). Errors never raise."""
    try:
        size = path.stat().st_size
        if size > MAX_YAML_BYTES:
            too_big = f"{size} bytes: larger than the {MAX_YAML_BYTES} bytes a workflow file may be"
            return None, MarkMap(), [ValidationError(too_big, Mark(display, 1, 1))]
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, MarkMap(), [ValidationError(f"cannot read file: {exc}", Mark(display, 1, 1))]
    try:
        return parse_yaml(text, display)
    except YamlTooBig as exc:
        return None, MarkMap(), [exc.error]


def parse_yaml(text: str, display: str) -> tuple[Any, MarkMap, list[ValidationError]]:
    """Parse YAML text into (data, marks, errors); raises ``YamlTooBig`` past a bound."""
    if len(text) > MAX_YAML_BYTES:
        raise YamlTooBig(ValidationError(f"{len(text)} characters: more than {MAX_YAML_BYTES} allowed"))
    try:
        node = yaml.compose(text, Loader=_BoundedLoader)
    except _TooDeep as exc:
        raise YamlTooBig(_yaml_error(exc, display)) from None
    except yaml.YAMLError as exc:
        return None, MarkMap(), [_yaml_error(exc, display)]
    if node is None:
        return None, MarkMap(), [ValidationError("the file is empty", Mark(display, 1, 1))]
    conv = _Converter(display)
    data = conv.convert(node, ())
    return data, conv.marks, conv.errors
