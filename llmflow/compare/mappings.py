"""Op-mapping files: how target names of one implementation translate to golden names of another.

A mapping file (YAML or JSON, shape in ``schemas/mapping.schema.json``) is a list of rules::

    rules:
      - target: "{n}_DecoderLayer"          # glob: '*' within a name part, '**' any, '{n}' an integer
        golden: "model.layers.{n-1}"        # captures with + - * // arithmetic (no eval)
      - target: ["*{n}_Add_A", "*{n}_Add_B"]  # the SUM of two target tensors ...
        golden: "model.layers.{n}"          # ... against one golden tensor
      - target_type: "RmsNorm"               # by module type, the i-th match per capture set:
        target: "{n}_DecoderLayer.**"
        golden_sequence: ["model.layers.{n-1}.input_layernorm", "model.layers.{n-1}.post_attention_layernorm"]

``mapping:`` in a workflow (``-mf`` on the command line) is a path, or the name of an entry point
in the ``llmflow.mappings`` group (a callable returning a path): ``atb-llama`` ships with llmflow.

Two optional blocks make a mapping usable without ``-mf`` (see ``pairing.py``)::

    detect: {target_format: atb, target_types: [DecoderLayer]}   # when compare may pick it itself
    vars:                                                        # numbers read from the target dump
      layer_base: {first_of_type: DecoderLayer, default: 1}       # top-level number of its first layer

A template may subtract or add a var (``model.layers.{n-layer_base}``); ``Mapping.bind(reader)``
reads each var from the target's topology (ATB: ``model/<pid>/*.json``), else from its entries,
else takes the default.

The bisect from a target dump (``isolate: target_dump``) reads the same rules for module names:
a target module the golden model does not have (a port that renamed its modules) is the golden
module its output's rule names (``Mapping.module_names``). Regex captures carry a name's tail::

    rules:
      - {match: regex, target: 'transformer\\.h\\.(?P<n>\\d+)\\.attn(?P<rest>(\\..+)?)',
         golden: 'model.layers.{n}.self_attn{rest}'}

A tensor-parallel target's shards join by their shapes (``shards.py``); ``shards`` overrides that
for the names it matches, e.g. a row-parallel linear's partial products dumped before its
all-reduce::

    rules: []
    shards: [{target: "model.layers.*.mlp.down_proj/linear.*", merge: sum}]
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from llmflow.errors import UserError

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "mappings"
SCHEMA_FILE = DATA_DIR / "mapping.schema.json"
_CAPTURE = re.compile(r"\{([A-Za-z_]\w*)\}")
_TEMPLATE = re.compile(r"\{([A-Za-z_]\w*)\s*(?:(\+|-|\*|//)\s*(\d+|[A-Za-z_]\w*))?\}")
_LEADING_NUMBER = re.compile(r"^(\d+)_")


def atb_llama_mapping_path() -> str:
    """The ``atb-llama`` entry point: ATB (Ascend Transformer Boost) Llama <-> Hugging Face Llama."""
    return str(DATA_DIR / "atb_llama.yaml")


CONCAT, SUM, REPLICATED = "concat", "sum", "replicated"  # how a tensor-parallel target's shards join


@dataclass(frozen=True)
class ShardRule:
    """A ``shards`` entry: the ranks' tensors whose target name matches ``pattern`` join by
    ``merge`` (``sum``, ``replicated`` or ``concat:DIM``), whatever their shapes say
    (``llmflow/compare/shards.py``)."""

    pattern: re.Pattern[str]
    merge: str


@dataclass
class Rule:
    """One compiled rule (see the module docstring and the schema for the fields)."""

    where: str
    patterns: list[re.Pattern[str]]
    target_type: str | None
    golden: list[str]
    sequence: bool
    kind: str = "output"
    target_index: str | None = None
    golden_index: str | None = None
    golden_kind: str | None = None
    raw_targets: list[str] = field(default_factory=list)
    golden_vars: frozenset[str] = frozenset()  # captures the golden templates use

    def match_name(self, name: str, pattern: int = 0) -> dict[str, str] | None:
        m = self.patterns[pattern].fullmatch(name)
        return m.groupdict() if m else None

    def applies(self, kind: str, index: str, module_type: str | None) -> bool:
        if self.kind != "any" and kind != self.kind:
            return False
        if self.target_index is not None and index != self.target_index:
            return False
        if self.target_type is not None:
            return module_type is not None and fnmatch.fnmatchcase(module_type, self.target_type)
        return True

    def golden_name(self, captures: dict[str, str], occurrence: int = 0,
                    variables: dict[str, int] | None = None) -> str | None:
        """The golden name for these captures: the last replaced op, or the occurrence-th one."""
        if self.sequence:
            if occurrence >= len(self.golden):
                return None
            template = self.golden[occurrence]
        else:
            template = self.golden[-1]
        return fill_template(template, captures, self.where, variables)


@dataclass
class Mapping:
    """A loaded mapping file; ``variables`` hold its vars' values once ``bind`` has read them."""

    path: str
    name: str
    rules: list[Rule]
    detect: dict[str, Any] | None = None
    var_specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    variables: dict[str, int] = field(default_factory=dict)
    var_sources: dict[str, str] = field(default_factory=dict)  # var -> where its value came from
    shards: list[ShardRule] = field(default_factory=list)

    def detects(self, target: Any) -> bool:
        """Does the target dump look like what this mapping was written for (its ``detect``)?"""
        if not self.detect:
            return False
        fmt = self.detect.get("target_format")
        if fmt and getattr(target, "format", None) != fmt:
            return False
        wanted = self.detect.get("target_types") or []
        if not wanted:
            return True
        have = {e.module_type for e in target.entries() if e.module_type} | _topology_types(target)
        return all(any(fnmatch.fnmatchcase(t, w) for t in have) for w in wanted)

    def module_names(self, modules: Iterable[tuple[str, str | None]]) -> dict[str, str]:
        """Target module name -> the golden name the rules give it, for ``modules`` ((name, module
        type), in execution order): the first rule that applies to the module's output ``0`` and
        whose one pattern matches the whole name, as the compare pairs that output (a
        ``golden_sequence`` by the same count of occurrences; a many-to-one rule names a sum of
        tensors, no module). Names no rule maps are left out."""
        names: dict[str, str] = {}
        occurrences: dict[tuple[int, tuple[tuple[str, str], ...]], int] = defaultdict(int)
        for name, module_type in modules:
            for ri, rule in enumerate(self.rules):
                if not rule.applies("output", "0", module_type):
                    continue
                if len(rule.patterns) > 1:  # the first matching rule wins, as in the compare
                    if any(rule.match_name(name, i) is not None for i in range(len(rule.patterns))):
                        break
                    continue
                captures = rule.match_name(name)
                if captures is None:
                    continue
                key = (ri, tuple(sorted((k, v) for k, v in captures.items() if k in rule.golden_vars)))
                golden = rule.golden_name(captures, occurrences[key], self.variables)
                occurrences[key] += 1
                if golden is not None:
                    names[name] = golden
                break
        return names

    def bind(self, target: Any) -> Mapping:
        """A copy with each var read from ``target`` (a DumpReader): its topology's top-level nodes,
        else its entries' names, else the var's default."""
        values, sources = {}, {}
        for var, spec in self.var_specs.items():
            found = _first_of_type(target, spec["first_of_type"])
            if found is None:
                values[var], sources[var] = int(spec.get("default", 0)), "default"
            else:
                values[var], sources[var] = found
        return Mapping(self.path, self.name, self.rules, self.detect, self.var_specs, values, sources,
                       self.shards)


def _topology_types(target: Any) -> set[str]:
    topo = target.topology() if hasattr(target, "topology") else None
    return {str(c.get("type")) for c in (topo or {}).get("children") or [] if isinstance(c, dict)}


def _first_of_type(target: Any, type_glob: str) -> tuple[int, str] | None:
    """(number, source) of the first top-level op of this type: ``3`` for ``3_DecoderLayer``."""
    topo = target.topology() if hasattr(target, "topology") else None
    for i, child in enumerate((topo or {}).get("children") or []):
        if isinstance(child, dict) and fnmatch.fnmatchcase(str(child.get("type")), type_glob):
            m = _LEADING_NUMBER.match(str(child.get("name") or ""))
            return (int(m.group(1)) if m else i), "topology"
    numbers = [int(m.group(1)) for e in target.entries()
               if e.module_type and "." not in e.name and "/" not in e.name
               and fnmatch.fnmatchcase(e.module_type, type_glob) and (m := _LEADING_NUMBER.match(e.name))]
    return (min(numbers), "entries") if numbers else None


def fill_template(template: str, captures: dict[str, str], where: str = "",
                  variables: dict[str, int] | None = None) -> str:
    """``model.layers.{n-1}`` with ``{"n": "3"}`` -> ``model.layers.2`` (integer arithmetic only);
    the operand may be a mapping var: ``{n-layer_base}``."""

    def sub(m: re.Match[str]) -> str:
        var, op, num = m.group(1), m.group(2), m.group(3)
        if var not in captures:
            raise UserError(f"{where}: golden template {template!r} uses {{{var}}}, which the target "
                            "pattern does not capture")
        value = captures[var]
        if op is None:
            return value
        if not num.isdigit():
            if variables is None or num not in variables:
                raise UserError(f"{where}: golden template {template!r} uses the var {num!r}, "
                                "which has no value (declare it under vars)")
            num = str(variables[num])
        try:
            n, k = int(value), int(num)
        except ValueError as exc:
            raise UserError(f"{where}: capture {var}={value!r} is not an integer") from exc
        result = {"+": n + k, "-": n - k, "*": n * k, "//": n // k if k else n}[op]
        return str(result)

    return _TEMPLATE.sub(sub, template)


def glob_to_regex(pattern: str) -> str:
    """A glob as a regex: ``*`` any text within one path part (no ``.`` or ``/``), ``**`` any
    text, ``?`` one character, ``{name}`` an integer capture (the same name twice: equal)."""
    out, pos, seen = [], 0, set()
    for m in re.finditer(r"\{([A-Za-z_]\w*)\}|\*\*|\*|\?", pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        tok = m.group(0)
        if tok == "**":
            out.append(".*?")
        elif tok == "*":
            out.append("[^./]*?")
        elif tok == "?":
            out.append(".")
        elif m.group(1) in seen:
            out.append(f"(?P={m.group(1)})")
        else:
            seen.add(m.group(1))
            out.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return "".join(out)


def resolve_mapping(ref: str | Path, base_dir: str | Path = ".") -> Path:
    """A mapping reference (a file path, or an ``llmflow.mappings`` entry-point name) -> its file."""
    text = str(ref)
    p = Path(text).expanduser()
    if not p.is_absolute():
        p = Path(base_dir) / p
    if p.is_file():
        return p
    if p.suffix.lower() in (".yaml", ".yml", ".json") or "/" in text or "\\" in text:
        raise UserError(f"mapping: no such file {p}")
    from llmflow.plugins import load_plugin

    func = load_plugin("llmflow.mappings", text)
    path = Path(func() if callable(func) else func)
    if not path.is_file():
        raise UserError(f"mapping {text!r}: its entry point returned {path}, which does not exist")
    return path


@lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def load_mapping(ref: str | Path, base_dir: str | Path = ".") -> Mapping:
    """Load, validate (JSON Schema) and compile a mapping file; UserError names file and path."""
    import jsonschema
    import yaml

    path = resolve_mapping(ref, base_dir)
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise UserError(f"{path}{at}: cannot read mapping file: {str(exc).splitlines()[0]}") from exc
    validator = jsonschema.Draft7Validator(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise UserError(f"{path}: {where}: {err.message}")
    default_match = data.get("match", "glob")
    var_specs = data.get("vars") or {}
    rules = [_compile(r, i, default_match, path, set(var_specs)) for i, r in enumerate(data["rules"])]
    defaults = {k: int(v.get("default", 0)) for k, v in var_specs.items()}
    shards = [ShardRule(re.compile(glob_to_regex(sr["target"])), sr["merge"])
              for sr in data.get("shards") or ()]
    return Mapping(path=str(path), name=data.get("name", path.stem), rules=rules, detect=data.get("detect"),
                   var_specs=var_specs, variables=defaults, var_sources=dict.fromkeys(defaults, "default"),
                   shards=shards)


def _compile(r: dict[str, Any], i: int, default_match: str, path: Path, var_names: set[str]) -> Rule:
    where = f"{path}: rules/{i}"
    targets = r.get("target", "*")
    targets = [targets] if isinstance(targets, str) else list(targets)
    syntax = r.get("match", default_match)
    patterns = []
    for t in targets:
        try:
            patterns.append(re.compile(t if syntax == "regex" else glob_to_regex(t)))
        except re.error as exc:
            raise UserError(f"{where}/target: bad pattern {t!r}: {exc}") from exc
    golden = r.get("golden_sequence") or r.get("golden")
    golden = [golden] if isinstance(golden, str) else list(golden)
    captured = set().union(*(p.groupindex for p in patterns))
    for g in golden:
        for m in _TEMPLATE.finditer(g):
            if m.group(1) not in captured:
                raise UserError(f"{where}/golden: {g!r} uses {{{m.group(1)}}}, which the target "
                                "pattern does not capture")
            operand = m.group(3)
            if operand and not operand.isdigit() and operand not in var_names:
                raise UserError(f"{where}/golden: {g!r} uses the var {operand!r}, which the file's "
                                f"vars do not declare (declared: {', '.join(sorted(var_names)) or 'none'})")
    return Rule(where=where, patterns=patterns, target_type=r.get("target_type"), golden=golden,
                sequence="golden_sequence" in r, kind=r.get("kind", "output"),
                target_index=r.get("target_index"), golden_index=r.get("golden_index"),
                golden_kind=r.get("golden_kind"), raw_targets=targets,
                golden_vars=frozenset(m.group(1) for g in golden for m in _TEMPLATE.finditer(g)))
