"""An llmflow dump's tensors are views of their data file mapped whole: every dtype and shape the
writer stores loads as ``safetensors`` itself loads it, a reader sent to another process maps the
files again, and a data file whose header does not describe its bytes is refused by name."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmflow.errors import DumpFormatError
from llmflow.formats.base import Entry
from llmflow.formats.llmflow_dump import DumpDirWriter, LlmflowDumpReader

TENSORS = {
    "f32": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
    "bf16": torch.randn(7, generator=torch.Generator().manual_seed(1)).bfloat16(),
    "f16": torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(2)).half(),
    "i64": torch.arange(11),
    "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    "u8": torch.arange(5, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
}


def _write(path: Path) -> Path:
    w = DumpDirWriter(path, meta={"data_mode": "tensor"})
    entries = [Entry(step=0, rank=0, name=f"m.{k}", kind="output", index="0", level="module", order=i,
                     dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), key=k)
               for i, (k, t) in enumerate(TENSORS.items())]
    w.write_batch(dict(TENSORS), entries)
    w.close()
    return path


def _data_file(path: Path) -> Path:
    (f,) = sorted((path / "rank0" / "data").glob("*.safetensors"))
    return f


def test_every_dtype_and_shape_loads_as_safetensors_loads_it(tmp_path: Path) -> None:
    d = _write(tmp_path / "d")
    reader = LlmflowDumpReader(d)
    stored = load_file(str(_data_file(d)))
    entries = reader.entries()
    assert len(entries) == len(TENSORS) and reader.problems() == []
    for e in entries:
        got = reader.load(e)
        want = stored[e.key.rpartition(":")[2]]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), e.name
        assert torch.equal(got, TENSORS[e.name.removeprefix("m.")])


def test_a_reader_sent_to_another_process_maps_the_files_again(tmp_path: Path) -> None:
    reader = LlmflowDumpReader(_write(tmp_path / "d"))
    entries = reader.entries()
    reader.load(entries[0])  # a mapping and a table the copy must not carry
    copy = pickle.loads(pickle.dumps(reader))
    for e in entries:
        assert torch.equal(copy.load(e), reader.load(e))


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.parametrize("damage", ["range beyond the file", "range unfit for the shape", "shape not sizes"])
def test_a_header_that_does_not_describe_the_bytes_is_named_and_its_entries_left_out(
        tmp_path: Path, damage: str) -> None:
    d = _write(tmp_path / "d")
    f = _data_file(d)

    def edit(header: dict) -> None:
        if damage == "range beyond the file":
            header["f32"]["data_offsets"] = [o + (1 << 20) for o in header["f32"]["data_offsets"]]
        elif damage == "range unfit for the shape":
            header["f32"]["shape"] = [3, 6]
        else:
            header["f32"]["shape"] = [3, "5"]

    _rewrite_header(f, edit)
    reader = LlmflowDumpReader(d)
    assert reader.entries() == [] or all(not e.has_data for e in reader.entries())
    (problem,) = reader.problems()
    assert str(f) in problem and "left out" in problem
    assert ("truncated" if damage == "range beyond the file" else "not a safetensors file") in problem


def test_a_data_file_cut_short_after_its_index_was_read_fails_by_name(tmp_path: Path) -> None:
    d = _write(tmp_path / "d")
    reader = LlmflowDumpReader(d)
    entries = reader.entries()
    f = _data_file(d)
    f.write_bytes(f.read_bytes()[:64])
    with pytest.raises(DumpFormatError, match=str(f)):
        for e in entries:
            reader.load(e)
