"""Module-mode capture: faithful copies, steps, filters, kwargs, weights, statistics, budgets."""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from llmflow.dump import DumpConfig, register_hook
from llmflow.dump.capture import inline_writer
from llmflow.dump.stats import batched_stats
from llmflow.errors import UserError
from llmflow.formats.base import STAT_KEYS
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.models import greedy_generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import assert_copies_taken_at_capture, bits_equal, by_name, dump, prompt_ids, tiny  # noqa: E402


def test_dump_equals_what_a_plain_forward_hook_sees(tmp_path, writer_mode):
    model = tiny().model
    seen: dict[tuple[int, str], torch.Tensor] = {}
    calls = {"n": -1}

    def root_pre(mod, args, kwargs):
        calls["n"] += 1

    def make(name):
        def hook(mod, args, out):
            first = out[0] if isinstance(out, tuple) else out
            if isinstance(first, torch.Tensor):  # ModelOutput dicts are indexed by key instead
                seen[(calls["n"], name)] = first.detach().clone()
        return hook

    handles = [model.register_forward_pre_hook(root_pre, with_kwargs=True)]
    handles += [m.register_forward_hook(make(n)) for n, m in model.named_modules() if n]
    try:
        r, out = dump(tmp_path, new_tokens=3)
    finally:
        for h in handles:
            h.remove()
    outputs = [e for e in r.entries() if e.level == "module" and e.kind == "output" and e.index == "0"]
    assert {e.step for e in outputs} == {0, 1, 2}  # prefill + one per decode step that ran the model
    checked = 0
    for e in outputs:
        if (e.step, e.name) in seen:
            assert bits_equal(r.load(e), seen[(e.step, e.name)]), (e.step, e.name)
            checked += 1
    assert checked == len(outputs) and checked > 40
    assert len(out) == 3


def test_copy_is_taken_at_capture_time(tmp_path, writer_mode):
    """A module that changes its input in place after a submodule saw it: the dump keeps the old bits."""
    assert_copies_taken_at_capture(tmp_path, torch.randn(2, 3))


def test_token_range_and_logits_every_step(tmp_path):
    r, out = dump(tmp_path, new_tokens=4, token_range=[1, 3])
    es = r.entries()
    assert {e.step for e in es if e.level == "module"} == {1, 3}
    logits = [e for e in es if e.level == "logits"]
    assert [e.step for e in logits] == [0, 1, 2, 3]
    assert all(e.name == "logits" and e.kind == "output" and e.shape == (1, 300) for e in logits)
    # the logits of step s pick the token generated at step s
    assert [int(r.load(e).argmax()) for e in logits] == out


def test_layer_name_module_list_tensor_part(tmp_path):
    r, _ = dump(tmp_path / "a", new_tokens=1, layer_name="root.model.layers.1*")
    names = {e.name for e in r.entries() if e.level == "module"}
    assert names and all(n.startswith("model.layers.1") for n in names)
    assert "model.layers.1.mlp.down_proj" in names

    r, _ = dump(tmp_path / "b", new_tokens=1, module_list=["LlamaDecoderLayer", torch.nn.Embedding],
                tensor_part=1)
    mods = [e for e in r.entries() if e.level == "module"]
    assert {e.module_type for e in mods} == {"LlamaDecoderLayer", "Embedding"}
    assert {e.kind for e in mods} == {"output"}

    r, _ = dump(tmp_path / "c", new_tokens=1, tensor_part=0)
    assert {e.kind for e in r.entries() if e.level == "module"} == {"input"}


def test_kwargs_and_non_tensors_are_recorded(tmp_path):
    r, _ = dump(tmp_path, new_tokens=1, token_range=[0])
    layer = [e for e in r.entries() if e.name == "model.layers.0" and e.kind == "input"]
    idx = {e.index: e for e in layer}
    assert idx["0"].dtype == "float32"
    cos, sin = idx["kw:position_embeddings.0"], idx["kw:position_embeddings.1"]
    assert cos.has_data and sin.has_data and cos.shape == sin.shape
    assert idx["kw:attention_mask"].pytype == "NoneType" and idx["kw:attention_mask"].value is None
    assert idx["kw:use_cache"].value is True and idx["kw:use_cache"].pytype == "bool"
    # the cache's keyword depends on the transformers release (past_key_values, then cache)
    cache = next(idx[k] for k in ("kw:cache", "kw:past_key_values") if k in idx)
    assert cache.pytype == "DynamicCache" and not cache.has_data
    # the same cos tensor reaches every layer: stored once, every entry loads it
    cos1 = by_name(r.entries(), name="model.layers.1", index="kw:position_embeddings.0")[0]
    assert cos1.key == cos.key and bits_equal(r.load(cos1), r.load(cos))
    # order: inputs of a call before its outputs
    out0 = by_name(r.entries(), name="model.layers.0", kind="output")[0]
    assert max(e.order for e in layer) < out0.order


def test_dump_weight_and_last_logits(tmp_path):
    r, _ = dump(tmp_path / "w", new_tokens=1, dump_weight=True, layer_name="model.layers.0.mlp*")
    weights = [e for e in r.entries() if e.kind == "weight"]
    assert weights and all(e.step == -1 and e.level == "weight" for e in weights)
    params = dict(tiny().model.named_parameters())
    assert {e.name for e in weights} == {n for n in params if n.startswith("model.layers.0.mlp")}
    for e in weights:
        assert bits_equal(r.load(e), params[e.name].detach())

    r, out = dump(tmp_path / "l", new_tokens=3, dump_last_logits=True)
    assert {e.level for e in r.entries()} == {"logits"} and len(r.entries()) == len(out)


@pytest.mark.parametrize("crc32", [False, True], ids=["compiled-at-capture", "copied-crc32"])
def test_statistics_mode(tmp_path, writer_mode, crc32):
    """Both ways to statistics: the compiled kernel at capture (CPU float/int tensors), and a copy
    reduced by the writer's ``batched_stats`` (what a CRC32, an accelerator or a machine without
    a compiler gets)."""
    from llmflow.dump.stats import CpuStats

    if not crc32 and CpuStats.create() is None:
        pytest.skip("no compiled statistics here (no C++ compiler)")
    r, _ = dump(tmp_path / "s", new_tokens=2, data_mode="statistics", crc32=crc32)
    rt, _ = dump(tmp_path / "t", new_tokens=2)
    assert r.meta()["data_mode"] == "statistics"
    stored = sum(p.stat().st_size for p in (tmp_path / "s" / "dump" / "rank0" / "data").glob("*"))
    assert stored < 2 * (300 * 4 + 200)  # only the two steps' logits rows hold data
    tensors = {(e.step, e.name, e.kind, e.index): e for e in rt.entries() if e.has_data}
    stats_entries = [e for e in r.entries() if e.dtype is not None and e.level != "logits"]
    assert len(stats_entries) == len(tensors) - 2
    # logits keep their data in statistics mode: compare and bisect need them
    assert all(e.has_data for e in r.entries() if e.level == "logits")
    assert len([e for e in r.entries() if e.level == "logits"]) == 2
    import zlib
    for e in stats_entries:
        assert not e.has_data and e.stats is not None
        t = rt.load(tensors[(e.step, e.name, e.kind, e.index)])
        x = t.double()
        assert e.stats["max"] == pytest.approx(float(x.max()), rel=1e-6)
        assert e.stats["min"] == pytest.approx(float(x.min()), rel=1e-6)
        assert e.stats["mean"] == pytest.approx(float(x.mean()), rel=1e-4, abs=1e-6)
        assert e.stats["norm"] == pytest.approx(float(x.norm()), rel=1e-5)
        assert e.stats["nan"] == 0 and e.stats["inf"] == 0
        if crc32:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert e.extra["crc32"] == zlib.crc32(raw)
        else:
            assert "crc32" not in e.extra
    with pytest.raises(Exception, match="statistics-only"):
        r.load(stats_entries[0])
    # on disk a repeat (a layer's output is the next layer's input) has no statistics of its
    # own, only its first capture's key; the reader gave it that entry's (checked above)
    import json

    from llmflow.formats.llmflow_dump import ROW_FIELDS
    rows = [dict(zip(ROW_FIELDS, row, strict=True))
            for line in (tmp_path / "s" / "dump" / "rank0" / "index.jsonl").read_text().splitlines()
            for row in json.loads(line)["rows"]]
    repeats = [row for row in rows if row["dtype"] and row["stats"] is None and not row["has_data"]]
    assert repeats and all(any(o["key"] == row["key"] and o["stats"] for o in rows) for row in repeats)


def test_batched_stats_counts_nan_inf_and_odd_dtypes():
    ts = [torch.tensor([1.0, float("nan"), float("inf"), -float("inf")]), torch.tensor([1.0, 2.0, 3.0, 4.0]),
          torch.tensor([], dtype=torch.float32), torch.tensor([3, -1], dtype=torch.int64),
          torch.tensor([True, False, True]), torch.tensor([1.5, -2.5], dtype=torch.bfloat16)]
    s = [dict(zip(STAT_KEYS, row, strict=True)) for row in batched_stats(ts)]
    assert s[0]["nan"] == 1 and s[0]["inf"] == 2
    assert s[1] == {"max": 4.0, "min": 1.0, "mean": 2.5, "norm": pytest.approx(math.sqrt(30)), "nan": 0.0,
                    "inf": 0.0}
    assert math.isnan(s[2]["max"]) and s[2]["nan"] == 0
    assert s[3]["max"] == 3 and s[3]["min"] == -1 and s[4]["mean"] == pytest.approx(2 / 3)
    assert s[5]["max"] == 1.5 and s[5]["min"] == -2.5


def test_compiled_stats_equal_batched_stats():
    """The kernel behind statistics at capture gives ``batched_stats``'s numbers for every dtype it
    takes: odd lengths (the vector loop's tail), NaN (max, min, mean and norm NaN, as torch),
    Inf, bfloat16/float16 read as they are, int64 beyond float32's integers; a large tensor's
    as float64 gives them."""
    from llmflow.dump.stats import KERNEL_DTYPES, CpuStats

    stats = CpuStats.create()
    if stats is None:
        pytest.skip("no compiled statistics here (no C++ compiler)")
    gen = torch.Generator().manual_seed(3)
    floats = [torch.randn(n, generator=gen) * 5 for n in (1, 63, 64, 65, 4097)]
    inf, nan = float("inf"), float("nan")
    floats += [torch.tensor([2.0, inf, -1.0] * 30), torch.tensor([1.0, nan, -inf] * 30)]
    ints = [torch.tensor([7]), torch.tensor([2**40 + 1, -3, 5]),
            torch.randint(-1000, 1000, (333,), generator=gen)]
    for dtype, code in KERNEL_DTYPES.items():
        for t in floats if dtype.is_floating_point else ints:
            t = t.to(dtype)
            got, want = stats(t, code), batched_stats([t])[0]
            assert got[4:] == want[4:], (dtype, t)  # counts: exact
            for g, w in zip(got[:4], want[:4], strict=True):
                assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w, rel=1e-5, abs=1e-6), dtype
    assert stats(torch.tensor([1.0, float("nan")]), 0)[:4] == pytest.approx([math.nan] * 4, nan_ok=True)
    # NaN and Inf are counted in a second pass, run when the sums are not finite: one NaN or Inf
    # in the vector loop or in its tail is counted, and squares that overflow float32 count none
    for where in (0, 63, 64, 200):
        for bad, counts in ((nan, [1.0, 0.0]), (inf, [0.0, 1.0]), (-inf, [0.0, 1.0])):
            t = torch.ones(201)
            t[where] = bad
            assert stats(t, 0)[4:] == counts, (where, bad)
    huge = stats(torch.tensor([3e19, -2.0] * 40), 0)
    assert huge[:3] == pytest.approx([3e19, -2.0, 1.5e19 - 1.0]) and huge[4:] == [0.0, 0.0]
    # a million elements: against float64, which the kernel's blockwise sums follow more closely
    # than torch's float32 reductions (a norm 1.2e-5 off here)
    big = torch.randn((1 << 20) + 3, generator=gen) * 5
    x = big.double()
    want = [float(x.max()), float(x.min()), float(x.mean()), float(x.norm()), 0.0, 0.0]
    assert stats(big, 0) == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_statistics_without_a_compiler_fall_back_to_torch(tmp_path, monkeypatch, caplog):
    """No working compiler: one warning, then statistics from copies and ``batched_stats``, the
    same numbers."""
    from llmflow.dump import stats

    monkeypatch.setenv("LLMFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(stats, "_kernel", None)
    r, _ = dump(tmp_path / "s", new_tokens=1, data_mode="statistics")
    assert "dump statistics kernel unavailable" in caplog.text and stats.CpuStats.create() is None
    monkeypatch.undo()
    rt, _ = dump(tmp_path / "t", new_tokens=1)
    tensors = {(e.step, e.name, e.kind, e.index): e for e in rt.entries() if e.has_data}
    checked = 0
    for e in r.entries():
        if e.dtype is not None and e.level != "logits":
            t = rt.load(tensors[(e.step, e.name, e.kind, e.index)])
            assert e.stats["max"] == float(t.max())
            assert e.stats["norm"] == pytest.approx(float(t.double().norm()))
            checked += 1
    assert checked > 20


def test_data_files_at_most_once_per_data_seconds(tmp_path, monkeypatch):
    """Index rows go out at every step end; tensor data at the first step end ``data_seconds``
    after the last data file (or every ``batch_bytes``), and all of it at close: fewer files,
    the same dump."""
    from llmflow.dump import writer

    def take(data_seconds: float, out: Path) -> tuple[LlmflowDumpReader, int]:
        monkeypatch.setitem(writer.AsyncWriter.__init__.__kwdefaults__, "data_seconds", data_seconds)
        r, _ = dump(out, new_tokens=3)
        return r, len(list((out / "dump" / "rank0" / "data").glob("*.safetensors")))

    each, n_each = take(0.0, tmp_path / "each")
    once, n_once = take(3600.0, tmp_path / "once")
    assert len(each.steps()) == 3 and n_each == 3  # one file per step
    assert n_once == 2  # the first step's, then the rest at close
    a, b = each.entries(), once.entries()
    assert [(e.step, e.name, e.kind, e.index) for e in a] == [(e.step, e.name, e.kind, e.index) for e in b]
    assert all(bits_equal(each.load(x), once.load(y)) for x, y in zip(a, b, strict=True) if x.has_data)


def test_max_bytes_stops_cleanly(tmp_path, caplog, writer_mode):
    r, out = dump(tmp_path, new_tokens=3, max_bytes=20_000)
    assert len(out) == 3  # generation went on
    meta = r.meta()
    assert meta["complete"] and meta["truncated"]
    assert "max_bytes=20000" in meta["ranks"][0]["stop_reason"]
    assert "max_bytes=20000" in caplog.text
    data = sum(p.stat().st_size for p in (tmp_path / "dump" / "rank0" / "data").glob("*.safetensors"))
    assert 0 < data <= 20_000 + 4096  # tensor bytes within budget (+ safetensors headers)
    for e in r.entries():
        if e.has_data:
            r.load(e)


def test_plain_forward_loop_counts_steps(tmp_path):
    """Without generate (no KV cache): each root forward is one step, one dump for the sequence."""
    model = tiny().model
    h = register_hook(model, DumpConfig(dump_path=str(tmp_path), token_range="all", module_list=["LlamaMLP"]))
    ids = torch.tensor([prompt_ids()])
    with torch.no_grad():
        for _ in range(3):
            nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    h.remove()
    assert len(h.dumps) == 1
    r = LlmflowDumpReader(h.dumps[0])
    assert r.steps() == [0, 1, 2]


def test_register_hook_validates_and_remove_restores(tmp_path):
    model = tiny().model
    before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    h = register_hook(model, DumpConfig(dump_path=str(tmp_path), mode="all"))
    greedy_generate(model, prompt_ids(), 1)
    h.remove()
    after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert before == after
    assert torch.overrides._get_current_function_mode_stack() == []
    assert LlmflowDumpReader(h.dumps[0]).meta()["complete"]
    from llmflow.errors import UserError
    with pytest.raises(UserError, match="hook_type"):
        register_hook(model, DumpConfig(), hook_type="overflow_check")
    with pytest.raises(UserError, match="DumpConfig"):
        register_hook(model, {"dump_path": "."})


def test_device_id_filters_and_says_so_on_the_cpu(tmp_path, caplog):
    model = tiny().model
    with caplog.at_level(logging.WARNING, logger="llmflow"):
        h = register_hook(model, DumpConfig(dump_path=str(tmp_path / "x"), device_id=1))
    greedy_generate(model, prompt_ids(), 1)
    h.remove()
    assert h.dumps == [] and not (tmp_path / "x").exists()
    assert "DumpConfig(device_id=1), but the model runs on cpu: this process dumps nothing" in caplog.text
    caplog.clear()
    h = register_hook(model, DumpConfig(dump_path=str(tmp_path / "y"), device_id=0))  # the CPU: device 0
    greedy_generate(model, prompt_ids(), 1)
    h.remove()
    assert len(h.dumps) == 1 and "dumps nothing" not in caplog.text


def test_remove_restores_every_forward_including_one_another_tool_set(tmp_path):
    """Submodules record through a wrapper on the instance; remove() puts back exactly what was
    there, also a forward another tool (accelerate's hooks, say) had already put on the instance."""
    model = tiny().model
    layer0 = model.model.layers[0]
    calls = []
    plain = layer0.mlp.forward  # the class's bound method

    def tool_forward(*args, **kwargs):  # what an accelerate-style hook leaves on an instance
        calls.append(1)
        return plain(*args, **kwargs)

    layer0.mlp.forward = tool_forward
    try:
        handle = register_hook(model, DumpConfig(dump_path=str(tmp_path / "d"), token_range="all"))
        greedy_generate(model, prompt_ids(), 2)
        handle.remove()
        assert layer0.mlp.__dict__["forward"] is tool_forward
    finally:
        del layer0.mlp.forward  # the tiny model is shared by the other tests
    assert calls, "the tool's forward still ran under the dump"
    assert all("forward" not in m.__dict__ for _, m in model.named_modules())
    names = {e.name for e in LlmflowDumpReader(tmp_path / "d" / "llmflow_dump").entries()}
    assert "model.layers.0.mlp" in names and "model.layers.0.mlp.down_proj" in names


def test_writer_choice_auto_env_and_bad_value(monkeypatch):
    """auto: inline where torch's threads take every core of a CPU model and for a model on an
    accelerator (launch-bound: the thread would take the GIL from it), else a thread."""
    model = tiny().model
    on_device = torch.nn.Linear(2, 2, device="meta")  # (any device but the CPU)
    monkeypatch.delenv("LLMFLOW_DUMP_WRITER", raising=False)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert inline_writer(model) and inline_writer(on_device)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores + 4)))
    assert not inline_writer(model)
    assert inline_writer(on_device)
    monkeypatch.setenv("LLMFLOW_DUMP_WRITER", "inline")
    assert inline_writer(model)
    monkeypatch.setenv("LLMFLOW_DUMP_WRITER", "threads")
    with pytest.raises(UserError, match="LLMFLOW_DUMP_WRITER.*'threads'"):
        register_hook(model, DumpConfig(dump_path="unused"))


@pytest.mark.filterwarnings("error::UserWarning")  # reported once, not again from torch's hooks
@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_a_failing_write_is_reported_not_swallowed(tmp_path, monkeypatch, mode):
    """A write that fails (a full disk, say) surfaces in the forward thread and the dump is
    not marked complete, whichever way it is written."""
    from llmflow.formats import llmflow_dump

    monkeypatch.setenv("LLMFLOW_DUMP_WRITER", mode)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(llmflow_dump, "write_safetensors", full_disk)
    loaded = tiny()
    with pytest.raises(RuntimeError, match="dump writer failed.*No space left"):
        dump(tmp_path, new_tokens=2, loaded=loaded)
    monkeypatch.undo()
    assert not LlmflowDumpReader(tmp_path / "dump").meta()["complete"]
    # and the hooks are off the model: the next run of it writes nothing here
    assert not loaded.model._forward_pre_hooks and not loaded.model._forward_hooks
    assert all("forward" not in m.__dict__ for m in loaded.model.modules())
    greedy_generate(loaded.model, prompt_ids(), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]


def test_a_close_that_fails_still_takes_the_hooks_off(tmp_path, monkeypatch):
    """The writer thread's failure can surface first when the dump closes: the model (shared by
    the caller) must come back without our hooks all the same."""
    from llmflow.dump.capture import DumpSession

    def failing_close(self, complete=True):
        raise RuntimeError("dump writer failed: [Errno 28] No space left on device")

    monkeypatch.setattr(DumpSession, "close", failing_close)
    loaded = tiny()
    with pytest.raises(RuntimeError, match="No space left"):
        dump(tmp_path, new_tokens=1, loaded=loaded)
    monkeypatch.undo()
    assert not loaded.model._forward_pre_hooks and not loaded.model._forward_hooks
    assert all("forward" not in m.__dict__ for m in loaded.model.modules())


def test_writer_thread_leaves_the_models_thread_count_alone(tmp_path, monkeypatch):
    """The writer limits its own torch ops to one thread; the setting must stay in its thread."""
    monkeypatch.setenv("LLMFLOW_DUMP_WRITER", "thread")
    before = torch.get_num_threads()
    dump(tmp_path, new_tokens=1, data_mode="statistics")
    assert torch.get_num_threads() == before


def test_output_changed_by_an_existing_forward_hook_is_what_gets_dumped(tmp_path):
    """A patch that rewrites a module's output with a forward hook (a fault injected, say):
    the dump holds what the call really returned, as downstream modules see it."""
    model = tiny().model
    target = model.model.layers[1].mlp.down_proj

    def inject(_m, _args, out):
        return out + 1000.0

    handle = target.register_forward_hook(inject)
    try:
        r, _ = dump(tmp_path, new_tokens=1, token_range=[0])
    finally:
        handle.remove()
    out = by_name(r.entries(), name="model.layers.1.mlp.down_proj",
                  kind="output", index="0")
    assert len(out) == 1 and float(r.load(out[0]).mean()) > 500.0


def test_plain_values_subclasses_and_parameters_each_get_their_row(tmp_path):
    """Keyword values of an exact plain type (None, bool, int, float), a subclass of one (an
    IntEnum), text, a torch dtype and a Parameter: each is one row with its value and type name,
    and a parameter's row holds its shape, dtype and name."""
    import enum

    class Axis(enum.IntEnum):
        LAST = -1

    class Inner(torch.nn.Module):
        def forward(self, x: torch.Tensor, **_values: object) -> torch.Tensor:
            return x * 2

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()
            self.scale = torch.nn.Parameter(torch.ones(3, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x, none=None, flag=True, count=3, eps=2.5, axis=Axis.LAST, text="left",
                              dtype=torch.bfloat16, weight=self.scale)

    model = Outer()
    handle = register_hook(model, DumpConfig(dump_path=str(tmp_path / "dump"), data_mode="statistics"))
    model(torch.ones(2, 3))
    handle.remove()
    rows = {e.index: e for e in LlmflowDumpReader(handle.dumps[0]).entries()
            if e.name == "inner" and e.kind == "input"}
    got = {k: (e.value, e.pytype) for k, e in rows.items() if k != "0"}
    assert got == {"kw:none": (None, "NoneType"), "kw:flag": (True, "bool"), "kw:count": (3, "int"),
                   "kw:eps": (2.5, "float"), "kw:axis": (-1, "Axis"), "kw:text": ("left", "str"),
                   "kw:dtype": ("torch.bfloat16", "dtype"), "kw:weight": (None, "Parameter")}
    assert type(rows["kw:flag"].value) is bool and type(rows["kw:count"].value) is int
    weight = rows["kw:weight"]
    assert weight.shape == (3, 2) and not weight.has_data
    assert weight.extra == {"param_dtype": "float32", "param": "scale"}
    assert [e.order for e in sorted(rows.values(), key=lambda e: e.order)] == list(range(len(rows)))


def test_inference_tensors_are_recorded_each_time_they_are_seen(tmp_path):
    """Tensors made under ``torch.inference_mode`` have no version counter: a tensor passed on
    is recorded again with statistics of its own rather than pointed at its first capture."""

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Identity()
            self.second = torch.nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x))

    model = Twice()
    handle = register_hook(model, DumpConfig(dump_path=str(tmp_path / "dump"), data_mode="statistics"))
    with torch.inference_mode():
        model(torch.arange(6, dtype=torch.float32))
    handle.remove()
    rows = [e for e in LlmflowDumpReader(handle.dumps[0]).entries() if e.level == "module"]
    assert [(e.name, e.kind) for e in rows] == [("first", "input"), ("first", "output"),
                                                ("second", "input"), ("second", "output")]
    assert len({e.key for e in rows}) == 4
    assert all(e.stats["max"] == 5.0 and e.stats["mean"] == 2.5 for e in rows)


class _Tagged(torch.Tensor):
    """A tensor subclass over plain storage (as a library tags its tensors)."""


class _NoStorage(torch.Tensor):
    """A wrapper subclass with no storage of its own (as a quantized tensor type is): any op on it
    is refused, so the dump must not touch its data."""

    @staticmethod
    def __new__(cls, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a tensor without storage")


class _Unwrapping(torch.Tensor):
    """A wrapper subclass whose ops run on the tensor it wraps and come back wrapped (as a float8
    or NF4 tensor type's do): an alias of it is itself again, never a plain tensor."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        made.inner = inner
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda v: v.inner if isinstance(v, _Unwrapping) else v  # noqa: E731
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return _Unwrapping(out) if isinstance(out, torch.Tensor) else out


class _SubclassOutputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tagged = torch.nn.Linear(4, 4)
        self.wrapped = torch.nn.Identity()
        self.unwrapping = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tagged(x).as_subclass(_Tagged)
        self.wrapped(_NoStorage(y))  # outputs the model does not use further
        self.unwrapping(_Unwrapping(y.as_subclass(torch.Tensor)))
        return y.as_subclass(torch.Tensor) * 2


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-capture", "python-capture"])
def test_tensor_subclasses_are_dumped_as_their_plain_data_or_recorded_as_not_stored(tmp_path, compiled):
    from llmflow.dump import capture

    model, x = _SubclassOutputs(), torch.randn(2, 4)
    was = capture.use_compiled_capture(compiled)
    try:
        handle = register_hook(model, DumpConfig(dump_path=str(tmp_path / "d"), token_range="all"))
        with torch.no_grad():
            model(x)
            expected = torch.nn.functional.linear(x, model.tagged.weight, model.tagged.bias)
        handle.remove()
    finally:
        capture.use_compiled_capture(was)
    r = LlmflowDumpReader(tmp_path / "d" / "llmflow_dump")
    entries = {(e.name, e.kind, e.index): e for e in r.entries() if e.step == 0}
    assert bits_equal(r.load(entries[("tagged", "input", "0")]), x)
    tagged = r.load(entries[("tagged", "output", "0")])
    assert type(tagged) is torch.Tensor and bits_equal(tagged, expected)
    for name, cls in (("wrapped", "_NoStorage"), ("unwrapping", "_Unwrapping")):
        for kind in ("input", "output"):
            wrapped = entries[(name, kind, "0")]
            assert not wrapped.has_data and wrapped.shape == (2, 4) and wrapped.dtype == "float32"
            assert wrapped.extra["not_stored"] == f"a {cls} holds no plain tensor to copy"
