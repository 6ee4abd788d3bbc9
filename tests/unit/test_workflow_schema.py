"""The workflow JSON Schema: valid draft-07, accepts shipped workflows, committed file up to date."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import yaml

from llmflow.stages.seed import SeedStage
from llmflow.workflow.registry import load_registered
from llmflow.workflow.schema import generate, structural_schema, workflow_schema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO  # noqa: E402


def test_schemas_are_valid_draft7():
    jsonschema.Draft7Validator.check_schema(structural_schema())
    jsonschema.Draft7Validator.check_schema(workflow_schema({"seed": SeedStage}))
    jsonschema.Draft7Validator.check_schema(
        json.loads((REPO / "schemas" / "summary.schema.json").read_text())
    )


def test_editor_schema_checks_with_per_stage_type():
    v = jsonschema.Draft7Validator(workflow_schema({"seed": SeedStage}))
    doc = yaml.safe_load((REPO / "workflows" / "hello.yaml").read_text())
    assert list(v.iter_errors(doc)) == []
    doc["stages"]["seed"]["with"]["seed"] = "abc"  # neither an integer nor a whole ${...}
    assert len(list(v.iter_errors(doc))) == 1
    doc["stages"]["seed"]["with"] = {"sed": 1}
    assert any("sed" in e.message for e in v.iter_errors(doc))
    doc["stages"]["seed"] = {"uses": "x.py:Mine", "with": {"anything": 1}}  # file refs stay open
    assert list(v.iter_errors(doc)) == []
    doc["stages"]["seed"]["uses"] = "nope"
    assert list(v.iter_errors(doc))


def test_committed_schema_is_generated():
    """schemas/workflow.schema.json == `llmflow schema` output; a built-in stage type that cannot be
    imported fails here (skipping would hide exactly the case where the committed schema is stale)."""
    ok, failed = load_registered()
    assert not failed, f"stage types that do not import: {failed}"
    assert (REPO / "schemas" / "workflow.schema.json").read_text() == generate()
