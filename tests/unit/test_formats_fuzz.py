"""Property-based robustness: mutated .bin headers and index files (msit statistics.csv, msprobe
dump.json, ATB model json) never raise anything but DumpFormatError/UserError, never hang
(hypothesis deadlines), never allocate what a header merely claims (a huge claim would raise
MemoryError or be killed, failing the test)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmflow.errors import UserError
from llmflow.formats.atb import AtbDumpReader
from llmflow.formats.atb_bin import load_bin, read_header
from llmflow.formats.msit import MsitDumpReader
from llmflow.formats.msprobe import MsprobeDumpReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from format_writers import write_atb_dump, write_msit_dump  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
HEADER = ["$Version=1.0", "$Object.Count=1", "$Object.Length=24", "format=2", "dtype=0", "dims=2,3",
          "$Object.data=0,24", "$End=1"]
values = st.one_of(st.integers(-2**70, 2**70).map(str), st.text(max_size=12),
                   st.sampled_from(["", "-1", "18446744073709551616", "10000000000", "0,99999999999",
                                    "1,2,3", "281474976710656,281474976710656", "27", "12", "9"]))


def _drain(reader) -> None:
    """List, then load every entry that claims data (topology/env too)."""
    try:
        for e in reader.entries():
            if e.has_data:
                reader.load(e)
        reader.topology()
        reader.env()
    except UserError:  # DumpFormatError is a UserError
        pass


@SETTINGS
@given(edits=st.lists(st.tuples(st.integers(0, len(HEADER) - 1), values), max_size=4),
       drop=st.sets(st.integers(0, len(HEADER) - 1), max_size=2), tail=st.integers(-30, 30))
def test_mutated_bin_headers(edits, drop, tail) -> None:
    lines = list(HEADER)
    for i, v in edits:
        name = lines[i].split("=", 1)[0]
        lines[i] = f"{name}={v}"
    lines = [ln for i, ln in enumerate(lines) if i not in drop]
    data = b"\x01" * max(24 + tail, 0)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.bin"
        p.write_bytes(("\n".join(lines) + "\n").encode() + data)
        try:
            h = read_header(p)
            t = load_bin(p, h) if h.data is not None else None
            assert t is None or t.numel() * t.element_size() <= p.stat().st_size
        except UserError:
            pass


@SETTINGS
@given(text=st.one_of(st.text(max_size=300), st.lists(
    st.lists(st.one_of(st.text(max_size=8), st.sampled_from(["Input", "Output", "(1, 2)", "(99999999,)",
                                                             "torch.float16", "nan", "1e400"])),
             min_size=1, max_size=11), max_size=5).map(
    lambda rows: "NodeName,NodeType,InputOutput,Index,DataType,Shape,Max,Min,Mean,L2Norm\n"
                 + "\n".join(",".join(r) for r in rows))))
def test_mutated_msit_statistics_csv(text) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = write_msit_dump(d, {0: {"m": {"output": torch.ones(2)}}}, timestamp="20250101_000000")
        csv_path = next(root.rglob("root.m")) / "statistics.csv"
        csv_path.write_text(text)
        _drain(MsitDumpReader(root))
        (next(root.rglob("output.pth"))).unlink()
        _drain(MsitDumpReader(root))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(), st.text(max_size=10)),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(["type", "dtype", "shape", "data_name", "Max",
                                                                "value", "output", "input_args", "nodes",
                                                                "opType", "opName", "input_kwargs", "x"]),
                                               children, max_size=5)),
    max_leaves=25)
record_names = st.sampled_from(["Module.m.Linear.forward.0", "Functional.linear.0.forward",
                                "Tensor.__add__.1.forward", "Module.forward.0", "garbage",
                                "Torch.x.y.forward"])


@SETTINGS
@given(data=st.dictionaries(record_names, json_values, max_size=4), whole=st.one_of(st.none(), json_values))
def test_mutated_msprobe_dump_json(data, whole) -> None:
    with tempfile.TemporaryDirectory() as d:
        rank = Path(d) / "step0" / "rank0"
        rank.mkdir(parents=True)
        (rank / "dump_tensor_data").mkdir()
        torch.save(torch.ones(2), rank / "dump_tensor_data" / "x.pt")
        doc = whole if whole is not None else {"task": "tensor", "level": "mix", "data": data}
        (rank / "dump.json").write_text(json.dumps(doc))
        (rank / "construct.json").write_text(json.dumps({k: "Module.m.Linear.forward.0" for k in data}))
        _drain(MsprobeDumpReader(Path(d)))


@SETTINGS
@given(model=json_values)
def test_mutated_atb_model_json(model) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = write_atb_dump(d, {0: {"0_WordEmbedding": {"out": [torch.ones(2)]}}},
                              [{"modelName": "M", "nodes": []}], timestamp="20250101_000000")
        (root / "model" / "4242" / "M.json").write_text(json.dumps(model))
        _drain(AtbDumpReader(root))
