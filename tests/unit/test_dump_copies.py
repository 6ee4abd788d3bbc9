"""A tensor dump's copies as bytes, the data file written from them, and the writer's objects
against the garbage collector: the same dump, fewer and untracked objects."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from llmflow.collector import DEFERRED_YOUNG_THRESHOLD
from llmflow.dump import DumpConfig, register_hook
from llmflow.dump import writer as dump_writer
from llmflow.dump.copies import host_copy, to_host
from llmflow.formats.llmflow_dump import (
    SAFETENSORS_DTYPES,
    DumpDirWriter,
    IndexRow,
    LlmflowDumpReader,
    new_row,
    write_safetensors,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import bits_equal, dump, tiny  # noqa: E402


def _memory(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"1": torch.randn(2, 3, generator=gen), "2": torch.randn(5, generator=gen).to(torch.bfloat16),
            "3": torch.arange(7, dtype=torch.int64), "4": torch.tensor([True, False]),
            "5": torch.randn(3, generator=gen).half(), "6": torch.tensor(2.5), "7": torch.empty(0, 4),
            'k"é': torch.ones(2, dtype=torch.int32)}  # a key JSON must escape


@pytest.mark.parametrize("key", list(_tensors()))
def test_host_copy_of_a_contiguous_cpu_tensor_is_its_memory_as_of_now(key):
    t = _tensors()[key].clone()
    want = _memory(t)
    payload, event = host_copy(t)
    if t.numel():
        t.view(-1)[0] = 0  # changed in place after the capture
    assert event is None and type(payload) is bytes and payload == want


def test_views_whose_memory_is_not_their_values_are_cloned():
    z = torch.complex(torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0]))
    negated = z.conj().imag  # a lazily negated view: its memory holds 3, 4; its values -3, -4
    assert negated.is_neg()
    transposed = torch.randn(3, 4).t()

    class Marked(torch.Tensor):
        pass

    marked = torch.randn(3).as_subclass(Marked)
    for view in (negated, z.conj(), transposed, marked):
        payload, _ = host_copy(view)
        assert isinstance(payload, torch.Tensor)
        assert torch.equal(payload.resolve_conj().resolve_neg(), view.resolve_conj().resolve_neg())


def test_a_negated_view_is_dumped_with_its_values(tmp_path):
    class Imag(torch.nn.Module):
        def forward(self, z):
            return z.conj().imag

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.imag = Imag()

        def forward(self, z):
            return self.imag(z) * 1

    z = torch.complex(torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0]))
    model = Outer()
    h = register_hook(model, DumpConfig(dump_path=str(tmp_path / "d")))
    model(z)
    h.remove()
    r = LlmflowDumpReader(h.dumps[0])
    (out,) = [e for e in r.entries() if e.name == "imag" and e.kind == "output"]
    assert torch.equal(r.load(out), torch.tensor([-3.0, -4.0]))


def test_a_data_file_from_bytes_is_the_file_from_tensors(tmp_path):
    tensors = _tensors()
    as_bytes = {k: _memory(t) for k, t in tensors.items()}
    layouts = {k: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()}
    write_safetensors(tmp_path / "t.safetensors", tensors)
    write_safetensors(tmp_path / "b.safetensors", as_bytes, layouts)
    data = (tmp_path / "t.safetensors").read_bytes()
    assert (tmp_path / "b.safetensors").read_bytes() == data
    # the header is the text json.dumps gives for it (what this file format has always held)
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    assert data[8:8 + len(head)] == head
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        for k, t in tensors.items():
            assert bits_equal(f.get_tensor(k), t), k


def _rows(n: int, step: int) -> list[IndexRow]:
    return [new_row(IndexRow, (step, f"model.layers.{i % 30}.mlp", "output", "0", "module", i, "float32",
                               tuple(torch.Size([1, 1, 8])), "LlamaMLP", None, True, None, None,
                               str(step * n + i), {})) for i in range(n)]


def test_rows_waiting_for_their_data_file_are_not_tracked_by_the_garbage_collector(tmp_path):
    """A second of a tensor dump is tens of thousands of rows waiting for their data file: tracked,
    they would add up to a full collection of every object in the process."""
    w = dump_writer.AsyncWriter(DumpDirWriter(tmp_path / "d"), inline=True, data_seconds=3600.0)
    payload = _memory(torch.ones(1, 1, 8))
    w.submit(_rows(1, 0)[0], payload, None, nbytes=len(payload))
    w.end_step(0)  # the first step end writes its data at once; the later ones wait data_seconds
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    for step in (1, 2):
        for row in _rows(1000, step):
            w.submit(row, payload, None, nbytes=len(payload))
        w.end_step(step)
    gc.collect()  # (a row can come before its shape in the collector's pass: untracked at the next)
    gc.collect()
    tracked = [o for o in gc.get_objects() if type(o) in (tuple, IndexRow) and id(o) not in before]
    assert len(tracked) < 20, f"{len(tracked)} tuples tracked while 2000 rows wait for their data file"
    w.close()
    r = LlmflowDumpReader(tmp_path / "d")
    entries = r.entries()
    assert len(entries) == 2001
    assert {e.key.split(":")[0] for e in entries[1:]} == {"rank0/data/000001.safetensors"}  # written at close
    assert all(bits_equal(r.load(e), torch.ones(1, 1, 8)) for e in entries[::250])


def _collection_during_writes(monkeypatch) -> list[bool]:
    """Whether garbage collection was on at each data-file write, in order."""
    seen: list[bool] = []
    real = DumpDirWriter.write_rows

    def write_rows(self, tensors, rows, **kwargs):
        seen.append(gc.isenabled())
        return real(self, tensors, rows, **kwargs)

    monkeypatch.setattr(DumpDirWriter, "write_rows", write_rows)
    return seen


def test_collections_are_paused_only_while_a_batch_is_written(tmp_path, monkeypatch):
    w = dump_writer.AsyncWriter(DumpDirWriter(tmp_path / "d"), inline=True)
    seen = _collection_during_writes(monkeypatch)
    payload = _memory(torch.ones(3))
    assert gc.isenabled()
    w.submit(_rows(1, 0)[0], payload, None, nbytes=len(payload))
    w.end_step(0)
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a process that switched collection off keeps it off
    try:
        w.submit(_rows(1, 1)[0], payload, None, nbytes=len(payload))
        w.close()
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()


def test_the_writer_thread_never_pauses_the_users_collections(tmp_path, monkeypatch):
    """From its own thread the writer would pause collection for the user's code too."""
    w = dump_writer.AsyncWriter(DumpDirWriter(tmp_path / "d"), inline=False)
    seen = _collection_during_writes(monkeypatch)
    payload = _memory(torch.ones(3))
    w.submit(_rows(1, 0)[0], payload, None, nbytes=len(payload))
    w.end_step(0)
    w.close()
    assert seen and all(seen)


def test_a_write_that_fails_leaves_collection_on(tmp_path, monkeypatch):
    w = dump_writer.AsyncWriter(DumpDirWriter(tmp_path / "d"), inline=True)

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dump_writer.DumpDirWriter, "write_rows", full_disk)
    payload = _memory(torch.ones(3))
    w.submit(_rows(1, 0)[0], payload, None, nbytes=len(payload))
    with pytest.raises(RuntimeError, match="No space left"):
        w.end_step(0)
    assert gc.isenabled()


def test_a_data_file_from_memoryviews_is_the_file_from_tensors(tmp_path):
    """Held tensors reach the data file as byte views of one host buffer (``copies.to_host``)."""
    tensors = _tensors()
    views = to_host(list(tensors.values()))
    assert all(type(v) is memoryview for v in views)
    layouts = {k: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()}
    write_safetensors(tmp_path / "t.safetensors", tensors)
    write_safetensors(tmp_path / "m.safetensors", dict(zip(tensors, views, strict=True)), layouts)
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "t.safetensors").read_bytes()


def test_to_host_gives_each_tensors_values_in_order():
    """Every dtype, views that are not contiguous, a 0-d and an empty tensor: each one's bytes
    are its values in order, as its contiguous copy holds them."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = [base.t(), base[:, 1::2], torch.tensor(3.5), torch.empty(0, 3), base.to(torch.bfloat16).t(),
               torch.tensor([True, False, True]), torch.arange(5, dtype=torch.int64)[::2], base]
    for t, got in zip(tensors, to_host(tensors), strict=True):
        assert bytes(got) == _memory(t.contiguous()), t


# -- young collections deferred while a step records (collector.defer_young_collections) --------
def _thresholds_inside_steps(model: torch.nn.Module) -> tuple[list[tuple[int, ...]], Any]:
    """The collector's thresholds each time the first decoder layer starts, and the hook's handle."""
    seen: list[tuple[int, ...]] = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda *_: seen.append(gc.get_threshold()))
    return seen, handle


@pytest.mark.parametrize("mode", ["module", "api"])
def test_young_collections_wait_for_the_end_of_each_recorded_step(tmp_path, mode):
    loaded = tiny()
    before = gc.get_threshold()
    seen, handle = _thresholds_inside_steps(loaded.model)
    try:
        dump(tmp_path, new_tokens=4, loaded=loaded, mode=mode, token_range=[0, 2])
    finally:
        handle.remove()
    deferred = (DEFERRED_YOUNG_THRESHOLD, *before[1:])
    assert seen == [deferred, before, deferred, before]  # steps 0 and 2 recorded, 1 and 3 not
    assert gc.get_threshold() == before


def test_an_api_dump_runs_no_young_collection_inside_a_step(tmp_path):
    """~1,300 entries a step live until the step's end: without the deferral they set off a young
    collection every ~700."""
    loaded = tiny("tiny-llama:layers=8,hidden=64,heads=4,kv_heads=2,intermediate=128")
    inside: list[int] = []
    steps = {"in": False}

    def count(phase: str, info: dict) -> None:
        if phase == "start" and steps["in"]:
            inside.append(info["generation"])

    pre = loaded.model.register_forward_pre_hook(lambda *_: steps.update({"in": True}))
    post = loaded.model.register_forward_hook(lambda *_: steps.update({"in": False}))
    gc.callbacks.append(count)
    try:
        r, _ = dump(tmp_path, new_tokens=3, loaded=loaded, mode="api")
    finally:
        gc.callbacks.remove(count)
        pre.remove()
        post.remove()
    assert len(r.entries()) > 3 * 1000 and inside == []


def test_thresholds_the_user_sets_during_a_step_are_kept(tmp_path):
    loaded = tiny()
    before = gc.get_threshold()

    def users_setting(*_args):
        gc.set_threshold(5000, *before[1:])

    handle = loaded.model.model.layers[0].register_forward_pre_hook(users_setting)
    try:
        dump(tmp_path, new_tokens=1, loaded=loaded, mode="api")
        assert gc.get_threshold() == (5000, *before[1:])
    finally:
        handle.remove()
        gc.set_threshold(*before)


def test_collection_switched_off_by_a_zero_threshold_stays_off(tmp_path):
    loaded = tiny()
    before = gc.get_threshold()
    gc.set_threshold(0, *before[1:])
    try:
        seen, handle = _thresholds_inside_steps(loaded.model)
        try:
            dump(tmp_path, new_tokens=1, loaded=loaded, mode="api")
        finally:
            handle.remove()
        assert seen == [(0, *before[1:])] and gc.get_threshold() == (0, *before[1:])
    finally:
        gc.set_threshold(*before)


def test_a_step_that_raises_or_a_dump_closed_mid_step_puts_the_thresholds_back(tmp_path):
    loaded = tiny()
    before = gc.get_threshold()

    def boom(*_args):
        raise ValueError("kernel failed")

    handle = loaded.model.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(ValueError, match="kernel failed"):
            dump(tmp_path / "raised", new_tokens=2, loaded=loaded, mode="api")
    finally:
        handle.remove()
    assert gc.get_threshold() == before

    from llmflow.dump import hooks

    def close_now(*_args):  # (as an exit from inside a forward closes the dump)
        for h in list(hooks._HANDLES):
            if h.session is not None:
                h.session.close()

    handle = loaded.model.model.layers[1].register_forward_pre_hook(close_now)
    try:
        dump(tmp_path / "closed", new_tokens=1, loaded=loaded)
    finally:
        handle.remove()
    assert gc.get_threshold() == before


def test_every_dtype_the_dump_stores_reads_back_as_itself(tmp_path):
    """The dump writes every dtype safetensors has a code for (complex64: Llama 4's rotary hands
    its attention complex angles); the reader takes each back, values and dtype alike."""
    class Angles(torch.nn.Module):
        def forward(self, x):
            return x

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.angles = Angles()

        def forward(self, hidden, value):  # (a float first input: an integer one would start a new run)
            return self.angles(value)

    values = {dtype: torch.arange(6).reshape(2, 3).to(dtype) for dtype in SAFETENSORS_DTYPES}
    values[torch.complex64] = torch.polar(torch.ones(2, 3), torch.arange(6.0).reshape(2, 3))
    model = Outer()
    h = register_hook(model, DumpConfig(dump_path=str(tmp_path / "d"), token_range="all"))
    for t in values.values():
        model(torch.ones(2, 3), t)
    h.remove()
    r = LlmflowDumpReader(h.dumps[0])
    read = [r.load(e) for e in sorted(r.entries(), key=lambda e: e.step)
            if e.name == "angles" and e.kind == "output"]
    assert [t.dtype for t in read] == list(values)
    for got, want in zip(read, values.values(), strict=True):
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), want.dtype
