"""msit torch dumps: layout, names, statistics, weights, unsafe pickles."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

from llmflow.errors import DumpFormatError
from llmflow.formats import open_dump
from llmflow.formats.msit import MsitDumpReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from format_writers import write_msit_dump  # noqa: E402

TREE = {"name": "root", "type": "Toy", "children": [
    {"name": "root.model", "type": "Inner", "children": [
        {"name": "root.model.embed", "type": "Embedding", "children": []},
        {"name": "root.model.attn", "type": "Attn", "children": []}]}]}


def _dump(tmp_path: Path, **kw) -> Path:
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    tokens = {
        0: {"model.embed": {"inputs": (torch.tensor([[1, 2]]),), "output": x.to(torch.bfloat16)},
            "model.attn": {"inputs": (x, x * 2), "output": (x * 3, (x * 4, x * 5))},
            "model.attn.matmul": {"inputs": (x,), "output": x * 6}},
        1: {"model.embed": {"inputs": (torch.tensor([[3]]),), "output": x[:1]}},
    }
    return write_msit_dump(tmp_path, tokens, tree=TREE, weights={"model.embed.weight": torch.ones(5, 4)},
                           device="npu3", pid=99, timestamp="20250101_000000", **kw)


def test_names_indices_and_values(tmp_path: Path) -> None:
    r = MsitDumpReader(_dump(tmp_path))
    got = [(e.step, e.name, e.kind, e.index, e.level, e.dtype) for e in r.entries()]
    assert got[0] == (-1, "model.embed.weight", "weight", "0", "weight", "float32")
    assert got[1:] == [
        (0, "model.embed", "input", "0", "module", "int64"),
        (0, "model.embed", "output", "0", "module", "bfloat16"),
        # an API call inside a module ends before the module's output does
        (0, "model.attn/matmul.0", "input", "0", "api", "float32"),
        (0, "model.attn/matmul.0", "output", "0", "api", "float32"),
        (0, "model.attn", "input", "0", "module", "float32"),
        (0, "model.attn", "input", "1", "module", "float32"),
        (0, "model.attn", "output", "0", "module", "float32"),
        (0, "model.attn", "output", "1.0", "module", "float32"),
        (0, "model.attn", "output", "1.1", "module", "float32"),
        (1, "model.embed", "input", "0", "module", "int64"),
        (1, "model.embed", "output", "0", "module", "float32"),
    ]
    e = next(e for e in r.entries() if e.name == "model.attn" and e.index == "1.1")
    assert torch.equal(r.load(e), torch.arange(8.0).reshape(2, 4) * 5)
    assert r.entries()[2].module_type == "Embedding"


def test_a_module_comes_after_the_modules_inside_it(tmp_path: Path) -> None:
    """The order module outputs are made in: the model's own row last, so a compare's first failing
    row is the innermost module that fails, not the model around it."""
    x = torch.ones(2, 4)
    tokens = {0: {"": {"inputs": (x,), "output": x}, "model": {"inputs": (x,), "output": x},
                  "model.attn": {"inputs": (x,), "output": x}, "model.embed": {"inputs": (x,), "output": x}}}
    r = MsitDumpReader(write_msit_dump(tmp_path, tokens, tree=TREE, device="cpu", pid=1,
                                       timestamp="20250101_000000"))
    names = list(dict.fromkeys(e.name for e in r.entries() if e.step == 0))
    assert names == ["model.embed", "model.attn", "model", ""]
    assert r.topology()["children"][0]["name"] == "model"


@pytest.mark.parametrize("sub", ["", "msit_dump_20250101_000000", "msit_dump_20250101_000000/torch_tensors",
                                 "msit_dump_20250101_000000/torch_tensors/npu3_99"])
def test_open_dump_accepts_every_level(tmp_path: Path, sub: str) -> None:
    _dump(tmp_path)
    r = open_dump(tmp_path / sub)
    assert isinstance(r, MsitDumpReader) and r.steps() == [0, 1] and r.ranks() == [0]


def test_ranks_follow_device_ids(tmp_path: Path) -> None:
    for dev, pid in (("npu10", 5), ("npu2", 9)):
        write_msit_dump(tmp_path, {0: {"m": {"output": torch.full((2,), float(pid))}}}, device=dev, pid=pid,
                        timestamp="20250101_000000")
    r = open_dump(tmp_path)
    assert [(e.rank, r.load(e)[0].item()) for e in r.entries()] == [(0, 9.0), (1, 5.0)]


def test_statistics_csv_fills_stats_and_stands_alone(tmp_path: Path) -> None:
    root = _dump(tmp_path, statistics=True)
    r = open_dump(root)
    e = next(e for e in r.entries() if e.name == "model.attn" and e.kind == "input" and e.index == "1")
    norm = float(torch.arange(8.0).norm() * 2)
    assert e.stats == pytest.approx({"max": 14.0, "min": 0.0, "mean": 7.0, "norm": norm})
    for f in root.rglob("*.pth"):  # msit's dump_statistics_mode=1: statistics only
        f.unlink()
    r = open_dump(root)
    stats_only = [e for e in r.entries() if e.step >= 0]
    assert stats_only and not any(e.has_data for e in stats_only)
    e = next(e for e in stats_only if e.name == "model.embed" and e.kind == "output" and e.step == 0)
    assert e.dtype == "bfloat16" and e.shape == (2, 4) and e.stats["max"] == 7.0
    with pytest.raises(DumpFormatError, match="statistics only"):
        r.load(e)


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    root = _dump(tmp_path)
    marker = tmp_path / "PWNED"
    target = next(root.rglob("output.pth"))
    with open(target, "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    r = open_dump(root)
    for e in r.entries():  # the refused file's entry is left out; everything else loads
        if e.has_data:
            r.load(e)
    assert any(str(target) in p and "never unpickles" in p for p in r.problems())
    assert not marker.exists()


def test_truncated_pth_and_bad_csv_and_tree(tmp_path: Path) -> None:
    root = _dump(tmp_path)
    f = next(root.rglob("input_1.pth"))
    f.write_bytes(f.read_bytes()[:40])
    r = open_dump(root)  # msit has no index: listing reads the file, and leaves it out
    assert "input_1.pth" not in {Path(e.key).name for e in r.entries()} and r.entries()
    assert [p for p in r.problems() if "input_1.pth" in p] and len(r.problems()) == 1
    f.unlink()
    tree = next(root.rglob("model_tree.json"))
    tree.write_text("{not json")
    with pytest.raises(DumpFormatError, match="model_tree.json"):
        MsitDumpReader(root).entries()
