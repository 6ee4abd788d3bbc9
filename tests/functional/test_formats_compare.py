"""One compare for the data users already have: an msit torch dump against an ATB dump of the same
tiny Llama values, through ``llmflow.compare`` with the atb-llama op mapping."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

from llmflow.compare.run import CompareOptions, compare_dumps
from llmflow.formats import open_dump
from llmflow.formats.atb import AtbDumpReader
from llmflow.formats.msit import MsitDumpReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from formats_helpers import (  # noqa: E402
    capture,
    tiny_model,
    write_atb_from_capture,
    write_msit_from_capture,
)


@pytest.fixture(scope="module")
def captured():
    return capture(tiny_model(), steps=3)


def test_readers_give_back_the_captured_values(tmp_path: Path, captured) -> None:
    tokens, types = captured
    msit = open_dump(write_msit_from_capture(tmp_path / "g", tokens, types).parent)
    atb = open_dump(write_atb_from_capture(tmp_path / "t", tokens).parent)
    assert isinstance(msit, MsitDumpReader) and isinstance(atb, AtbDumpReader)
    assert msit.steps() == atb.steps() == [0, 1, 2]
    e = next(e for e in msit.entries()
             if e.step == 2 and e.name == "model.layers.1.mlp" and e.kind == "output")
    assert torch.equal(msit.load(e), tokens[2]["model.layers.1.mlp"]["output"])
    a = next(e for e in atb.entries()
             if e.step == 2 and e.name == "2_DecoderLayer.3_Mlp" and e.kind == "output")
    assert torch.equal(atb.load(a), tokens[2]["model.layers.1.mlp"]["output"])


def test_msit_against_atb_compares_clean(tmp_path: Path, captured) -> None:
    tokens, types = captured
    g = write_msit_from_capture(tmp_path / "g", tokens, types)
    t = write_atb_from_capture(tmp_path / "t", tokens)
    opts = CompareOptions(mapping="atb-llama", xlsx=False, workers=1)
    res = compare_dumps(g, t, tmp_path / "out", opts)
    rows = [r for path in res["csv"].values() for r in csv.DictReader(open(path))]
    matched = [r for r in rows if r.get("target_name") and r.get("name")]
    names = {(r["name"], r["target_name"]) for r in matched}
    assert ("model.layers.0.self_attn", "1_DecoderLayer.1_Attention") in names
    assert ("model.layers.1.post_attention_layernorm", "2_DecoderLayer.2_RmsNorm") in names
    assert ("lm_head", "4_LmHead") in names and ("model.embed_tokens", "0_WordEmbedding") in names
    steps = {r.get("golden_step", r.get("step")) for r in matched}
    assert len(steps) >= 3, steps
    assert all(r["verdict"] == "pass" for r in matched), [r for r in matched if r["verdict"] != "pass"][:2]


def test_a_corrupted_target_op_is_caught(tmp_path: Path, captured) -> None:
    tokens, types = captured
    bad = {s: {n: dict(c) for n, c in mods.items()} for s, mods in tokens.items()}
    bad[1]["model.layers.1.mlp"]["output"] = bad[1]["model.layers.1.mlp"]["output"] * 1.5
    g = write_msit_from_capture(tmp_path / "g", tokens, types)
    t = write_atb_from_capture(tmp_path / "t", bad)
    opts = CompareOptions(mapping="atb-llama", xlsx=False, workers=1)
    res = compare_dumps(g, t, tmp_path / "out", opts)
    rows = [r for path in res["csv"].values() for r in csv.DictReader(open(path))]
    failed = {(r["name"], r["kind"]) for r in rows if r.get("verdict") == "fail"}
    assert ("model.layers.1.mlp", "output") in failed
    assert ("model.layers.0.mlp", "output") not in failed
