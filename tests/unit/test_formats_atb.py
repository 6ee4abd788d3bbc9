"""ATB .bin files and the ATB dump reader: exact bytes, names, steps, corrupt input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmflow.errors import DumpFormatError
from llmflow.formats import open_dump
from llmflow.formats.atb import AtbDumpReader
from llmflow.formats.atb_bin import load_bin, read_header

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from format_writers import write_atb_dump, write_bin, write_bin_stats  # noqa: E402


def test_bin_header_bytes_match_mki_binfile(tmp_path: Path) -> None:
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    p = tmp_path / "outtensor0.bin"
    write_bin(p, t)
    raw = p.read_bytes()
    head = (b"$Version=1.0\n$Object.Count=1\n$Object.Length=12\nformat=2\ndtype=1\ndims=2,3\n"
            b"$Object.data=0,12\n$End=1\n")
    assert raw == head + t.numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32,
                                   torch.int64, torch.bool])
def test_bin_round_trip_keeps_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    t = (torch.randn(3, 5) * 10).to(dtype)
    p = tmp_path / "x.bin"
    write_bin(p, t)
    back = load_bin(p)
    assert back.dtype == dtype and torch.equal(back, t)


def test_bin_statistics_variant(tmp_path: Path) -> None:
    p = tmp_path / "s.bin"
    write_bin_stats(p, torch.tensor([[1.0, -3.0], [2.0, 4.0]]))
    h = read_header(p)
    assert h.data is None and h.dims == (2, 2)
    assert h.stats == pytest.approx({"max": 4.0, "min": -3.0, "mean": 1.0, "norm": 30 ** 0.5})
    with pytest.raises(DumpFormatError, match="statistics-only"):
        load_bin(p)


def _bin(tmp_path: Path, header: str, data: bytes = b"") -> Path:
    p = tmp_path / "bad.bin"
    p.write_bytes(header.encode() + data)
    return p


@pytest.mark.parametrize("header,data,match", [
    ("$Version=1.0\n$Object.Count=1\n$Object.Length=8\nformat=2\ndtype=0\ndims=2\n$Object.data=0,8\n$End=1\n",
     b"\0" * 4, "only 4 bytes"),
    ("$Version=1.0\n$Object.Count=1\n$Object.Length=10000000000\nformat=2\ndtype=0\ndims=2\n"
     "$Object.data=0,10000000000\n$End=1\n", b"\0" * 8, "lying header"),
    ("$Version=1.0\n$Object.Count=1\n$Object.Length=8\nformat=2\ndtype=77\ndims=2\n"
     "$Object.data=0,8\n$End=1\n", b"\0" * 8, "unknown ATB dtype code 77"),
    ("$Version=1.0\n$Object.Count=1\n$Object.Length=8\nformat=2\ndtype=0\n"
     "dims=281474976710656,281474976710656,281474976710656\n$Object.data=0,8\n$End=1\n", b"\0" * 8, "need"),
    ("$Version=1.0\n$Object.Count=1\n$Object.Length=8\nformat=2\ndtype=0\ndims=2\n", b"",
     "header never ends"),
    ("$Version=1.0\n$Object.Count=1\n$Object.Length=8\nformat=2\ndtype=0\ndims=3\n$Object.data=0,8\n$End=1\n",
     b"\0" * 8, "need 12 bytes"),
    ("$Version=1.0\ndtype=zero\ndims=2\n$End=1\n", b"", "not an integer"),
    ("$Version=1.0\ngarbage line\n$End=1\n", b"", "not name=value"),
])
def test_bin_corrupt_headers_are_dump_format_errors(tmp_path: Path, header: str, data: bytes,
                                                    match: str) -> None:
    p = _bin(tmp_path, header, data)
    with pytest.raises(DumpFormatError, match=match) as info:
        load_bin(p)
    assert str(p) in str(info.value)


def test_bin_no_end_in_big_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    p = tmp_path / "big.bin"
    with open(p, "wb") as f:
        f.write(b"x" * (1 << 20))
    with pytest.raises(DumpFormatError, match="no \\$End=1 line"):
        read_header(p)


def _two_model_dump(tmp_path: Path) -> Path:
    nodes0 = [{"opName": "WordEmbedding_0", "opType": "WordEmbedding"},
              {"opName": "DecoderLayer_1", "opType": "DecoderLayer",
               "nodes": [{"opName": "RmsNorm", "opType": "RmsNorm"}]}]
    nodes1 = [{"opName": "WordEmbedding_2", "opType": "WordEmbedding"},
              {"opName": "DecoderLayer_3", "opType": "DecoderLayer",
               "nodes": [{"opName": "RmsNorm", "opType": "RmsNorm"}]}]
    t = torch.ones(1, 4)
    rounds = {
        0: {"0_WordEmbedding": {"out": [t * 99]}},
        1: {"0_WordEmbedding": {"in": [t], "out": [t * 2]},
            "1_DecoderLayer": {"in": [t * 2], "out": [t * 3]},
            "1_DecoderLayer/0_RmsNorm": {"in": [t * 2], "out": [t * 4]},
            "2_WordEmbedding": {"in": [t], "out": [t * 5]},
            "3_DecoderLayer": {"out": [t * 6]}},
        2: {"2_WordEmbedding": {"out": [t * 7]}},
    }
    models = [{"modelName": "Prefill", "nodes": nodes0}, {"modelName": "Decode", "nodes": nodes1}]
    return write_atb_dump(tmp_path, rounds, models, device_id=1, pid=77, timestamp="20250101_000000")


def test_two_models_split_round_one_into_tokens_and_drop_warmup(tmp_path: Path) -> None:
    root = _two_model_dump(tmp_path)
    r = AtbDumpReader(root)
    got = [(e.step, e.name, e.kind, e.index, e.module_type) for e in r.entries()]
    assert got == [
        (0, "0_WordEmbedding", "input", "0", "WordEmbedding"),
        (0, "0_WordEmbedding", "output", "0", "WordEmbedding"),
        (0, "1_DecoderLayer", "input", "0", "DecoderLayer"),
        (0, "1_DecoderLayer.0_RmsNorm", "input", "0", "RmsNorm"),
        (0, "1_DecoderLayer.0_RmsNorm", "output", "0", "RmsNorm"),
        (0, "1_DecoderLayer", "output", "0", "DecoderLayer"),
        (1, "0_WordEmbedding", "input", "0", "WordEmbedding"),
        (1, "0_WordEmbedding", "output", "0", "WordEmbedding"),
        (1, "1_DecoderLayer", "output", "0", "DecoderLayer"),
        (2, "0_WordEmbedding", "output", "0", "WordEmbedding"),
    ]
    vals = {(e.step, e.name, e.kind): r.load(e)[0, 0].item() for e in r.entries()}
    assert vals[(1, "0_WordEmbedding", "output")] == 5 and vals[(2, "0_WordEmbedding", "output")] == 7
    topo = r.topology()
    assert [c["name"] for c in topo["children"]] == ["0_WordEmbedding", "1_DecoderLayer"]
    assert len(topo["models"]) == 2


@pytest.mark.parametrize("sub", ["", "msit_dump_20250101_000000", "msit_dump_20250101_000000/tensors",
                                 "msit_dump_20250101_000000/tensors/1_77"])
def test_open_dump_finds_atb_from_any_level(tmp_path: Path, sub: str) -> None:
    _two_model_dump(tmp_path)
    r = open_dump(tmp_path / sub)
    assert isinstance(r, AtbDumpReader) and r.steps() == [0, 1, 2]


def test_key_outside_dump_is_refused(tmp_path: Path) -> None:
    r = AtbDumpReader(_two_model_dump(tmp_path))
    e = r.entries()[0]
    e.key = "../../../../etc/passwd"
    with pytest.raises(DumpFormatError, match="inside the dump"):
        r.load(e)


def test_malformed_model_json_is_named(tmp_path: Path) -> None:
    root = _two_model_dump(tmp_path)
    bad = root / "model" / "77" / "Decode.json"
    bad.write_text('{"modelName": "Decode", "nodes": [')
    with pytest.raises(DumpFormatError, match="Decode.json: not valid JSON"):
        AtbDumpReader(root).entries()


def test_symlink_loop_is_a_dump_format_error(tmp_path: Path) -> None:
    root = _two_model_dump(tmp_path)
    op = root / "tensors" / "1_77" / "1" / "1_DecoderLayer"
    (op / "5_Loop").symlink_to(op, target_is_directory=True)
    with pytest.raises(DumpFormatError, match="symlink loop"):
        AtbDumpReader(root).entries()
