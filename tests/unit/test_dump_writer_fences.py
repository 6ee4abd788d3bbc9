"""The writer and copies queued on a CUDA stream: one event per stream, recorded at step ends and
every ``wake_bytes`` of copies (a fence), and nothing of those copies read before a fence has passed.

No GPU is needed: the copies here are CPU tensors handed over with a stream's key, and the fence's
events are stand-ins that log when the writer waits on them. ``tests/functional/test_cuda_paths.py``
runs the same path on a real GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmflow.dump import writer as dump_writer
from llmflow.dump.copies import TensorKeeper
from llmflow.dump.writer import AsyncWriter
from llmflow.formats.base import Entry
from llmflow.formats.llmflow_dump import DumpDirWriter, IndexRow, LlmflowDumpReader

STREAM_A = (3, 0, 1)  # (stream id, device index, device type): copies.StreamKey
STREAM_B = (5, 0, 1)


class Log:
    """What the writer did, in order: "sync" (it waited on a fence's event), "stats", "write"."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.events: list[str] = []
        self.fences: list[list[tuple[int, int, int]]] = []
        log = self

        class Event:
            def synchronize(self) -> None:
                log.events.append("sync")

        def fence(streams):
            self.fences.append(sorted(streams))
            return [Event() for _ in streams]

        def stats(tensors):
            self.events.append("stats")
            return real_stats(tensors)

        real_stats = dump_writer.batched_stats
        monkeypatch.setattr(dump_writer, "fence", fence)
        monkeypatch.setattr(dump_writer, "batched_stats", stats)

    def spy_on(self, writer: AsyncWriter) -> None:
        real = writer.disk.write_rows

        def write_rows(tensors, rows, **kwargs):
            self.events.append("write")
            return real(tensors, rows, **kwargs)

        writer.disk.write_rows = write_rows


def _row(key: int, step: int, has_data: bool) -> IndexRow:
    return IndexRow.of(Entry(step, key, f"m{key}", "output", "0", "module", key, dtype="float32",
                             shape=(4,), key=str(key), has_data=has_data))


@pytest.mark.parametrize("inline", [True, False])
def test_copies_on_a_stream_are_written_only_after_the_step_ends_fence(tmp_path: Path, monkeypatch, inline):
    log = Log(monkeypatch)
    # a data batch of 16 bytes and a wake every 16 bytes: without the fence, every copy would be
    # written as soon as the writer handled it
    w = AsyncWriter(DumpDirWriter(tmp_path / "d", 0), batch_bytes=16, wake_bytes=1 << 20, inline=inline)
    log.spy_on(w)
    tensors = [torch.full((4,), float(i)) for i in range(1, 6)]
    for i, t in enumerate(tensors, start=1):
        w.submit(_row(i, 0, True), t.clone(), STREAM_A if i % 2 else STREAM_B, nbytes=t.nbytes)
    assert log.fences == [] and "write" not in log.events
    w.end_step(0)
    w.close()
    assert log.fences == [[STREAM_A, STREAM_B]]  # one event per stream for the whole step
    assert log.events.index("sync") < log.events.index("write")
    r = LlmflowDumpReader(tmp_path / "d")
    got = {e.name: r.load(e) for e in r.entries()}
    assert all(torch.equal(got[f"m{i}"], t) for i, t in enumerate(tensors, start=1))


@pytest.mark.parametrize("inline", [True, False])
def test_a_fence_every_wake_bytes_of_copies_and_the_batch_written_at_it(tmp_path: Path, monkeypatch, inline):
    log = Log(monkeypatch)
    w = AsyncWriter(DumpDirWriter(tmp_path / "d", 0), batch_bytes=32, wake_bytes=40, inline=inline)
    log.spy_on(w)
    for i in range(1, 11):  # 16 bytes each: a fence after every third
        w.submit(_row(i, 0, True), torch.full((4,), float(i)), STREAM_A, nbytes=16)
    w.end_step(0)
    w.close()
    assert log.fences == [[STREAM_A]] * 4  # at 48, 96 and 144 bytes, then the step's end
    # every data file is written after a wait on a fence, never between a copy and its fence
    assert log.events[0] == "sync" and log.events.count("write") >= 3
    assert all(log.events[k - 1] == "sync" for k, e in enumerate(log.events) if e == "write")
    r = LlmflowDumpReader(tmp_path / "d")
    assert sorted(float(r.load(e)[0]) for e in r.entries()) == [float(i) for i in range(1, 11)]


def test_statistics_of_copies_on_a_stream_are_computed_after_the_fence(tmp_path: Path, monkeypatch):
    log = Log(monkeypatch)
    w = AsyncWriter(DumpDirWriter(tmp_path / "d", 0), batch_bytes=8, inline=True)
    for step in range(2):
        for i in range(1, 4):
            w.submit(_row(i, step, False), torch.full((4,), float(i + 10 * step)), STREAM_A, nbytes=16)
        w.end_step(step)
    w.close()
    assert log.fences == [[STREAM_A], [STREAM_A]] and log.events == ["sync", "stats"] * 2
    r = LlmflowDumpReader(tmp_path / "d")
    maxes = {(e.step, e.name): e.stats["max"] for e in r.entries()}
    assert maxes == {(s, f"m{i}"): float(i + 10 * s) for s in range(2) for i in range(1, 4)}


def test_copies_with_an_event_of_their_own_need_no_fence(tmp_path: Path, monkeypatch):
    """Accelerators other than CUDA hand over an event per copy: the writer waits on it there."""
    log = Log(monkeypatch)

    class Event:
        def synchronize(self) -> None:
            log.events.append("own event")

    w = AsyncWriter(DumpDirWriter(tmp_path / "d", 0), batch_bytes=16, inline=True)
    log.spy_on(w)
    w.submit(_row(1, 0, True), torch.ones(4), Event(), nbytes=16)
    w.end_step(0)
    w.close()
    assert log.fences == [] and log.events == ["own event", "write"]


def test_inline_host_copies_skip_the_queue_only_when_nothing_waits_ahead_of_them(tmp_path: Path, monkeypatch):
    log = Log(monkeypatch)
    w = AsyncWriter(DumpDirWriter(tmp_path / "d", 0), batch_bytes=16, wake_bytes=1 << 20, inline=True)
    log.spy_on(w)
    # nothing queued: straight into the data batch, which is full at once and written
    w.submit(_row(1, 0, True), torch.full((4,), 1.0), None, nbytes=16)
    assert not w._queue and log.events == ["write"]
    # a repeat of it (no data of its own: the key of the data it shares) takes the same way
    repeat = IndexRow.of(Entry(0, 9, "r1", "output", "0", "module", 9, dtype="float32", shape=(4,),
                               key="1", has_data=True))
    w.submit(repeat, None, None)
    assert not w._queue
    # a copy on a stream waits for its fence, and a host copy after it waits behind it
    w.submit(_row(2, 0, True), torch.full((4,), 2.0), STREAM_A, nbytes=16)
    w.submit(_row(3, 0, True), torch.full((4,), 3.0), None, nbytes=16)
    assert len(w._queue) == 2 and log.events == ["write"]
    w.end_step(0)
    w.close()
    assert log.events[1] == "sync" and log.events.count("write") >= 2
    r = LlmflowDumpReader(tmp_path / "d")
    assert sorted(float(r.load(e)[0]) for e in r.entries()) == [1.0, 1.0, 2.0, 3.0]
    assert float(r.load(next(e for e in r.entries() if e.name == "r1"))[0]) == 1.0


def test_inline_held_tensors_of_a_tensor_dump_skip_the_queue_and_are_read_by_the_steps_end(
        tmp_path: Path, monkeypatch):
    """A held tensor (its version as the event) goes straight into the data batch when nothing
    waits ahead of it; the writer still reads it, checking its version, by the step's end: one
    changed in place after its capture is recorded as having no values, never its new ones."""
    log = Log(monkeypatch)
    keeper = TensorKeeper(lambda t: (t.clone(), None), may_hold=True)
    w = AsyncWriter(DumpDirWriter(tmp_path / "d", 0), batch_bytes=1 << 20, inline=True, keeper=keeper)
    log.spy_on(w)
    kept, changed = torch.full((4,), 1.0), torch.full((4,), 2.0)
    w.submit(_row(1, 0, True), kept, kept._version, nbytes=16)
    w.submit(_row(2, 0, True), changed, changed._version, nbytes=16)
    assert not w._queue and log.events == []  # in the batch, nothing read or written yet
    changed.add_(5.0)  # after its capture, before the writer reads it
    w.end_step(0)
    w.close()
    assert "changed in place" in (keeper.why_copying or "")
    r = LlmflowDumpReader(tmp_path / "d")
    by_name = {e.name: e for e in r.entries()}
    assert torch.equal(r.load(by_name["m1"]), torch.full((4,), 1.0))
    assert any("m2" in p for p in r.problems())
