"""The results codec: JSON round-trip, type checks that name the field, schemas from the types."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
import pytest

from llmflow.results.codec import RecordError, from_json, json_schema, to_json


@dataclass
class Row:
    """One measured row."""

    name: str
    error: float | None = None
    kind: Literal["module", "op"] = "module"


@dataclass
class Doc:
    status: str
    rows: list[Row] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    best: Row | None = None
    extra: Any = None
    steps: list[int] = field(default_factory=list, metadata={"doc": "decode steps replayed"})


def _doc() -> Doc:
    return Doc("fail", rows=[Row("a", 1.5), Row("b", math.inf, "op"), Row("c")], counts={"pass": 3},
               best=Row("a", float("nan")), extra={"free": [1, "x"]}, steps=[0, 2])


def test_round_trip_through_json_text_gives_an_equal_record():
    text = json.dumps(to_json(_doc()), allow_nan=False)
    back = from_json(Doc, json.loads(text))
    assert back.rows[:1] == [Row("a", 1.5)] and back.rows[1].error == math.inf and back.rows[2] == Row("c")
    assert math.isnan(back.best.error) and back.counts == {"pass": 3} and back.extra == {"free": [1, "x"]}
    assert to_json(back) == to_json(_doc())


@pytest.mark.parametrize("data, path", [
    ({"status": 1}, "Doc.status"),
    ({"status": "x", "rows": [{"name": "a", "error": "big"}]}, "Doc.rows[0].error"),
    ({"status": "x", "rows": [{"error": 1.0}]}, "Doc.rows[0].name"),
    ({"status": "x", "renamed": 1}, "unknown field 'renamed'"),
    ({"status": "x", "best": {"name": "a", "kind": "layer"}}, "Doc.best"),
    ({"status": "x", "best": {"name": "a", "error": "big"}}, "Doc.best.error"),
    ({"status": "x", "counts": {"pass": True}}, "Doc.counts.pass"),
])
def test_a_wrong_field_is_named(data, path):
    with pytest.raises(RecordError, match=path.replace("[", r"\[").replace("]", r"\]")):
        from_json(Doc, data)


def test_schema_accepts_what_is_written_and_refuses_a_renamed_field():
    schema = json_schema(Doc, title="doc")
    jsonschema.validate(to_json(_doc()), schema)
    assert schema["required"] == ["status"]
    assert schema["properties"]["steps"]["description"] == "decode steps replayed"
    assert schema["definitions"]["Row"]["description"] == "One measured row."
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"status": "x", "renamed": 1}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"status": "x", "rows": [{"name": "a", "kind": "layer"}]}, schema)
