"""Stage types: the registered ones (entry-point group ``llmflow.stages``) and ``file.py:Class`` refs.

Registered stage types are *found* from package metadata without importing anything, so a broken
stage module only breaks the workflows (and the ``llmflow stages`` line) that use it. They are
installed code and are imported when used. A ``file.py:Class`` ref is imported only when trusted
(``llmflow run``, or ``--trust-plugins``); otherwise its declarations are read statically
(static_stage.py) and nothing in the file runs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmflow import plugins
from llmflow.errors import UserError
from llmflow.stages.base import Stage
from llmflow.workflow.interpolate import strings
from llmflow.workflow.static_stage import read_stage_class

GROUP = "llmflow.stages"


def registered_names() -> list[str]:
    """Names of every registered stage type, sorted; imports nothing."""
    return sorted(plugins.find_group(GROUP))


def is_file_ref(uses: str) -> bool:
    """True when ``uses`` names a class in a Python file (``path/file.py:ClassName``)."""
    return plugins.is_file_ref(uses)


def file_ref_path(ref: str, base_dir: Path) -> Path:
    """The file a ``file.py:name`` ref names, relative to ``base_dir``."""
    path = Path(ref.rpartition(":")[0]).expanduser()
    return path if path.is_absolute() else base_dir / path


def resolve_stage(uses: str, base_dir: Path, trust_plugins: bool = True) -> type[Stage]:
    """The Stage subclass named by ``uses``; a UserError says what is wrong (with a suggestion).
    Without ``trust_plugins`` a ``file.py:Class`` is read, not imported (see module docstring)."""
    if is_file_ref(uses):
        if not trust_plugins:
            path = file_ref_path(uses, base_dir)
            if not path.is_file():
                raise UserError(f"{uses}: no such file {path}")
            return _schema_checked(read_stage_class(path, uses.rpartition(":")[2], uses), uses)
        try:
            obj = plugins.load_file_ref(uses, base_dir)
        except SystemExit as exc:  # the plugin's import-time code exited: its failure, not ours
            raise UserError(f"{uses}: importing it called sys.exit({exc.code!r})") from None
    else:
        found = plugins.find_group(GROUP)
        if uses not in found:
            raise UserError(f"unknown stage type {uses!r}{plugins.suggest(uses, found)}")
        obj = found[uses].load()
    if not (isinstance(obj, type) and issubclass(obj, Stage)):
        raise UserError(f"{uses!r} is not a llmflow.stages.base.Stage subclass")
    return _schema_checked(obj, uses)


def _schema_checked(cls: type[Stage], uses: str) -> type[Stage]:
    """``cls`` once its ``params_schema`` is a JSON Schema (draft-07) whose defaults it accepts: a
    plugin's typo (``"type": "strin"``, a ``pattern`` that is no regex) is a UserError naming the
    stage and the keyword, not a traceback from the first parameter checked against it."""
    import jsonschema

    schema = getattr(cls, "params_schema", None)
    if not isinstance(schema, dict):
        raise UserError(f"{uses}: params_schema is not a mapping (a JSON Schema object), got {schema!r:.80}")
    plain = _as_json(schema)  # (a tuple is a list to JSON: ``"type": ("string", "null")`` is valid)
    meta = jsonschema.Draft7Validator(jsonschema.Draft7Validator.META_SCHEMA,
                                      format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    bad = next(iter(sorted(meta.iter_errors(plain), key=lambda e: list(map(str, e.absolute_path)))), None)
    if bad is not None:
        where = ".".join(map(str, bad.absolute_path)) or "the schema itself"
        raise UserError(f"{uses}: params_schema is not a valid JSON Schema at {where}: {bad.message}")
    props = plain.get("properties") if isinstance(plain.get("properties"), dict) else {}
    # the defaults given (a None default: "not given", as Stage.params fills it) checked against the
    # whole schema, so a ``$ref`` resolves; only errors at a default's own parameter count
    defaults = {name: prop["default"] for name, prop in props.items()
                if isinstance(prop, dict) and prop.get("default") is not None}
    try:
        wrong = next((e for e in jsonschema.Draft7Validator(plain).iter_errors(defaults)
                      if e.absolute_path and e.absolute_path[0] in defaults), None)
    except jsonschema.exceptions.SchemaError:
        wrong = None
    except Exception as exc:  # (a reference that resolves nowhere): said, not a traceback
        raise UserError(f"{uses}: params_schema cannot be applied to its defaults: "
                        f"{type(exc).__name__}: {exc}") from None
    if wrong is not None:
        raise UserError(f"{uses}: params_schema.properties.{wrong.absolute_path[0]}.default: {wrong.message}")
    return cls


def _as_json(value: Any) -> Any:
    """``value`` with tuples as lists, as JSON would read it back."""
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    return value


def load_registered() -> tuple[dict[str, type[Stage]], dict[str, str]]:
    """(name -> class, name -> import error) for every registered stage type."""
    ok: dict[str, type[Stage]] = {}
    failed: dict[str, str] = {}
    for name in registered_names():
        try:
            ok[name] = resolve_stage(name, Path("."))
        except UserError as exc:
            failed[name] = str(exc)
    return ok, failed


def stage_identity(uses: str, cls: type[Stage], base_dir: Path) -> str:
    """What a stage's fingerprint records about its code: the type name and version, plus the
    file's content hash for ``file.py:Class`` refs (editing a local plugin invalidates its cache)."""
    ident = f"{uses}@{cls.version}"
    if is_file_ref(uses):
        ident += "#" + plugins.code_hash(file_ref_path(uses, base_dir))
    return ident


def referenced_code(params: Any, dirs: Iterable[Path]) -> dict[str, str]:
    """``file.py:name`` -> content hash for every parameter string that names code in a file
    (a model patch, a ``file.py:callable`` model, an algorithm), found relative to the first of
    ``dirs`` that has it. Editing such a file changes the stage's fingerprint. A ref to a file
    that does not exist is left to the stage to report."""
    out: dict[str, str] = {}
    dirs = list(dirs)
    for _, text in strings(params):
        if not is_file_ref(text) or text in out:
            continue
        for base in dirs:
            path = file_ref_path(text, base)
            try:
                if path.is_file():
                    out[text] = plugins.code_hash(path)
                    break
            except OSError:
                break
    return out


#: files of one input folder looked at for its fingerprint (a dump of a 70B model holds a few thousand)
MAX_INPUT_FILES = 200_000
INPUT_PREFIX = "input:"


def referenced_inputs(params: Any, dirs: Iterable[Path], run_dir: Path, writes_to: Iterable[str] = (),
                      stages: Iterable[str] = (), typed: dict[str, str] | None = None,
                      cwd: Path | None = None, schema: dict[str, Any] | None = None,
                      any_word: bool = False) -> dict[str, str]:
    """``input:<path>`` -> a hash of the name, size and modification time of every file at each
    parameter string that names an existing file or folder (a dump, a checkpoint, a mapping file),
    found as ``referenced_code`` finds code: a dump written again in place changes the stage's
    fingerprint, so a stage that read the old one runs again. ``<path>`` is the resolved absolute
    path, so the same file reached by another spelling (from another current directory) is the
    same input. (Outputs in the run dir's folders of ``stages`` are covered by the fingerprints of
    the stages that made them; the run dir itself or a folder holding it is not an input, nor a
    parameter in ``writes_to``: where the stage writes, ``Stage.writes_to``. Anything else in the
    run dir, a dump the user keeps in an adopted folder, is an input like any other.) ``typed``,
    when given, gets each key's path as the parameter spells it, for messages.

    A string is looked up in ``dirs`` (the workflow's folders), then in ``cwd`` only where it is
    written as a path (a separator, a leading ``.`` or ``~``, a suffix): the built-in stages read a
    relative path from the workflow's folder, so a bare word (``cpu``, ``all``, ``module``) is a
    value to them, and a folder of that name where the user happens to run from must not change
    the stage's key. ``any_word``: every string in ``cwd`` too (a plugin's stage may open a bare
    name from the current directory). Nor is a value the stage's ``schema`` enumerates for its
    parameter (``mode: module``) an input, wherever a folder of that name lies."""
    out: dict[str, str] = {}
    dirs = list(dirs)
    inside = run_dir.resolve()
    own = [inside / sid for sid in stages]
    destinations = set(writes_to)
    props = (schema or {}).get("properties")
    props = props if isinstance(props, dict) else {}
    for at, text in strings(params):
        if (at and at[0] in destinations) or not text or "\n" in text or len(text) > 4096:
            continue
        prop = props.get(at[0]) if at else None
        if is_file_ref(text) or (isinstance(prop, dict) and text in (prop.get("enum") or ())):
            continue
        for base in dirs + ([cwd] if cwd is not None and (any_word or _written_as_path(text)) else []):
            path = Path(text) if os.path.isabs(text) else base / text
            try:
                if not path.exists():
                    continue
                where = path.resolve()
                if where == inside or where in inside.parents or any(
                        where == folder or folder in where.parents for folder in own):
                    break  # (the run dir, holding it, or in a stage's folder: llmflow's own files)
                key = INPUT_PREFIX + str(where)
                if key not in out:
                    out[key] = listing_hash(where)
                    if typed is not None:
                        typed[key] = text
            except (OSError, ValueError):
                pass
            break
    return out


def _written_as_path(text: str) -> bool:
    """Whether ``text`` is written as a path (``./x``, ``dumps/golden``, ``~/m``, ``map.json``), not
    as a bare word that a folder of the same name would happen to match."""
    return "/" in text or os.sep in text or text.startswith((".", "~")) or bool(Path(text).suffix)


def listing_hash(path: Path) -> str:
    """A hash of the name, size and modification time of every file at ``path`` (a file or a
    folder, walked in order; at most ``MAX_INPUT_FILES`` files)."""
    h = hashlib.sha256()
    if path.is_file():
        st = path.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()
    seen = 0
    for root, folders, files in os.walk(path):
        folders.sort()
        for name in sorted(files):
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            where = os.path.relpath(os.path.join(root, name), path)
            h.update(f"{where}\0{st.st_size}:{st.st_mtime_ns}\n".encode())
            seen += 1
            if seen >= MAX_INPUT_FILES:
                return h.hexdigest()
    return h.hexdigest()


def written_outside(params: dict[str, Any], writes_to: Iterable[str], base: Path,
                    run_dir: Path) -> dict[str, str]:
    """The folders a stage wrote outside the run dir (its ``writes_to`` parameters, relative to
    ``base``) -> ``listing_hash`` of each as it is now: what a cached stage's result rests on there
    (a dump written into the user's ``dump_dir``), checked again before the result is reused."""
    out: dict[str, str] = {}
    inside = run_dir.resolve()
    for name in writes_to:
        value = params.get(name)
        if not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        where = (path if path.is_absolute() else base / path).resolve()
        if where == inside or inside in where.parents or not where.exists():
            continue
        out[str(where)] = listing_hash(where)
    return out
