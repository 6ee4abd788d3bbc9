"""Where the files shipped with llmflow are: the workflows (with their recipes), plugins and schemas.

In the repository they are the top-level folders ``workflows/``, ``plugins/`` and ``schemas/``
beside the package. A built wheel carries the same folders as ``llmflow/_shipped/<folder>/``
(pyproject.toml's ``package-dir`` maps each top-level folder there: one copy of every file).
Either way the folders keep their layout, so the relative paths inside a shipped workflow
(``extends: recipes/bisect_base.yaml``, ``../plugins/example_faults.py:...``) resolve as in the repo.

``resolve_workflow`` turns the WORKFLOW argument of ``llmflow run/plan/validate`` into a file:

* an existing file: itself;
* a bare name (``llama2_bisect``: no slash, no .yaml): the shipped workflow of that name;
* a relative path that is not here but is in the shipped tree (``workflows/llama2_bisect.yaml``
  typed outside a checkout): the shipped file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from llmflow.errors import UserError

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parent
_WHEEL_ROOT = _PACKAGE / "_shipped"  # only in an installed wheel (see the module docstring)
WORKFLOW_SUFFIXES = (".yaml", ".yml")


def shipped_root() -> Path:
    """The folder holding ``workflows/``, ``plugins/`` and ``schemas/``: the package's ``_shipped``
    in an installed wheel, else the source checkout the package is imported from."""
    return _WHEEL_ROOT if _WHEEL_ROOT.is_dir() else _PACKAGE.parent


def workflows_dir() -> Path:
    """The shipped ``workflows/`` folder."""
    return shipped_root() / "workflows"


def plugins_dir() -> Path:
    """The shipped ``plugins/`` folder (example stages, algorithms and injected faults)."""
    return shipped_root() / "plugins"


def schemas_dir() -> Path:
    """The shipped ``schemas/`` folder (workflow, summary and mapping JSON Schemas)."""
    return shipped_root() / "schemas"


@dataclass(frozen=True)
class ShippedWorkflow:
    """One workflow of ``workflows/``: the name ``llmflow run NAME`` takes, its file, its description."""

    name: str
    path: Path
    description: str


def shipped_workflows() -> list[ShippedWorkflow]:
    """The runnable workflows shipped with llmflow (``workflows/*.yaml``; recipes, which are meant
    to be extended, are not listed), sorted by name."""
    import yaml

    found = []
    for path in sorted(workflows_dir().glob("*.y*ml")):
        if path.suffix not in WORKFLOW_SUFFIXES:
            continue
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            data = None
        description = data.get("description", "") if isinstance(data, dict) else ""
        found.append(ShippedWorkflow(path.stem, path, str(description)))
    return found


def is_bare_name(arg: str) -> bool:
    """``llama2_bisect``: no folder part and no YAML suffix."""
    return "/" not in arg and "\\" not in arg and not arg.endswith(WORKFLOW_SUFFIXES)


def resolve_workflow(arg: str) -> str:
    """The workflow file ``arg`` names (see the module docstring); UserError for a bare name that
    is neither a file here nor a shipped workflow. Any other path is returned as given, so the
    loader reports a missing file in its own words."""
    if Path(arg).expanduser().is_file():
        return arg
    root = shipped_root()
    if is_bare_name(arg):
        for suffix in WORKFLOW_SUFFIXES:
            candidate = workflows_dir() / f"{arg}{suffix}"
            if candidate.is_file():
                log.info("workflow %r: the shipped %s", arg, candidate)
                return str(candidate)
        names = ", ".join(w.name for w in shipped_workflows()) or "none"
        raise UserError(f"workflow {arg!r}: no such file here, and no shipped workflow of that name "
                        f"(shipped: {names}; `llmflow workflows` lists them)")
    rel = Path(arg)
    if not rel.is_absolute():
        candidate = (root / rel).resolve()
        if candidate.is_file() and candidate.is_relative_to(root.resolve()):
            log.info("workflow %r: not here, using the shipped %s", arg, candidate)
            return str(candidate)
    return arg
