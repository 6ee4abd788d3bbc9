"""How a dump ends, in process: closed by nobody (the model collected), a forward that raises,
one interrupted, and a close requested from inside the writer thread. The same as a user's
script sees it is in tests/functional/test_dump_user_scripts.py."""

from __future__ import annotations

import gc
import json
import sys
import threading
from pathlib import Path

import pytest
import torch

from llmflow.dump import DumpConfig, register_hook
from llmflow.dump.writer import AsyncWriter
from llmflow.formats.base import Entry
from llmflow.formats.llmflow_dump import DumpDirWriter, IndexRow, LlmflowDumpReader
from llmflow.models import build_tiny

SPEC = "layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"
IDS = torch.tensor([[256, 104, 105]])


@pytest.fixture(params=["thread", "inline"])
def writer_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("LLMFLOW_DUMP_WRITER", request.param)
    return request.param


def test_a_collected_model_finishes_its_dump(tmp_path: Path, writer_mode: str) -> None:
    model = build_tiny("llama", SPEC)
    register_hook(model, DumpConfig(dump_path=str(tmp_path), token_range="all"))  # handle not kept
    model.generate(IDS, max_new_tokens=3, do_sample=False, pad_token_id=258)
    r = LlmflowDumpReader(tmp_path / "llmflow_dump")
    assert r.meta()["complete"] is False  # still open: the model may run again
    del model
    gc.collect()
    r = LlmflowDumpReader(tmp_path / "llmflow_dump")
    assert r.meta()["complete"] is True and r.problems() == [] and r.steps() == [0, 1, 2]


def test_a_forward_that_raises_is_recorded_and_the_dump_goes_on(tmp_path: Path, writer_mode: str) -> None:
    model = build_tiny("llama", SPEC)
    attn = model.model.layers[1].self_attn
    forward = attn.forward
    fail = {"now": False}

    def flaky(*args, **kwargs):
        if fail["now"]:
            raise ValueError("bad\nnews")  # a message of two lines: recorded as one
        return forward(*args, **kwargs)

    attn.forward = flaky
    h = register_hook(model, DumpConfig(dump_path=str(tmp_path), token_range="all"))
    with torch.no_grad():  # without a cache, each call one token longer: one sequence, one dump
        model(IDS)
        fail["now"] = True
        with pytest.raises(ValueError):
            model(torch.cat([IDS, IDS[:, :1]], dim=1))
        fail["now"] = False
        model(torch.cat([IDS, IDS[:, :2]], dim=1))
    rank = json.loads((tmp_path / "llmflow_dump" / "rank0" / "rank.json").read_text())
    assert rank["complete"] is False  # recorded at once, before any close
    assert rank["errors"] == [{"step": 1, "error": "ValueError: bad", "module": "model.layers.1.self_attn"}]
    h.remove()
    r = LlmflowDumpReader(tmp_path / "llmflow_dump")
    assert r.meta()["complete"] is True and r.steps() == [0, 1, 2]
    assert r.problems() == [f"{tmp_path / 'llmflow_dump' / 'rank0' / 'rank.json'}: step 1: the model's "
                            "forward raised ValueError: bad in model.layers.1.self_attn; that step holds "
                            "only what was captured before it"]
    names = {(e.name, e.kind) for e in r.entries() if e.step == 1}
    assert ("model.layers.1.self_attn", "input") in names and ("logits", "output") not in names
    assert ("logits", "output") in {(e.name, e.kind) for e in r.entries() if e.step == 2}


def test_an_interrupted_step_is_recorded_when_the_next_begins(tmp_path: Path) -> None:
    model = build_tiny("llama", SPEC)
    mlp = model.model.layers[0].mlp
    forward = mlp.forward
    stop = {"now": True}

    def interrupted(*args, **kwargs):
        if stop["now"]:
            raise KeyboardInterrupt  # torch's always_call hooks see only Exception subclasses
        return forward(*args, **kwargs)

    mlp.forward = interrupted
    h = register_hook(model, DumpConfig(dump_path=str(tmp_path), token_range="all"))
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(IDS)
    stop["now"] = False
    with torch.no_grad():
        model(torch.cat([IDS, IDS[:, :1]], dim=1))
    h.remove()
    problems = LlmflowDumpReader(tmp_path / "llmflow_dump").problems()
    assert len(problems) == 1 and "step 0" in problems[0] and "never returned (interrupted)" in problems[0]


def test_a_close_requested_inside_the_writer_thread_is_finished_by_it(tmp_path: Path) -> None:
    """A garbage collection in the writer thread can finalize a model whose dump that thread
    writes: the close is queued, the thread finishes it, and nothing waits on itself."""
    w = AsyncWriter(DumpDirWriter(tmp_path / "d", 0))
    t = torch.ones(4)

    class CloseFromInside:  # stands in for a device event: the writer thread calls synchronize()
        def synchronize(self) -> None:
            assert threading.current_thread() is w._thread
            w.close()

    row = IndexRow.of(Entry(0, 0, "m", "output", "0", "module", 0, dtype="float32", shape=(4,), key="1"))
    w.submit(row, t.clone(), CloseFromInside(), nbytes=t.nbytes)
    w.end_step(0)
    w._thread.join(timeout=30)
    assert not w._thread.is_alive()
    r = LlmflowDumpReader(tmp_path / "d")
    assert r.meta()["complete"] is True and r.problems() == []
    assert [e.name for e in r.entries()] == ["m"]


def test_a_writer_that_fails_at_exit_costs_one_warning_line(tmp_path: Path, monkeypatch, caplog) -> None:
    from llmflow.dump import capture
    from llmflow.formats import llmflow_dump

    model = build_tiny("llama", SPEC)
    register_hook(model, DumpConfig(dump_path=str(tmp_path), token_range="all"))
    with torch.no_grad():
        model(IDS)
    session = next(s for s in gc.get_objects() if isinstance(s, capture.DumpSession)
                   and s.dump_dir.parent == tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(llmflow_dump, "atomic_write_json", full_disk)  # the close's last writes
    session._finalizer()  # what the interpreter's exit (or the model's collection) runs
    assert "could not be finished" in caplog.text and "No space left" in caplog.text
    assert LlmflowDumpReader(tmp_path / "llmflow_dump").meta()["complete"] is False
    del model


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
