"""What a stage type is, and what the runner hands it.

A stage type is a subclass of ``Stage`` registered in the ``llmflow.stages`` entry-point group
(built-in ones too, see pyproject.toml) or referenced from a workflow as ``file.py:ClassName``.
The runner resolves the stage's parameters, validates them against ``params_schema``, creates a
temporary output directory, calls ``run(ctx)``, and moves the directory into place only if
``run`` returns. Anything a stage wants later stages to read goes into the returned outputs dict;
anything it wants in ``<run-dir>/summary.json`` goes into ``ctx.summary``.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from llmflow.redaction import Redactor

#: What a stage can conclude about the target, least severe first: "pass" (it matches),
#: "inconclusive" (the evidence does not cover the question), "fail" (a fault found, rows failed).
#: The run's exit code comes from the outcomes of the stages no later outcome-setting stage
#: needs: fail -> 1, inconclusive -> 3, pass -> 0 (see ``llmflow.errors``).
OUTCOMES = ("pass", "inconclusive", "fail")


@dataclass
class Outcome:
    """A stage's conclusion: ``status`` in OUTCOMES, a one-line ``headline`` for the last line and,
    for an inconclusive one, ``next``: what to run to get the evidence that is missing."""

    status: str
    headline: str
    next: str = ""

    def __post_init__(self) -> None:
        if self.status not in OUTCOMES:
            raise ValueError(f"outcome status {self.status!r} is not one of {OUTCOMES}")


class ChildCrashed(RuntimeError):
    """A process the stage ran (the dump worker) crashed. ``details`` is that process's own output
    (its traceback), shown in place of the stage's traceback, which only says it waited."""

    def __init__(self, message: str, details: str):
        super().__init__(message)
        self.details = details


class ProgressTask(Protocol):
    """A progress bar owned by one stage: ``advance`` it, or ``update`` its total/description."""

    def advance(self, n: float = 1) -> None: ...

    def update(self, *, total: float | None = None, completed: float | None = None,
               description: str | None = None) -> None: ...


@dataclass
class StageContext:
    """Everything a running stage may touch.

    ``out_dir`` is a fresh temporary directory; write every file there. String outputs that point
    inside ``out_dir`` are rewritten by the runner to the stage's final directory, so return
    ``str(ctx.out_dir / "dump")`` and later stages receive the final path.
    """

    stage_id: str
    params: dict[str, Any]
    out_dir: Path
    final_dir: Path
    run_dir: Path
    workflow_dir: Path
    inputs: dict[str, dict[str, Any]]
    #: where the runner keeps ``out_dir`` when the stage fails (for messages naming its files)
    failed_dir: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = print
    progress: Callable[..., ProgressTask] | None = None
    outcome: Outcome | None = None
    #: apply to what the stage writes for people to read (``llmflow.redaction``): it knows the
    #: secret values among ``params`` (from ``${env.X}`` with a secret name X)
    redact: Redactor = field(default_factory=Redactor)

    def set_outcome(self, status: str, headline: str, next_step: str = "") -> None:
        """Say what this stage concluded about the target (see ``OUTCOMES``) and, when the evidence
        falls short, what to run next; stages that only produce data (dumps, reports) set none."""
        self.outcome = Outcome(status, headline, next_step)

    def resolve_path(self, value: str | Path) -> Path:
        """A user-given path, relative to the workflow file's directory."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else (self.workflow_dir / p)

    def task(self, description: str, total: float | None = None) -> ProgressTask:
        """A progress bar for long work; a no-op when the runner shows no progress."""
        if self.progress is None:
            return _NullTask()
        return self.progress(description=description, total=total)


class _NullTask:
    def advance(self, n: float = 1) -> None:
        pass

    def update(self, *, total: float | None = None, completed: float | None = None,
               description: str | None = None) -> None:
        pass


class Stage(ABC):
    """Base class of every stage type. The class docstring's first line is its one-line help.

    Class attributes:
      type: the name workflows use in ``uses:``.
      version: bump when the stage's results change for the same parameters (invalidates caches).
      params_schema: a JSON Schema (draft-07) ``object`` schema of the parameters, with defaults,
        ``additionalProperties: false``, and a ``description`` on each property.
      outputs: output name -> one-line description.
      writes_to: parameters that name where the stage writes outside its own folder (the dump
        stage's ``dump_dir``): not inputs, so the cache does not fingerprint what is there.
    """

    type: ClassVar[str] = ""
    version: ClassVar[str] = "1"
    params_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {},
                                               "additionalProperties": False}
    outputs: ClassVar[dict[str, str]] = {}
    writes_to: ClassVar[tuple[str, ...]] = ()

    def resources(self, params: dict[str, Any]) -> set[str]:
        """Exclusive resources held while running (e.g. ``{"device:cuda:0"}``): stages sharing
        one never run at the same time."""
        return set()

    @classmethod
    def check_values(cls, params: dict[str, Any]) -> None:
        """Refuse parameter values the schema cannot judge (a UserError whose message starts with
        the parameter's name). ``params``: the values known before the run (literals,
        ``${params.X}``, ``${env.X}``), schema-valid, without defaults filled in and without those
        other stages give. ``llmflow validate`` and ``run`` call it before any stage runs, so a bad
        limit surfaces before the hours of dumping ahead of it. Default: nothing to refuse."""
        return None

    @abstractmethod
    def run(self, ctx: StageContext) -> dict[str, Any]:
        """Do the work, write files under ``ctx.out_dir``, return the outputs (JSON values)."""

    def params(self, ctx: StageContext) -> dict[str, Any]:
        """The stage's parameters with the schema's defaults: the workflow runner has filled them
        already; a stage run as a library call gets them from the same declaration. A property
        without a default and not given reads None."""
        filled = fill_defaults(self.params_schema, ctx.params)
        return {**{name: None for name in self.params_schema.get("properties", {})}, **filled}

    @classmethod
    def doc(cls) -> str:
        """The one-line help: the first line of the class docstring."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""


def fill_defaults(schema: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``params`` plus the schema's top-level defaults for the keys it lacks."""
    out = dict(params)
    for name, prop in schema.get("properties", {}).items():
        if name not in out and isinstance(prop, dict) and "default" in prop:
            out[name] = copy.deepcopy(prop["default"])
    return out
