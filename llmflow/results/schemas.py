"""The JSON schemas of the result files, generated from their types (committed under ``schemas/``;
``llmflow schema --kind KIND -o FILE`` writes one)."""

from __future__ import annotations

from typing import Any

from llmflow.results.codec import json_schema
from llmflow.results.verdict import Verdict


def verdict_schema() -> dict[str, Any]:
    """``schemas/verdict.schema.json``: the bisect stage's verdict.json."""
    return json_schema(Verdict, title="llmflow bisect verdict")  # (described by Verdict's docstring)
