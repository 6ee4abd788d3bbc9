"""Stage types: the registered ones (entry-point group ``llmflow.stages``) and ``file.py:Class`` refs.

Registered stage types are *found* from package metadata without importing anything, so a broken
stage module only breaks the workflows (and the ``llmflow stages`` line) that use it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from llmflow import plugins
from llmflow.errors import UserError
from llmflow.stages.base import Stage

GROUP = "llmflow.stages"


def registered_names() -> list[str]:
    """Names of every registered stage type, sorted; imports nothing."""
    return sorted(plugins.find_group(GROUP))


def is_file_ref(uses: str) -> bool:
    """True when ``uses`` names a class in a Python file (``path/file.py:ClassName``)."""
    return plugins.is_file_ref(uses)


def resolve_stage(uses: str, base_dir: Path) -> type[Stage]:
    """The Stage subclass named by ``uses``; a UserError says what is wrong (with a suggestion)."""
    if is_file_ref(uses):
        obj = plugins.load_file_ref(uses, base_dir)
    else:
        found = plugins.find_group(GROUP)
        if uses not in found:
            raise UserError(f"unknown stage type {uses!r}{plugins.suggest(uses, found)}")
        obj = found[uses].load()
    if not (isinstance(obj, type) and issubclass(obj, Stage)):
        raise UserError(f"{uses!r} is not a llmflow.stages.base.Stage subclass")
    return obj


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
        path = Path(uses.rpartition(":")[0]).expanduser()
        path = path if path.is_absolute() else base_dir / path
        ident += "#" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return ident
