"""``DumpReader.problems()``: every reader says when a dump cannot be trusted as whole, and no
damaged file (a FIFO, a truncated file, JSON nested without end) blocks or crashes a reader."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llmflow.errors import DumpFormatError
from llmflow.formats import open_dump
from llmflow.formats.llmflow_dump import DumpDirWriter, LlmflowDumpReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import dump  # noqa: E402
from format_writers import write_atb_dump, write_msit_dump  # noqa: E402

DEEP = "[" * 100_000 + "]" * 100_000  # beyond the interpreter's recursion limit
FIFO = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need a POSIX system")


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, failing the test if it has not returned within ``seconds`` (a reader that
    opened a FIFO waits for a writer that never comes)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"the reader blocked for more than {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and not isinstance(exc, RecursionError)
    return text


def _llmflow(tmp_path: Path) -> Path:
    dump(tmp_path, new_tokens=3, token_range="all")
    return tmp_path / "dump"


def _data_files(d: Path) -> list[Path]:
    return sorted((d / "rank0" / "data").glob("*.safetensors"))


# -- llmflow ------------------------------------------------------------------------------------

def test_a_whole_dump_has_no_problems(tmp_path: Path) -> None:
    assert LlmflowDumpReader(_llmflow(tmp_path)).problems() == []


@pytest.mark.parametrize("damage", ["missing", "truncated", "foreign", pytest.param("fifo", marks=FIFO)])
def test_an_unusable_data_file_is_named_and_its_entries_left_out(tmp_path: Path, damage: str) -> None:
    d = _llmflow(tmp_path)
    whole = LlmflowDumpReader(d).entries()
    victim = _data_files(d)[-1]
    if damage == "missing":
        victim.unlink()
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif damage == "foreign":
        victim.write_bytes(b"\x00" * 500)
    else:
        victim.unlink()
        os.mkfifo(victim)
    r = LlmflowDumpReader(d)
    entries = within(20, r.entries)
    lost = {e.key for e in whole if e.key.startswith(f"rank0/data/{victim.name}:")}
    assert lost and len(entries) == len(whole) - sum(e.key.split(":")[0].endswith(victim.name) for e in whole)
    problems = within(20, r.problems)
    assert len(problems) == 1 and str(victim) in problems[0] and "left out" in problems[0]
    assert {"missing": "missing", "truncated": "truncated", "foreign": "not a safetensors file",
            "fifo": "not a regular file"}[damage] in problems[0]
    for e in entries:
        if e.has_data:
            r.load(e)


def test_an_unclosed_writer_a_torn_line_and_an_unfinished_file(tmp_path: Path) -> None:
    w = DumpDirWriter(tmp_path / "d", 0)
    from llmflow.formats.base import Entry

    t = torch.ones(3)
    w.write_batch({"1": t}, [Entry(0, 0, "m", "output", "0", "module", 0, dtype="float32", shape=(3,),
                                   key="1")])
    with open(tmp_path / "d" / "rank0" / "index.jsonl", "ab") as f:
        f.write(b'{"rank":0,"fields":["step"')  # killed in the middle of a line
    (tmp_path / "d" / "rank0" / "data" / "000001.safetensors.tmp").write_bytes(b"partial")
    r = open_dump(tmp_path / "d")
    assert [e.name for e in r.entries()] == ["m"] and r.load(r.entries()[0]).tolist() == [1.0] * 3
    problems = r.problems()
    assert len(problems) == 3, problems
    assert "never closed" in problems[0] and "rank.json" in problems[0]
    assert "unfinished data file" in problems[1] and "000001.safetensors.tmp" in problems[1]
    assert "index.jsonl:2: a torn last line" in problems[2]


def test_a_truncated_capture_is_a_problem(tmp_path: Path) -> None:
    r, _ = dump(tmp_path, new_tokens=3, max_bytes=20_000)
    problems = r.problems()
    assert len(problems) == 1 and "capture stopped early" in problems[0] and "max_bytes=20000" in problems[0]


@FIFO
def test_a_fifo_index_or_manifest_never_blocks(tmp_path: Path) -> None:
    d = _llmflow(tmp_path)
    index = d / "rank0" / "index.jsonl"
    index.unlink()
    os.mkfifo(index)
    r = LlmflowDumpReader(d)
    assert within(20, r.entries) == []
    assert any(str(index) in p and "not a regular file" in p for p in within(20, r.problems))
    manifest = d / "llmflow_dump.json"
    manifest.unlink()
    os.mkfifo(manifest)
    with pytest.raises(DumpFormatError, match="llmflow_dump.json: not a regular file") as info:
        within(20, lambda: open_dump(d))
    one_line(info.value)


@pytest.mark.parametrize("name", ["llmflow_dump.json", "rank0/rank.json", "env.json", "topology.json",
                                  "rank0/index.jsonl"])
@pytest.mark.parametrize("depth", ["deep", "moderate"])
def test_deeply_nested_json_is_a_one_line_error_naming_the_file(tmp_path: Path, name: str,
                                                                depth: str) -> None:
    d = _llmflow(tmp_path)
    path = d / name
    if name == "rank0/index.jsonl":  # a row whose ``extra`` nests (in the middle of the index)
        nested = json.loads("[" * 200 + "]" * 200) if depth == "moderate" else None
        lines = path.read_bytes().splitlines()
        first = json.loads(lines[0])
        first["rows"][0][-1] = {"x": nested}
        text = json.dumps(first).encode() if nested is not None else \
            json.dumps(first).encode().replace(b'{"x": null}', b'{"x": ' + DEEP.encode() + b"}")
        path.write_bytes(b"\n".join([text, *lines[1:]]) + b"\n")
    else:
        path.write_text(DEEP if depth == "deep" else "[" * 200 + "]" * 200)

    def read_all() -> None:
        r = open_dump(d)
        r.entries(), r.env(), r.topology(), r.meta(), r.problems()

    with pytest.raises(DumpFormatError) as info:
        read_all()
    text = one_line(info.value)
    assert str(path) in text or f"{path}:1" in text, text


def test_an_index_row_of_the_wrong_types_names_its_line(tmp_path: Path) -> None:
    d = _llmflow(tmp_path)
    index = d / "rank0" / "index.jsonl"
    lines = index.read_text().splitlines()
    bad = json.loads(lines[0])
    bad["rows"][0][0] = "zero"  # step
    index.write_text("\n".join([lines[0], json.dumps(bad), *lines[1:]]) + "\n")
    with pytest.raises(DumpFormatError, match=r"index.jsonl:2: corrupt index line \(step"):
        LlmflowDumpReader(d).entries()


@pytest.mark.parametrize(("field", "value", "said"), [
    ("shape", [10**12, 10**12], "[1000000000000, 1000000000000]"),
    ("dtype", "float16", "index float16"),
])
def test_an_index_row_that_describes_another_tensor_than_its_data_is_left_out(
        tmp_path: Path, field: str, value: Any, said: str) -> None:
    d = _llmflow(tmp_path)
    index = d / "rank0" / "index.jsonl"
    lines = [json.loads(raw) for raw in index.read_text().splitlines()]
    col = lines[0]["fields"].index(field)
    target = next(r for ln in lines for r in ln["rows"] if r[lines[0]["fields"].index("dtype")] == "float32")
    target[col] = value
    index.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    reader = LlmflowDumpReader(d)
    (problem,) = reader.problems()
    assert problem.startswith(f"{index}: 1 entries disagree with their data file on shape or dtype")
    assert said in problem and "F32[" in problem
    assert len(reader.entries()) == sum(len(ln["rows"]) for ln in lines) - 1


# -- msit, ATB, msprobe -------------------------------------------------------------------------

def _msit(tmp_path: Path) -> Path:
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    tokens = {0: {"model.a": {"inputs": (x,), "output": x * 2}, "model.b": {"inputs": (x * 2,), "output": x}}}
    return write_msit_dump(tmp_path, tokens, device="npu0", pid=9, timestamp="20250101_000000")


@FIFO
def test_msit_tensor_file_that_is_a_fifo(tmp_path: Path) -> None:
    root = _msit(tmp_path)
    assert open_dump(root).problems() == []
    victim = next(root.rglob("output.pth"))
    victim.unlink()
    os.mkfifo(victim)
    r = open_dump(root)
    entries = within(20, r.entries)
    assert len(entries) == 3 and all(r.load(e) is not None for e in entries)
    problems = r.problems()
    assert len(problems) == 1 and str(victim) in problems[0] and "not a regular file" in problems[0]


@pytest.mark.parametrize("damage", ["truncated", pytest.param("fifo", marks=FIFO)])
def test_atb_bin_file_that_cannot_be_read(tmp_path: Path, damage: str) -> None:
    t = torch.ones(2, 4)
    root = write_atb_dump(tmp_path, {0: {"0_Embed": {"in": [t], "out": [t * 2]}, "1_Norm": {"in": [t * 2],
                                                                                           "out": [t]}}})
    assert open_dump(root).problems() == []
    victim = next(root.rglob("outtensor0.bin"))
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:30])
    else:
        victim.unlink()
        os.mkfifo(victim)
    r = open_dump(root)
    entries = within(20, r.entries)
    assert len(entries) == 3 and all(r.load(e).shape == (2, 4) for e in entries)
    problems = r.problems()
    assert len(problems) == 1 and str(victim) in problems[0] and "left out" in problems[0]


def _msprobe(tmp_path: Path, names: list[str]) -> Path:
    rank = tmp_path / "step0" / "rank0"
    rank.mkdir(parents=True)
    tensor = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 1.0, "Min": 0.0,
              "Mean": 0.5, "Norm": 1.0}
    data = {f"Module.m{i}.Linear.forward.0": {"output": [{**tensor, "data_name": n}]}
            for i, n in enumerate(names)}
    (rank / "dump.json").write_text(json.dumps({"task": "tensor", "level": "L0", "data": data}))
    (rank / "dump_tensor_data").mkdir()
    for n in names:
        torch.save(torch.ones(2), rank / "dump_tensor_data" / n)
    return tmp_path


def test_msprobe_dump_json_naming_missing_or_odd_tensor_files(tmp_path: Path) -> None:
    root = _msprobe(tmp_path, ["a.pt", "b.pt", "c.pt", "d.pt"])
    assert open_dump(root).problems() == []
    data = root / "step0" / "rank0" / "dump_tensor_data"
    (data / "b.pt").unlink()
    (data / "c.pt").unlink()
    if hasattr(os, "mkfifo"):
        (data / "d.pt").unlink()
        os.mkfifo(data / "d.pt")
    r = open_dump(root)
    entries = within(20, r.entries)
    assert [e.has_data for e in entries] == [True, False, False, not hasattr(os, "mkfifo")]
    problems = r.problems()
    assert "names 2 tensor file(s) missing from dump_tensor_data (first: b.pt)" in problems[0]
    if hasattr(os, "mkfifo"):
        assert len(problems) == 2 and "not regular files" in problems[1] and "d.pt" in problems[1]
    assert r.load(entries[0]).tolist() == [1.0, 1.0]


def test_msprobe_deeply_nested_construct_json(tmp_path: Path) -> None:
    root = _msprobe(tmp_path, ["a.pt"])
    (root / "step0" / "rank0" / "construct.json").write_text(DEEP)
    with pytest.raises(DumpFormatError, match="construct.json") as info:
        open_dump(root).entries()
    one_line(info.value)


def test_msprobe_tensor_files_cut_short_are_read_as_statistics_only(tmp_path: Path) -> None:
    """A ``.pt`` whose zip end record is gone and an ``.npy`` shorter than its header says list
    fine but are not whole: each entry is read as statistics only and the dump says why."""
    import numpy as np

    root = _msprobe(tmp_path, ["a.pt", "b.pt", "c.npy", "d.npy"])
    data = root / "step0" / "rank0" / "dump_tensor_data"
    for name in ("c.npy", "d.npy"):
        (data / name).unlink()
        np.save(data / name, np.ones(2, dtype=np.float32))
    assert open_dump(root).problems() == []
    for name in ("b.pt", "d.npy"):
        (data / name).write_bytes((data / name).read_bytes()[:-3])
    r = open_dump(root)
    assert [e.has_data for e in r.entries() if e.level == "module"] == [True, False, True, False]
    problems = r.problems()
    assert len(problems) == 1, problems
    assert ("names 2 tensor file(s) that are not whole in dump_tensor_data (first: b.pt: cut short: no zip "
            "end record at its end") in problems[0]


@pytest.mark.parametrize(("content", "why"), [
    (b"", None),  # (an empty file is no zip or .npy: the load says what it is)
    (b"PK\x03\x04" + b"\0" * 10, "smaller than a zip archive's end record"),
    (b"\x93NUMPY\x01\x00" + b"\xff" * 10, "unreadable .npy header"),
])
def test_a_data_file_too_odd_to_measure_is_said_in_one_line(tmp_path: Path, content: bytes, why) -> None:
    from llmflow.formats._safe import cut_short

    path = tmp_path / "x.pt"
    path.write_bytes(content)
    said = cut_short(path)
    assert (said is None) if why is None else (why in said and "\n" not in said), said
