"""Every extension point of llmflow, in one place.

Entry-point groups (declare them in your package's pyproject.toml):

=====================  ==========================================================  ==========================
group                  what the entry point names                                  used by
=====================  ==========================================================  ==========================
``llmflow.stages``     a ``llmflow.stages.base.Stage`` subclass                    workflows (``uses:``)
``llmflow.algorithms`` ``func(golden, target) -> (value, message)``                compare (extra columns)
``llmflow.formats``    a ``llmflow.formats.base.DumpReader`` subclass              every dump consumer
``llmflow.mappings``   a callable returning the path of an op-mapping YAML/JSON     compare (``mapping:``)
``llmflow.references`` ``func(*op_args, **op_kwargs) -> output``: an op's CPU      precheck (APIs the CPU
                       reference, named by the API it replays (``npu_rms_norm``)   lacks: checks/references)
=====================  ==========================================================  ==========================

Local one-off plugins are referenced as ``path/to/file.py:name`` (relative to the workflow file
or the current directory): stages in ``uses:``, algorithms in ``algorithms:``/``-alg``, model
patches in ``patch:``, models in ``model:``, op references in ``--reference NAME=file.py:func``.

Plugins are *found* first (entry-point metadata only, no import), then *imported* on use; an
import error names the plugin, its group and the distribution that declared it. A plugin that
fails to import stops only what needs it: ``load_group`` (every dump format, tried in turn by
format detection) leaves it out with one warning naming it, and asking for it by name
(``load_plugin``, ``open_dump(format=...)``) gives its import error. The same name
declared twice (an editable install beside a stale egg-info, two packages) is an error that names
both sources. llmflow's own plugins are declared the same way, in its pyproject.toml; run from a
source checkout that was never installed (``PYTHONPATH=path/to/llmflow``), they are read from
that file, so the checkout still knows its formats and stages.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from llmflow.errors import UserError

log = logging.getLogger("llmflow.plugins")

GROUPS = ("llmflow.stages", "llmflow.algorithms", "llmflow.formats", "llmflow.mappings", "llmflow.references")


@dataclass(frozen=True)
class PluginRef:
    """A plugin found but not yet imported."""

    group: str
    name: str
    target: str  # "module:attr"
    source: str  # the distribution (and version) that declared it

    def load(self) -> Any:
        module_name, _, attr = self.target.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in attr.split(".") if attr else []:
                obj = getattr(obj, part)
        except (Exception, SystemExit) as exc:  # any import-time failure is the plugin's, named as such
            raise UserError(
                f"plugin {self.name!r} ({self.group}, from {self.source}) failed to import "
                f"{self.target}: {type(exc).__name__}: {exc}"
            ) from exc
        return obj


@cache
def find_group(group: str) -> dict[str, PluginRef]:
    """Name -> PluginRef for one group, from installed distributions' metadata (and llmflow's own
    pyproject.toml where llmflow runs uninstalled). Imports nothing."""
    found: dict[str, PluginRef] = {}
    declared: list[tuple[str, str, str]] = []  # (name, "module:attr", source)
    for ep in entry_points(group=group):
        dist = getattr(ep, "dist", None)
        source = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
        if dist is not None and getattr(dist, "_path", None) is not None:
            source += f" at {dist._path}"
        declared.append((ep.name, ep.value, source))
    if not any(source.split(" ")[0] == "llmflow" for _, _, source in declared):
        declared += _checkout_entry_points(group)
    for name, target, source in declared:
        ref = PluginRef(group, name, target.replace(" ", ""), source)
        old = found.get(name)
        if old is not None:
            if old.target == ref.target and old.source.split(" at ")[0] == ref.source.split(" at ")[0]:
                # the same distribution seen twice on sys.path (editable install + stale egg-info)
                if old.source != ref.source:
                    raise UserError(
                        f"plugin {name!r} ({group}) is registered twice: by {old.source} and by "
                        f"{ref.source}; remove the stale install (often a leftover *.egg-info)"
                    )
                continue
            raise UserError(
                f"plugin {name!r} ({group}) is registered twice: {old.target} by {old.source} "
                f"and {ref.target} by {ref.source}"
            )
        found[name] = ref
    return found


def _checkout_entry_points(group: str) -> list[tuple[str, str, str]]:
    """llmflow's own entry points of ``group`` from the pyproject.toml beside the package, when
    llmflow runs from a source checkout that no installed distribution declares."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        import tomllib
    except ImportError:  # Python 3.10: install llmflow (pip install -e .) to use a checkout
        return []
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, ValueError):
        return []
    if project.get("name") != "llmflow":
        return []
    source = f"llmflow source checkout at {pyproject.parent}"
    return [(name, target, source) for name, target in project.get("entry-points", {}).get(group, {}).items()]


#: (group, name) -> the import error of a plugin ``load_group`` left out (each warned about once)
_BROKEN: dict[tuple[str, str], str] = {}


def load_group(group: str) -> dict[str, Any]:
    """Name -> imported object for every plugin of a group that imports. One that fails is left
    out with a warning naming it (once a process): a broken third-party format must not stop a
    compare of two dumps that other readers read. ``broken_plugins`` says which were left out."""
    loaded: dict[str, Any] = {}
    for name, ref in find_group(group).items():
        try:
            loaded[name] = ref.load()
        except UserError as exc:
            if (group, name) not in _BROKEN:
                log.warning("%s; left out (only what needs this plugin fails)", exc)
            _BROKEN[(group, name)] = str(exc)
    return loaded


def broken_plugins(group: str) -> dict[str, str]:
    """Name -> import error of the plugins of ``group`` that ``load_group`` left out so far."""
    return {name: why for (g, name), why in _BROKEN.items() if g == group}


def load_plugin(group: str, name: str) -> Any:
    """One named plugin of a group, imported; a UserError suggests the nearest names."""
    refs = find_group(group)
    if name not in refs:
        raise UserError(f"unknown {group.split('.')[-1][:-1]} {name!r}{suggest(name, refs)}")
    return refs[name].load()


def is_file_ref(ref: str) -> bool:
    """True for ``path/to/file.py:name`` references."""
    path, sep, attr = ref.rpartition(":")
    return bool(sep) and path.endswith(".py") and attr.isidentifier()


def file_ref_problem(path: Path, attr: str) -> str | None:
    """Why ``path`` cannot give ``attr`` as ``load_file_ref`` would import it, read without running
    it (its syntax tree): it does not parse, or defines no such name at its top level; None where it
    may (a name defined, assigned or imported there, or a module ``__getattr__``, ``*`` import,
    ``globals()`` or ``exec`` that can make any name). Lets a run refuse a misspelt callable before
    hours of dumping."""
    import ast

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        return f"{path.name} does not parse: line {exc.lineno}: {exc.msg}"
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{path.name} cannot be read: {exc}"
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        else:  # assignments, definitions and imports, also inside if/try at the top level
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
                elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    if any(alias.name == "*" for alias in sub.names):
                        return None
                    names.update(alias.asname or alias.name.split(".")[0] for alias in sub.names)
    dynamic = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("globals", "exec") for n in ast.walk(tree))  # (names made at run
    if attr in names or "__getattr__" in names or dynamic:  # time: only importing it can tell)
        return None
    import difflib

    close = difflib.get_close_matches(attr, sorted(names), n=1)
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    listed = ", ".join(functions[:8]) + (", ..." if len(functions) > 8 else "")
    hint = f" (did you mean {close[0]!r}?)" if close else f" (its functions: {listed})" if functions else ""
    return f"{path.name} defines no {attr!r}{hint}"


_IMPORTED: dict[str, str] = {}  # resolved path of a file imported by ``load_file_ref`` -> its source_hash


def source_hash(source: bytes) -> str:
    """The content hash a workflow's cache records for a code file."""
    return hashlib.sha256(source).hexdigest()[:16]


def code_hash(path: Path) -> str:
    """The hash of the code this process runs from ``path``: as imported where ``load_file_ref``
    imported it (an edit since does not run here), else the file's content now."""
    return _IMPORTED.get(str(path.resolve())) or source_hash(path.read_bytes())


def forget_edited() -> None:
    """Drop the imports of ``file.py`` plugins edited since ``load_file_ref`` imported them, so
    the next load imports the file as it is now. Called as a run or a plan begins (a notebook's
    second run picks up the edit), never during one: inside a run every stage runs, and is keyed
    by, the code imported first."""
    for resolved, imported in list(_IMPORTED.items()):
        try:
            now = source_hash(Path(resolved).read_bytes())
        except OSError:
            now = None
        if now != imported:
            del _IMPORTED[resolved]
            sys.modules.pop(_module_name(resolved), None)


def _module_name(resolved: str) -> str:
    return f"llmflow_local_{abs(hash(resolved))}"


def load_file_ref(ref: str, base_dir: str | Path = ".") -> Any:
    """Import ``name`` from ``path/to/file.py`` (relative to ``base_dir``)."""
    path_s, _, attr = ref.rpartition(":")
    path = Path(path_s).expanduser()
    if not path.is_absolute():
        path = Path(base_dir) / path
    if not path.is_file():
        raise UserError(f"{ref}: no such file {path}")
    resolved = str(path.resolve())
    mod_name = _module_name(resolved)
    if mod_name in sys.modules:
        module = sys.modules[mod_name]
    else:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise UserError(f"{ref}: cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            # the bytes hashed are the bytes run: a file edited while a run goes on is keyed in the
            # cache by the code this process runs, not by what the file holds by then
            source = path.read_bytes()
            exec(compile(source, str(path), "exec"), module.__dict__)
        except Exception as exc:
            del sys.modules[mod_name]
            raise UserError(f"{ref}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
        _IMPORTED[resolved] = source_hash(source)
    if not hasattr(module, attr):
        raise UserError(f"{ref}: {path.name} defines no {attr!r}")
    return getattr(module, attr)


def suggest(name: str, known: Any) -> str:
    """`` (did you mean 'x'?)`` for the nearest known name, or the list of known names."""
    import difflib

    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (known: {', '.join(names)})" if names else ""
