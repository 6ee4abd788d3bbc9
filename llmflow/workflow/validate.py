"""Semantic checks of a loaded workflow, and the run-time resolution of a stage's parameters.

``check`` finds every problem it can before anything runs: param specs and ``--set`` values,
stage types (with a suggestion), ``needs`` (unknown ids, cycles), ``${...}`` references
(syntax, unknown params, stages not in ``needs``, undeclared outputs) and each stage's ``with:``
against its ``params_schema`` and its ``check_values``. Literal values and
``${params.X}``/``${env.X}`` values are checked now; values that depend on other stages' outputs
are checked by ``resolve_with`` when the stage is about to run.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from llmflow.errors import UserError, one_line
from llmflow.plugins import file_ref_problem, find_group, is_file_ref, suggest
from llmflow.redaction import Redactor, secret_env_values
from llmflow.stages.base import Stage, fill_defaults
from llmflow.workflow import dag
from llmflow.workflow.interpolate import InterpolationError, Ref, dig, has_refs, parse, resolve, strings
from llmflow.workflow.marks import Mark, ValidationError, WorkflowError, YamlTooBig, parse_yaml
from llmflow.workflow.model import Workflow
from llmflow.workflow.registry import file_ref_path, resolve_stage
from llmflow.workflow.schema import schema_errors
from llmflow.workflow.static_stage import StaticReadError

SetParams = Mapping[str, Any] | Iterable[str] | None
_DOUBLE_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)  # one YAML double-quoted scalar


@dataclass
class Checked:
    """A workflow after ``check``: param values, stage classes, execution order, problems."""

    workflow: Workflow
    params: dict[str, Any] = field(default_factory=dict)
    classes: dict[str, type[Stage]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    errors: list[ValidationError] = field(default_factory=list)
    given: set[str] = field(default_factory=set)  # the params given with --set
    #: redacts what the run writes: the values of ``${env.X}`` references with a secret name X
    redact: Redactor = field(default_factory=Redactor)

    @property
    def needs(self) -> dict[str, list[str]]:
        return {sid: st.needs for sid, st in self.workflow.stages.items()}


class _Dynamic(Exception):
    """A value only known at run time (another stage's output, an unset env var)."""


def parse_set(items: SetParams) -> dict[str, str]:
    """``["a=1", "b=x"]`` (or a mapping) -> name -> raw value."""
    if items is None:
        return {}
    if isinstance(items, Mapping):
        return dict(items)
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UserError(f"--set {item!r}: expected NAME=VALUE")
        out[name.strip()] = value
    return out


def parse_set_value(name: str, raw: str) -> Any:
    """A ``--set`` value read as YAML (``3``, ``true``, ``[1, 2]``), within the same bounds as a
    workflow file (raises ``YamlTooBig``); text that is not valid YAML stays text."""
    if not raw.strip():
        return raw
    data, _, errors = parse_yaml(raw, f"--set {name}")
    return raw if errors else data


def parse_set_text(raw: str) -> str:
    """A ``--set`` value of a string param: the text as typed, every line and space kept
    (``--set prompt=$'line one\nline two'`` is two lines; ``yes``, ``a: b`` and ``x # y`` are
    text, not YAML). Only a value wrapped in one pair of quotes is read as a YAML quoted scalar,
    quotes taken off: ``"a\nb"`` has its escapes, ``'it''s'`` its doubled quote, and a line
    break typed inside the quotes stays a line break (YAML would fold it into a space)."""
    if len(raw) < 2 or raw[0] != raw[-1] or raw[0] not in "'\"":
        return raw
    if raw[0] == "'":  # single quotes have no escapes: the text between them, '' read as '
        inner = raw[1:-1]
        return raw if "'" in inner.replace("''", "") else inner.replace("''", "'")  # ('a' or 'b')
    if not _DOUBLE_QUOTED.fullmatch(raw):
        return raw  # "a" or "b": not one quoted scalar
    try:  # YAML for the escapes; typed line breaks made escapes first, so they stay
        data = yaml.safe_load(raw.replace("\r", "\\r").replace("\n", "\\n"))
    except yaml.YAMLError:
        return raw  # an unknown escape ("\q"): the text as typed
    return data if isinstance(data, str) else raw


def _param_schema(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: spec[k] for k in ("type", "enum", "minimum", "maximum") if k in spec}


def _check_params(wf: Workflow, set_params: SetParams, checked: Checked) -> None:
    for name, spec in wf.params.items():
        if "default" in spec:
            errs = schema_errors(_param_schema(spec), spec["default"], wf.marks, ("params", name, "default"))
            checked.errors += [
                ValidationError(f"param {name!r} default: {e.message.split(': ', 1)[-1]}", e.mark)
                for e in errs
            ]
            checked.params[name] = spec["default"]
    for name, raw in parse_set(set_params).items():
        if name not in wf.params:
            checked.errors.append(
                ValidationError(f"--set {name}: unknown param {name!r}{suggest(name, wf.params)}")
            )
            continue
        value: Any = raw
        if isinstance(raw, str) and wf.params[name]["type"] == "string":
            value = parse_set_text(raw)
        elif isinstance(raw, str):
            try:
                value = parse_set_value(name, raw)
            except YamlTooBig as exc:
                checked.errors.append(ValidationError(f"--set {name}: {exc.error.message}"))
                continue
        try:
            jsonschema.validate(value, _param_schema(wf.params[name]))
        except jsonschema.ValidationError as exc:
            checked.errors.append(ValidationError(f"--set {name}={one_line(raw, 80)}: {exc.message}"))
            continue
        if wf.params[name].get("format") == "path":
            value = path_from_current_dir(value, wf.directory)
        checked.params[name] = value
        checked.given.add(name)


def _check_paths(wf: Workflow, checked: Checked) -> None:
    """Before a run: every ``format: path`` param that names code to import (``file.py:callable``:
    a patch, a model) names a file: found now, not by its stage after the stages before it ran (a
    golden dump takes hours). Other paths may be where a stage writes (a dump_dir), so their stages
    say what is missing. Not for ``validate``: a recipe is checked on one machine and run where
    its files are."""
    for name, value in checked.params.items():
        if wf.params.get(name, {}).get("format") != "path" or not isinstance(value, str):
            continue
        if not is_file_ref(value):
            continue
        text, _, attr = value.rpartition(":")
        path = Path(text).expanduser()
        found = wf.directory / path  # (an absolute path, or a relative one only the workflow's folder
        # holds, kept as typed by path_from_current_dir)
        if found.is_file():
            why = file_ref_problem(found, attr)
            if why is None:
                continue
            said = f"param {name}: {value}: {why}"
        else:
            said = f"param {name}: no such file {os.path.abspath(path)}"
        about = str(wf.params[name].get("description", "")).split(";")[0].split(". ")[0][:120]
        mark = None if name in checked.given else wf.key_mark("params", name)
        checked.errors.append(ValidationError(said + (f" ({about})" if about else ""), mark))


def path_from_current_dir(value: Any, workflow_dir: Path) -> Any:
    """A ``--set`` value of a ``format: path`` param, typed in a shell, as the stage will read it
    (relative to ``workflow_dir``). A relative path means the current directory's: made absolute
    (a ``file.py:name`` reference: its file), also when nothing is there, so a missing one is
    reported where the user meant it, not inside the package a shipped workflow lies in. Kept as
    typed: a path only the workflow file's directory holds (``../plugins/x.py:f``, read as the
    YAML's values are) or that names the same file from there as from the current directory (so
    the same command gives the same value, and cache key, whichever directory it is run from), a
    name (``smollm2``, ``tiny-llama``, a mapping's) and an absolute path."""
    if not isinstance(value, str) or not value.strip():
        return value
    text, sep, attr = value.rpartition(":") if is_file_ref(value) else (value, "", "")
    path = Path(text).expanduser()
    if path.is_absolute():
        return value
    beside = workflow_dir / path
    if not path.exists() and (beside.exists() or _is_a_name(value)):
        return value
    if path.exists() and beside.exists() and _same_file(path, beside):
        return value
    return os.path.abspath(path) + sep + attr


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file or folder (False when either cannot be read)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_a_name(value: str) -> bool:
    """A model spec (``smollm2``, ``tiny-<family>[:k=v]``) or an op-mapping's entry-point name,
    or a bare word close to one: a typo the stage's own message corrects (a path would lose its
    "did you mean")."""
    if value.startswith("tiny-"):
        return True
    names = {"smollm2", *find_group("llmflow.mappings")}
    if value in names:
        return True
    bare_word = "/" not in value and "\\" not in value
    # (a high cutoff: a folder such as "llama2" is not taken for "atb-llama")
    return bare_word and bool(difflib.get_close_matches(value, names, n=1, cutoff=0.8))


def _check_stages(wf: Workflow, checked: Checked, trust_plugins: bool) -> None:
    if not wf.stages:  # (a run of nothing would pass, judging nothing)
        checked.errors.append(ValidationError(
            "the workflow has no stages: add some under 'stages:' (llmflow stages lists the types)",
            wf.key_mark("stages") or Mark(wf.display, 1, 1)))
    for sid, st in wf.stages.items():
        try:
            checked.classes[sid] = resolve_stage(st.uses, st.base_dir, trust_plugins)
        except StaticReadError as exc:
            checked.errors.append(
                ValidationError(
                    f"stage {sid!r}: {exc}; checking it would execute {file_ref_path(st.uses, st.base_dir)}:"
                    " pass --trust-plugins to import it",
                    wf.mark("stages", sid, "uses"),
                )
            )
        except UserError as exc:
            checked.errors.append(ValidationError(f"stage {sid!r}: {exc}", wf.mark("stages", sid, "uses")))
        for i, dep in enumerate(st.needs):
            if dep not in wf.stages:
                checked.errors.append(
                    ValidationError(
                        f"stage {sid!r} needs unknown stage {dep!r}{suggest(dep, wf.stages)}",
                        wf.mark("stages", sid, "needs", i),
                    )
                )
    cycle = dag.find_cycle(checked.needs)
    if cycle:
        first = wf.stages[cycle[0]].needs.index(cycle[1])
        checked.errors.append(
            ValidationError(
                f"dependency cycle: {' -> '.join(cycle)}", wf.mark("stages", cycle[0], "needs", first)
            )
        )
    else:
        checked.order = dag.topological_order(checked.needs)


def _check_refs(wf: Workflow, checked: Checked) -> None:
    for sid, st in wf.stages.items():
        for rel, text in strings(st.with_):
            if not has_refs(text):
                continue
            mark = wf.mark("stages", sid, "with", *rel)
            try:
                parts = parse(text)
            except InterpolationError as exc:
                checked.errors.append(
                    ValidationError(str(exc), mark.at_offset(text, exc.offset) if mark else None)
                )
                continue
            for ref in (p for p in parts if isinstance(p, Ref)):
                msg = _ref_problem(wf, checked, sid, ref)
                if msg:
                    checked.errors.append(
                        ValidationError(msg, mark.at_offset(text, ref.start) if mark else None)
                    )


def _ref_problem(wf: Workflow, checked: Checked, sid: str, ref: Ref) -> str | None:
    if ref.kind == "params" and ref.name not in wf.params:
        return f"{ref.text}: unknown param {ref.name!r}{suggest(ref.name, wf.params)}"
    if ref.kind != "stages":
        return None
    if ref.name not in wf.stages:
        return f"{ref.text}: unknown stage {ref.name!r}{suggest(ref.name, wf.stages)}"
    if ref.name not in wf.stages[sid].needs:
        return f"{ref.text}: stage {ref.name!r} is not in the needs of stage {sid!r} (add it to needs:)"
    cls = checked.classes.get(ref.name)
    if cls is not None and cls.outputs and ref.keys[0] not in cls.outputs:
        return (
            f"{ref.text}: stage {ref.name!r} ({cls.type or wf.stages[ref.name].uses}) has no output "
            f"{ref.keys[0]!r}{suggest(ref.keys[0], cls.outputs)}"
        )
    return None


def _static_lookup(params: dict[str, Any]):
    def lookup(ref: Ref) -> Any:
        if ref.kind == "params":
            if ref.name not in params:
                raise _Dynamic
            return params[ref.name]
        if ref.kind == "env":
            value = os.environ.get(ref.name, ref.default)
            if value is None:
                raise _Dynamic
            return value
        raise _Dynamic

    return lookup


def _static_with(value: Any, lookup, path: tuple, skip: list[tuple]) -> Any:
    """``value`` with what is known now resolved; paths of run-time values go to ``skip``."""
    if isinstance(value, dict):
        return {k: _static_with(v, lookup, (*path, k), skip) for k, v in value.items()}
    if isinstance(value, list):
        return [_static_with(v, lookup, (*path, i), skip) for i, v in enumerate(value)]
    if isinstance(value, str) and has_refs(value):
        try:
            return resolve(value, lookup)
        except (_Dynamic, InterpolationError):
            skip.append(path)
    return value


def _static_params(checked: Checked, sid: str) -> tuple[Any, list[tuple]]:
    """Stage ``sid``'s ``with:`` with what is known before the run resolved (literals,
    ``${params.X}``, set ``${env.X}``), and the paths of the values only the run knows."""
    skip: list[tuple] = []
    return _static_with(checked.workflow.stages[sid].with_, _static_lookup(checked.params), (), skip), skip


def known_params(checked: Checked, sid: str) -> dict[str, Any]:
    """The parameters of stage ``sid`` known before the run, without those other stages give
    (nor the schema's defaults)."""
    return _known(*_static_params(checked, sid))


def _known(instance: Any, skip: list[tuple]) -> dict[str, Any]:
    """The top-level parameters of a static ``with:`` that hold no run-time value."""
    if not isinstance(instance, dict):
        return {}
    dynamic = {path[0] for path in skip if path}
    return {k: v for k, v in instance.items() if k not in dynamic}


def _check_with(wf: Workflow, checked: Checked) -> None:
    for sid, st in wf.stages.items():
        cls = checked.classes.get(sid)
        if cls is None:
            continue
        instance, skip = _static_params(checked, sid)
        errors = schema_errors(cls.params_schema, instance, wf.marks, ("stages", sid, "with"), skip)
        checked.errors += errors
        if errors or not isinstance(instance, dict):
            continue
        known = _known(instance, skip)
        try:
            cls.check_values(known)
        except Exception as exc:  # (a plugin's check may raise anything: one line, never a traceback)
            said = str(exc) if isinstance(exc, UserError) else (
                f"{st.uses}: check_values raised {type(exc).__name__}: {exc}")
            key = next((k for k in known if said.startswith((f"{k}:", f"{k}.", f"{cls.type}: {k}"))), None)
            checked.errors.append(ValidationError(said, wf.mark("stages", sid, "with", *(
                (key,) if key is not None else ()))))


def check(
    wf: Workflow, set_params: SetParams = None, runtime: bool = False, trust_plugins: bool = False
) -> Checked:
    """Every static problem of ``wf``. ``runtime`` also requires a value for every param.
    ``trust_plugins`` imports ``file.py:Class`` stages; otherwise they are read statically
    (``static_stage``) and a class that cannot be read that way is a problem saying so."""
    checked = Checked(wf)
    _check_params(wf, set_params, checked)
    if runtime:
        _check_paths(wf, checked)
        for name in wf.params:
            if name not in checked.params:
                checked.errors.append(
                    ValidationError(
                        f"param {name!r} has no default: pass --set {name}=VALUE", wf.key_mark("params", name)
                    )
                )
    _check_stages(wf, checked, trust_plugins)
    _check_refs(wf, checked)
    _check_with(wf, checked)
    checked.redact = Redactor(secret_env_values(_env_refs(wf), os.environ))
    return checked


def unset_env(wf: Workflow, stage_ids: Iterable[str]) -> list[ValidationError]:
    """Each ``${env.NAME}`` without a default, in the parameters of the stages ``stage_ids`` (those
    a run will run), whose variable is not set: found before the run starts, not by its stage
    after the stages before it ran (a golden dump takes hours)."""
    errors: list[ValidationError] = []
    for sid in stage_ids:
        st = wf.stages[sid]
        for rel, text in strings(st.with_):
            if not has_refs(text):
                continue
            try:
                refs = [p for p in parse(text) if isinstance(p, Ref) and p.kind == "env"]
            except InterpolationError:
                continue  # (reported by _check_refs)
            for ref in refs:
                if ref.default is None and ref.name not in os.environ:
                    errors.append(ValidationError(
                        f"{ref.text}: environment variable {ref.name!r} is not set (give a default: "
                        f"${{env.{ref.name}:-VALUE}})", wf.mark("stages", sid, "with", *rel)))
    return errors


def _env_refs(wf: Workflow) -> list[tuple[str, str | None]]:
    """(name, default) of every ``${env.NAME}`` in the stages' parameters."""
    found = []
    for st in wf.stages.values():
        for _, text in strings(st.with_):
            if has_refs(text):
                try:
                    found += [(p.name, p.default) for p in parse(text)
                              if isinstance(p, Ref) and p.kind == "env"]
                except InterpolationError:
                    continue  # (reported by _check_refs)
    return found


def resolve_with(checked: Checked, sid: str, outputs: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """A stage's final parameters: references resolved, validated, schema defaults filled in.
    ``outputs``: stage id -> outputs of the stages it needs. Raises WorkflowError (a UserError)."""
    wf = checked.workflow
    st = wf.stages[sid]
    errors: list[ValidationError] = []

    def lookup(ref: Ref) -> Any:
        if ref.kind == "params":
            return checked.params[ref.name]
        if ref.kind == "env":
            value = os.environ.get(ref.name, ref.default)
            if value is None:
                raise UserError(
                    f"{ref.text}: environment variable {ref.name!r} is not set "
                    f"(give a default: ${{env.{ref.name}:-VALUE}})"
                )
            return value
        produced = outputs.get(ref.name, {})
        try:
            return dig(produced, ref.keys)
        except KeyError as exc:
            raise UserError(
                f"{ref.text}: stage {ref.name!r} has no output {exc.args[0]!r} "
                f"(it has: {', '.join(sorted(produced)) or 'none'})"
            ) from None

    resolved: dict[str, Any] = {}
    for key, value in st.with_.items():
        try:
            resolved[key] = resolve(value, lookup)
        except UserError as exc:
            errors.append(ValidationError(str(exc), wf.mark("stages", sid, "with", key)))
    if not errors:
        errors = schema_errors(
            checked.classes[sid].params_schema, resolved, wf.marks, ("stages", sid, "with")
        )
    if errors:
        raise WorkflowError(errors)
    return fill_defaults(checked.classes[sid].params_schema, resolved)
