"""msprobe dump.json: names, token split of one step folder, construct.json parents, npy data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llmflow.errors import DumpFormatError
from llmflow.formats import open_dump
from llmflow.formats.msprobe import MsprobeDumpReader, api_name, parse_name


def _t(shape, data_name=None, mx=1.0):
    d = {"type": "torch.Tensor", "dtype": "torch.float16", "shape": shape, "Max": mx, "Min": -mx,
         "Mean": 0.0, "Norm": 2.0, "requires_grad": False}
    if data_name:
        d["data_name"] = data_name
    return d


def _write(folder: Path, data: dict, construct: dict | None = None, level: str = "mix") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dump.json").write_text(json.dumps({"task": "tensor", "level": level, "framework": "pytorch",
                                                  "dump_data_dir": None, "data": data}))
    (folder / "construct.json").write_text(json.dumps(construct or {}))


def test_parse_and_api_names() -> None:
    assert parse_name("Module.model.layers.0.mlp.down_proj.Linear.forward.0") == (
        "module", "model.layers.0.mlp.down_proj", "Linear", "forward")
    assert parse_name("Module.LlamaForCausalLM.forward.2") == ("module", "", "LlamaForCausalLM", "forward")
    assert parse_name("Functional.linear.20.forward") == ("api", "linear", "Functional", "forward")
    assert parse_name("Tensor.__add__.3.backward")[3] == "backward"
    raw = ("__add__", "__radd__", "__iadd__", "__truediv__", "__matmul__", "linear")
    assert [api_name(n) for n in raw] == ["add", "add", "add_", "div", "matmul", "linear"]


def test_one_step_folder_is_split_into_tokens_by_the_first_record(tmp_path: Path) -> None:
    rank = tmp_path / "step0" / "rank0"
    data, construct = {}, {}
    for k in range(2):  # two tokens: embedding module + its embedding API, then a Tensor add
        data[f"Functional.embedding.{k}.forward"] = {"input_args": [_t([1, 2])], "output": [_t([1, 2, 4])]}
        construct[f"Functional.embedding.{k}.forward"] = f"Module.model.embed.Embedding.forward.{k}"
        data[f"Module.model.embed.Embedding.forward.{k}"] = {
            "input_args": [_t([1, 2])], "input_kwargs": {"scale": {"type": "float", "value": 0.5}},
            "output": [_t([1, 2, 4], f"Module.model.embed.Embedding.forward.{k}.output.0.npy", mx=k + 1.0)],
            "parameters": {"weight": _t([10, 4])}}
        for j in range(2):
            n = 2 * k + j
            data[f"Tensor.__add__.{n}.forward"] = {"input_args": [_t([4]), {"type": "int", "value": 1}],
                                                   "output": [{"a": _t([4]), "b": [_t([4])]}]}
            construct[f"Tensor.__add__.{n}.forward"] = "Module.model.Inner.forward.0"
    data["Tensor.__add__.9.backward"] = {"input": [_t([4])]}
    _write(rank, data, construct)
    (rank / "dump_tensor_data").mkdir()
    for k in range(2):
        np.save(rank / "dump_tensor_data" / f"Module.model.embed.Embedding.forward.{k}.output.0.npy",
                np.full((1, 2, 4), k + 1, dtype=np.float16))
    r = open_dump(tmp_path)
    assert isinstance(r, MsprobeDumpReader) and r.steps() == [0, 1]
    names = [(e.step, e.name, e.kind, e.index) for e in r.entries() if e.step == 1]
    assert names == [
        (1, "model.embed/embedding.0", "input", "0"), (1, "model.embed/embedding.0", "output", "0"),
        (1, "model.embed", "input", "0"), (1, "model.embed", "input", "kw:scale"),
        (1, "model.embed", "output", "0"),
        (1, "model/add.0", "input", "0"), (1, "model/add.0", "input", "1"),
        (1, "model/add.0", "output", "0.a"), (1, "model/add.0", "output", "0.b.0"),
        (1, "model/add.1", "input", "0"), (1, "model/add.1", "input", "1"),
        (1, "model/add.1", "output", "0.a"), (1, "model/add.1", "output", "0.b.0"),
    ]
    out = next(e for e in r.entries() if e.step == 1 and e.name == "model.embed" and e.kind == "output")
    assert out.has_data and out.dtype == "float16" and out.stats["max"] == 2.0
    assert torch.equal(r.load(out), torch.full((1, 2, 4), 2, dtype=torch.float16))
    kw = next(e for e in r.entries() if e.index == "kw:scale")
    assert kw.dtype is None and kw.value == 0.5 and kw.pytype == "float" and not kw.has_data
    w = [e for e in r.entries() if e.kind == "weight"]
    assert [(e.step, e.name) for e in w] == [(-1, "model.embed.weight")]
    assert r.env()["level"] == "mix"


def test_step_folders_with_one_token_each_keep_their_numbers(tmp_path: Path) -> None:
    for s in (0, 3):
        _write(tmp_path / f"step{s}" / "proc555", {"Module.m.Linear.forward.0": {"output": [_t([2])]}})
    r = open_dump(tmp_path)
    assert r.steps() == [0, 3] and r.ranks() == [0]


def test_pickled_pt_is_refused(tmp_path: Path) -> None:
    rank = tmp_path / "rank0"
    _write(rank, {"Module.m.Linear.forward.0": {"output": [_t([2], "x.pt")]}})
    (rank / "dump_tensor_data").mkdir()
    import pickle

    class Evil:
        def __reduce__(self):
            return (open, (str(tmp_path / "PWNED"), "w"))

    (rank / "dump_tensor_data" / "x.pt").write_bytes(pickle.dumps(Evil()))
    r = open_dump(rank)
    with pytest.raises(DumpFormatError, match="x.pt"):
        r.load(r.entries()[0])
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("text,match", [
    ("{", "not valid JSON"), ('{"data": []}', "no 'data' object"), ("[" * 100000 + "]" * 100000, "JSON"),
    ('{"data": {"Module.m.Linear.forward.0": {"output": [{"type": "torch.Tensor", "dtype": "x", '
     '"shape": [-1]}]}}}', "bad dimension"),
])
def test_malformed_dump_json(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "dump.json").write_text(text)
    with pytest.raises(DumpFormatError, match=match):
        MsprobeDumpReader(tmp_path).entries()


def test_statistics_of_every_type_peers_write(tmp_path: Path) -> None:
    def value(mx, mn, mean, norm, dtype="torch.float32"):
        return {"type": "torch.Tensor", "dtype": dtype, "shape": [2], "Max": mx, "Min": mn, "Mean": mean,
                "Norm": norm, "requires_grad": False}

    _write(tmp_path / "rank0", {"Functional.embedding.0.forward": {
        "input_args": [value(9, 1, None, None, "torch.int64")],
        "output": [value("nan", "-inf", "NaN", "Infinity"), value(True, False, None, None, "torch.bool"),
                   value(None, "n/a", None, None)]}}, level="L1")
    r = open_dump(tmp_path)
    ids, out, flags, blind = r.entries()
    assert ids.stats == {"max": 9.0, "min": 1.0} and flags.stats == {"max": 1.0, "min": 0.0}
    assert math.isnan(out.stats["max"]) and out.stats["min"] == -math.inf and out.stats["norm"] == math.inf
    assert blind.stats is None
    assert len(r.problems()) == 1 and "1 tensor value(s) carry no statistic and no data" in r.problems()[0]


def test_l1_passes_open_at_the_first_table_looked_up(tmp_path: Path) -> None:
    """GPT-2 looks up two tables per pass (tokens, then positions): one pass, not two."""
    def lookup(table_rows):
        return {"input_args": [_t([1, 2]), {**_t([table_rows, 4]), "dtype": "torch.float32"}],
                "output": [_t([1, 2, 4])]}

    data = {"Torch.isin.0.forward": {"output": [_t([1])]}}
    for k in range(3):
        data[f"Functional.embedding.{2 * k}.forward"] = lookup(10)
        data[f"Functional.embedding.{2 * k + 1}.forward"] = lookup(8)
        data[f"Functional.linear.{k}.forward"] = {"output": [_t([1, 2, 10])]}
    _write(tmp_path / "step0" / "rank0", data, level="L1")
    r = open_dump(tmp_path)
    assert r.steps() == [0, 1, 2]
    assert {e.name for e in r.entries() if e.step == 2} == {"/embedding.0", "/embedding.1", "/linear.0"}
    assert {e.name for e in r.entries() if e.step == 0} >= {"/isin.0"}
