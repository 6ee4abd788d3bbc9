"""The JSON schemas of the result files, generated from their types (``codec.json_schema``);
``llmflow schema --kind KIND -o FILE`` writes one, ``schemas/`` holds the committed copies."""

from __future__ import annotations

from typing import Any

from llmflow.results.codec import json_schema
from llmflow.results.summary import RunSummary
from llmflow.results.verdict import Verdict

OTHER_STAGE_BLOCKS = ("Blocks other stages add: a dump stage's under its stage id ({\"dump\": {bytes, "
                      "entries, steps, text, truncated}}: llmflow.results.checks.DumpStageBlock), a plugin "
                      "stage's under the key it chose (free JSON).")


def summary_schema() -> dict[str, Any]:
    """The schema of ``<run-dir>/summary.json``: ``RunSummary``, open to other stages' blocks."""
    schema = json_schema(
        RunSummary, title="llmflow run summary (<run-dir>/summary.json)",
        description="Written atomically by `llmflow run` as stages finish. The runner's keys first, then "
                    "each stage's block (ctx.summary) under its key.")
    schema["additionalProperties"] = {"description": OTHER_STAGE_BLOCKS}
    return schema


def verdict_schema() -> dict[str, Any]:
    """``schemas/verdict.schema.json``: the bisect stage's verdict.json."""
    return json_schema(Verdict, title="llmflow bisect verdict")  # (described by Verdict's docstring)
