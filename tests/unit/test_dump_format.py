"""The llmflow dump format: writer/reader round trip, crash tolerance, and safety."""

from __future__ import annotations

import json
import math
import pickle
import sys
from pathlib import Path

import pytest
import torch

from llmflow.errors import DumpFormatError
from llmflow.formats.base import Entry
from llmflow.formats.llmflow_dump import DumpDirWriter, IndexRow, LlmflowDumpReader, index_line
from llmflow.formats.llmflow_reader import parse_index_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import bits_equal, dump  # noqa: E402


def _entry(step: int, order: int, key: str, t: torch.Tensor, name: str = "m") -> Entry:
    return Entry(step, 0, name, "output", "0", "module", order, dtype=str(t.dtype)[6:],
                 shape=tuple(t.shape), key=key)


def test_round_trip_keeps_dtype_and_bits(tmp_path):
    w = DumpDirWriter(tmp_path / "d", 0, meta={"data_mode": "tensor"})
    special = torch.tensor([1.0, float("nan"), float("inf"), -0.0, 1e-40])
    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(6, dtype=torch.int64),
               "c": special, "d": torch.randn(2, 2).half(), "e": torch.tensor([True, False]),
               "f": torch.randn(4, 3).t().clone()}  # a transposed copy (capture keeps strides)
    assert not tensors["f"].is_contiguous()
    entries = [_entry(0, i, k, t, name=k) for i, (k, t) in enumerate(tensors.items())]
    w.write_batch(dict(tensors), entries)
    w.close()
    r = LlmflowDumpReader(tmp_path / "d")
    assert LlmflowDumpReader.detect(tmp_path / "d") and r.meta()["complete"] is True
    got = {e.name: r.load(e) for e in r.entries()}
    for k, t in tensors.items():
        assert bits_equal(got[k], t), k
    assert [e.name for e in r.entries()] == list(tensors)


def test_index_line_round_trips_every_field():
    full = {"max": 1.5, "min": -2.0, "mean": float("nan"), "norm": float("inf"), "nan": 1.0, "inf": 0.0}
    finite = [0.1 + 0.2, -1e-30, 3.0, 7.25, 0, 0]  # as the writer hands them: a list, shortest repr kept
    entries = [Entry(1, 3, "x", "input", "kw:a.0", "module", 3, dtype="float32", shape=(1, 2),
                     stats={"max": 1.0}, value=None, pytype=None, extra={"crc32": 5}),
               Entry(1, 3, "=cmd|' /C calc'!A0", "output", "0", "api", 4, dtype="bfloat16", shape=(),
                     stats=full, has_data=False, key="7"),
               Entry(2, 3, "y", "input", "kw:use_cache", "module", 0, has_data=False, value=True,
                     pytype="bool"),
               Entry(2, 3, "z", "output", "0", "module", 1, dtype="float32", shape=(4,), stats=list(finite),
                     has_data=False, key="9"),
               Entry(2, 3, "eps", "input", "kw:eps", "module", 2, has_data=False, value=float("-inf"),
                     pytype="float"),
               Entry(2, 3, "odd", "input", "0", "module", 3, has_data=False, pytype="X",
                     extra={1: "int key"})]
    data = index_line([IndexRow.of(e) for e in entries], 3)
    assert isinstance(data, bytes) and data.endswith(b"\n")
    # the capture hands most rows over as plain tuples in IndexRow's field order: the same line
    assert index_line([tuple(IndexRow.of(e)) for e in entries], 3) == data
    # rows with NaN/Infinity (which orjson would write as null) and what orjson refuses go to a
    # second line written by the standard library: every line is one JSON object
    back = [e for line in data.splitlines() for e in parse_index_line(json.loads(line))]
    back.sort(key=lambda e: (e.step, e.order))
    assert len(back) == len(entries)
    assert back[0].to_json() == entries[0].to_json() and back[2] == entries[2]
    assert back[1].stats["max"] == 1.5 and math.isnan(back[1].stats["mean"]) and back[1].shape == ()
    assert back[1].stats["norm"] == math.inf and back[4].value == -math.inf
    assert list(back[3].stats.values()) == finite  # bit-exact floats
    assert back[5].extra == {"1": "int key"}
    # version 1 wrote one Entry.to_json() per line: still read
    assert parse_index_line(json.loads(json.dumps(entries[0].to_json()))) == [entries[0]]


def test_index_line_of_rows_known_finite_is_the_checked_line_and_refuses_what_it_cannot_write():
    """``finite_rows`` (the capture's checked rows) go into the line the per-row look writes,
    ahead of the other rows; NaN and Infinity among those still go to the standard library's
    line; an IndexRow or a value orjson refuses among the finite rows falls back to that look."""
    stats = (1.5, -2.0, 0.1 + 0.2, 7.25, 0.0, 0.0)
    rows = [(0, "m", "output", "0", "module", i, "float32", (2, 3), "Linear", stats, False, None, None,
             str(i + 1), {}) for i in range(3)]
    rows.append((0, "m", "input", "kw:dim", "module", 3, None, None, "Linear", None, False, -1, "int", "",
                 {}))
    assert index_line([], 0, finite_rows=rows) == index_line(rows, 0)
    named = [IndexRow(*rows[0]), *rows[1:]]
    assert index_line([], 0, finite_rows=named) == index_line(named, 0) == index_line(rows, 0)
    inf = (0, "m", "input", "kw:eps", "module", 4, None, None, "Linear", None, False, float("inf"), "float",
           "", {})
    nan = (0, "m", "output", "1", "module", 5, "float32", (2,), "Linear", (float("nan"),) * 4 + (2.0, 0.0),
           False, None, None, "9", {})
    mixed = index_line([inf, nan, rows[1]], 0, finite_rows=[rows[0], rows[2], rows[3]])
    first, second = mixed.splitlines()
    assert [r[5] for r in json.loads(first)["rows"]] == [0, 2, 3, 1]  # the known rows first
    assert b"Infinity" in second and b"NaN" in second and b"Infinity" not in first
    back = {e.order: e for line in mixed.splitlines() for e in parse_index_line(json.loads(line))}
    assert back[4].value == math.inf and math.isnan(back[5].stats["max"]) and sorted(back) == list(range(6))
    odd = [*rows, (0, "m", "input", "kw:n", "module", 4, None, None, "Linear", None, False, 2**70, "int", "",
                   {})]
    lines = index_line([], 0, finite_rows=odd).splitlines()
    back = [e for line in lines for e in parse_index_line(json.loads(line))]
    assert sorted(e.order for e in back) == [0, 1, 2, 3, 4] and back[-1].value == 2**70


def test_incomplete_until_closed_and_torn_last_line_ignored(tmp_path):
    w = DumpDirWriter(tmp_path / "d", 0)
    t = torch.ones(4)
    w.write_batch({"1": t}, [_entry(0, 0, "1", t)])
    r = LlmflowDumpReader(tmp_path / "d")
    assert r.meta()["complete"] is False
    # a writer killed mid-line leaves half a JSON object at the end
    with open(tmp_path / "d" / "rank0" / "index.jsonl", "a") as f:
        f.write('{"step": 1, "rank": 0, "na')
    entries = LlmflowDumpReader(tmp_path / "d").entries()
    assert len(entries) == 1 and bits_equal(r.load(entries[0]), t)


def test_corrupt_middle_line_is_an_error(tmp_path):
    w = DumpDirWriter(tmp_path / "d", 0)
    w.append_rows([IndexRow.of(Entry(0, 0, "a", "input", "0", "module", 0, has_data=False,
                                     pytype="NoneType"))])
    with open(tmp_path / "d" / "rank0" / "index.jsonl", "a") as f:
        f.write("not json\n")
    w.append_rows([IndexRow.of(Entry(0, 0, "b", "input", "0", "module", 1, has_data=False,
                                     pytype="NoneType"))])
    w.close()
    with pytest.raises(DumpFormatError, match=r"index.jsonl:2"):
        LlmflowDumpReader(tmp_path / "d").entries()


def test_entries_of_a_missing_data_file_are_left_out(tmp_path):
    w = DumpDirWriter(tmp_path / "d", 0)
    t = torch.ones(2)
    w.write_batch({"1": t}, [_entry(0, 0, "1", t, "kept")])
    w.write_batch({"2": t}, [_entry(1, 0, "2", t, "lost")])
    w.close()
    (tmp_path / "d" / "rank0" / "data" / "000001.safetensors").unlink()
    assert [e.name for e in LlmflowDumpReader(tmp_path / "d").entries()] == ["kept"]


class _Bomb:
    """Unpickling this creates a marker file: proof that someone unpickled dump data."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_pickle_is_never_loaded(tmp_path):
    r, _ = dump(tmp_path, new_tokens=1, token_range=[0])
    marker = tmp_path / "PWNED"
    bomb = pickle.dumps(_Bomb(str(marker)))
    rank = tmp_path / "dump" / "rank0"
    (rank / "data" / "evil.pth").write_bytes(bomb)
    (rank / "data" / "evil.pt").write_bytes(bomb)
    (tmp_path / "dump" / "evil.pkl").write_bytes(bomb)
    # and an index line that points at the pickle, plus one escaping the dump directory
    evil = [Entry(0, 0, "evil", "output", "0", "module", 999, dtype="float32", shape=(1,),
                  key="rank0/data/evil.pth:x"),
            Entry(0, 0, "escape", "output", "0", "module", 998, dtype="float32", shape=(1,),
                  key="../../outside.safetensors:x")]
    with open(rank / "index.jsonl", "ab") as f:
        f.write(index_line([IndexRow.of(e) for e in evil], 0))
    reader = LlmflowDumpReader(tmp_path / "dump")
    with pytest.raises(DumpFormatError, match="not a safetensors file inside the dump"):
        reader.entries()
    # the honest part of the dump still reads through the public API; nothing was unpickled
    lines = (rank / "index.jsonl").read_text().splitlines()[:-1]
    (rank / "index.jsonl").write_text("\n".join(lines) + "\n")
    reader = LlmflowDumpReader(tmp_path / "dump")
    for e in reader.entries():
        if e.has_data:
            reader.load(e)
    reader.topology(), reader.env(), reader.meta()
    assert not marker.exists()


def test_reader_is_picklable_and_detect_rejects_others(tmp_path):
    r, _ = dump(tmp_path, new_tokens=1, token_range=[0])
    r.entries()
    again = pickle.loads(pickle.dumps(r))
    assert len(again.entries()) == len(r.entries())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "llmflow_dump.json").write_text('{"format": "something-else"}')
    assert not LlmflowDumpReader.detect(tmp_path / "other")
    assert not LlmflowDumpReader.detect(tmp_path / "nowhere")
    assert LlmflowDumpReader.detect(tmp_path / "dump" / "llmflow_dump.json")


def test_topology_env_and_layout(tmp_path):
    r, out = dump(tmp_path, new_tokens=2)
    meta = r.meta()
    assert meta["format"] == "llmflow-dump" and meta["version"] == 3 and meta["data_mode"] == "tensor"
    assert meta["complete"] and meta["steps"] == len(out)
    topo = r.topology()
    assert topo["name"] == "" and topo["type"] == "LlamaForCausalLM"
    layers = next(c for c in topo["children"][0]["children"] if c["name"] == "model.layers")
    assert layers["children"][0]["name"] == "model.layers.0"
    assert topo["execution"]["0"]["1"][:2] == ["model", "model.embed_tokens"]
    env = r.env()
    assert set(env) == {"versions", "env_vars", "torch_settings", "model_config", "generation",
                        "seed", "tokenizer"}
    assert env["versions"]["torch"] == torch.__version__
    assert env["torch_settings"]["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert env["model_config"]["num_hidden_layers"] == 2
    assert env["generation"]["max_new_tokens"] == 2 and env["generation"]["do_sample"] is False
    files = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert files == ["env.json", "llmflow_dump.json", "rank0", "topology.json"]
    assert not list((tmp_path / "dump").rglob("*.tmp"))


@pytest.mark.parametrize("inline", [False, True])
def test_a_failed_writer_reports_once_and_queues_nothing_more(tmp_path, monkeypatch, inline):
    """After a failed write the forward thread hears of it once; later submits neither raise
    again nor pile up in a queue nobody drains (a caller that carries on must not leak)."""
    from llmflow.dump.writer import AsyncWriter
    from llmflow.formats import llmflow_dump

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(llmflow_dump, "write_safetensors", full_disk)
    w = AsyncWriter(DumpDirWriter(tmp_path / "d", 0), inline=inline)
    t = torch.ones(4)
    w.submit(IndexRow.of(_entry(0, 0, "1", t)), t.clone(), nbytes=t.nbytes)
    with pytest.raises(RuntimeError, match="dump writer failed.*No space left"):
        w.end_step(0)
        if not inline:  # the thread fails on its own time: the next call hears of it
            w._thread.join(timeout=10)
            w.submit(IndexRow.of(_entry(1, 0, "2", t)), t.clone(), nbytes=t.nbytes)
    for i in range(100):
        w.submit(IndexRow.of(_entry(1, i, str(i + 3), t)), t.clone(), nbytes=t.nbytes)
    w.end_step(1)
    w.close()
    assert not w._queue
    assert LlmflowDumpReader(tmp_path / "d").meta()["complete"] is False
