"""Workflows: load YAML (with marks), validate, plan and run a DAG of stages.

The library API that the CLI commands are thin adapters over::

    from llmflow.workflow import load_workflow, validate_workflow, plan_workflow, run_workflow

    errors = validate_workflow("workflows/hello.yaml")          # [] when valid
    result = run_workflow("workflows/hello.yaml", set_params={"seed": 7}, run_dir="runs/x")
    result.status, result.exit_code, result.stages["seed"].outputs

Modules: marks (bounded YAML + FILE:LINE:COL), loader (include/extends), schema (JSON Schema),
validate (static checks, run-time parameter resolution), registry and static_stage (stage types;
local plugins read without running them), interpolate (``${...}``), dag, plan (cache decisions),
runner, rundir (the run dir on disk: lock, tmp, never following links), state (stage state files:
fingerprints, portable paths, file manifests), conclusion (stage outcomes -> the run's verdict),
result, summary (summary.json), progress (display).
"""

from __future__ import annotations

from pathlib import Path

from llmflow.errors import UserError
from llmflow.workflow.loader import load_workflow
from llmflow.workflow.marks import Mark, ValidationError, WorkflowError
from llmflow.workflow.model import StageSpec, Workflow
from llmflow.workflow.plan import PlanItem, plan_workflow
from llmflow.workflow.result import RunResult, StageResult
from llmflow.workflow.runner import run_workflow
from llmflow.workflow.validate import SetParams, check

__all__ = [
    "Mark",
    "PlanItem",
    "RunResult",
    "StageResult",
    "StageSpec",
    "ValidationError",
    "Workflow",
    "WorkflowError",
    "load_workflow",
    "plan_workflow",
    "run_workflow",
    "validate_workflow",
]


def params_to_set(path: str | Path, set_params: SetParams = None) -> list[str]:
    """The params of a valid workflow that have no default and no ``--set`` value: what a run of
    it must be given (validating checks the file, a run needs the values)."""
    from llmflow.workflow.validate import parse_set

    wf = load_workflow(path)
    given = set(parse_set(set_params))
    return [name for name, spec in wf.params.items() if "default" not in spec and name not in given]


def validate_workflow(
    path: str | Path, set_params: SetParams = None, trust_plugins: bool = False
) -> list[ValidationError]:
    """Every problem of a workflow file (and its recipes), in file order; [] when it is valid.
    Executes nothing: ``file.py:Class`` stages are read, not imported, unless ``trust_plugins``."""
    try:
        wf = load_workflow(path)
    except WorkflowError as exc:
        return exc.errors
    try:
        errors = check(wf, set_params, trust_plugins=trust_plugins).errors
    except UserError as exc:  # a malformed --set item
        return [ValidationError(str(exc))]
    return sorted(
        errors,
        key=lambda e: (
            e.mark is not None,
            e.mark.file if e.mark else "",
            e.mark.line if e.mark else 0,
            e.mark.col if e.mark else 0,
        ),
    )
