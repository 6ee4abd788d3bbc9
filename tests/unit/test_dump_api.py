"""API mode, dialogue turns (two prompts, two dumps), set_dump_path and save()."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import llmflow
from llmflow.dump import DumpConfig, register_hook, save, set_dump_path
from llmflow.dump.api import api_name
from llmflow.dump.hooks import _PATH
from llmflow.dump.recorder import Sink
from llmflow.errors import UserError
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.models import greedy_generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import bits_equal, by_name, dump, prompt_ids, tiny  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_dump_path():
    saved = dict(_PATH)
    yield
    _PATH.update(saved)


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = x @ self.w          # operator
        y = y.add(1.0)          # Tensor method
        y = torch.tanh(y) + y   # torch function + operator
        z = self.inner(y.view(-1, 4))  # view: layout only, passed through
        return z.softmax(-1)


def test_api_mode_catches_operators_methods_and_names_by_module(tmp_path):
    model = Toy()
    x = torch.randn(2, 4)
    h = register_hook(model, DumpConfig(dump_path=str(tmp_path), mode="api"))
    with torch.no_grad():
        expected = model(x)
    h.remove()
    r = LlmflowDumpReader(h.dumps[0])
    es = r.entries()
    names = list(dict.fromkeys(e.name for e in es if e.level == "api"))
    assert names == ["/matmul.0", "/add.0", "/tanh.0", "/add.1", "inner/linear.0", "/softmax.0"]
    assert not any("view" in n or "size" in n or "__get__" in n for n in names)
    mm_in = by_name(es, name="/matmul.0", kind="input")
    assert bits_equal(r.load(mm_in[0]), x)
    assert mm_in[1].pytype == "Parameter" and not mm_in[1].has_data and mm_in[1].shape == (4, 4)
    assert bits_equal(r.load(by_name(es, name="/softmax.0", kind="output")[0]), expected)
    assert r.topology()["execution"]["0"]["0"][:2] == ["/matmul.0", "/add.0"]


def test_api_names():
    assert api_name(torch.Tensor.__matmul__) == "matmul"
    assert api_name(torch.Tensor.__radd__) == "add"
    assert api_name(torch.Tensor.__iadd__) == "add_"
    assert api_name(torch.Tensor.__truediv__) == "div"
    assert api_name(torch.nn.functional.linear) == "linear"
    for skipped in (torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__getitem__, torch.Tensor.view,
                    torch._C._set_grad_enabled, torch.Tensor.__repr__):
        assert api_name(skipped) is None


def test_api_and_module_mode_together_on_llama(tmp_path):
    r, out = dump(tmp_path, new_tokens=2, mode="all", token_range=[1])
    es = r.entries()
    apis = {e.name for e in es if e.level == "api"}
    assert "model.layers.0.self_attn.q_proj/linear.0" in apis
    assert any(n.startswith("model.layers.1.mlp.act_fn/silu") for n in apis)
    assert any(n.startswith("model.layers.0.input_layernorm/pow") for n in apis)
    assert {e.level for e in es} == {"api", "module", "logits"}
    # module outputs and the api that computed them agree bit for bit
    lin = by_name(es, name="model.layers.0.self_attn.q_proj/linear.0", kind="output")[0]
    mod = by_name(es, name="model.layers.0.self_attn.q_proj", kind="output")[0]
    assert bits_equal(r.load(lin), r.load(mod))
    assert torch.overrides._get_current_function_mode_stack() == []


def test_two_prompts_two_dumps(tmp_path):
    lm = tiny()
    cfg = DumpConfig(dump_path=str(tmp_path), token_range="all", module_list=["LlamaMLP"])
    h = register_hook(lm.model, cfg)
    a = greedy_generate(lm.model, prompt_ids("first prompt"), 2)
    b = greedy_generate(lm.model, prompt_ids("a second, longer prompt"), 3)
    h.remove()
    assert h.dumps == [tmp_path / "llmflow_dump", tmp_path / "llmflow_dump_1"]
    ra, rb = (LlmflowDumpReader(d) for d in h.dumps)
    assert ra.steps() == [0, 1] and rb.steps() == [0, 1, 2]
    assert ra.meta()["complete"] and rb.meta()["complete"]
    la = [int(ra.load(e).argmax()) for e in ra.entries() if e.level == "logits"]
    lb = [int(rb.load(e).argmax()) for e in rb.entries() if e.level == "logits"]
    assert la == a and lb == b


def test_set_dump_path_starts_a_new_folder(tmp_path):
    lm = tiny()
    h = register_hook(lm.model, DumpConfig(dump_path=str(tmp_path / "ignored"), module_list=["LlamaMLP"]))
    set_dump_path(str(tmp_path), dump_tag="dialog_0")
    greedy_generate(lm.model, prompt_ids("one"), 1)
    set_dump_path(str(tmp_path), dump_tag="dialog_1")
    greedy_generate(lm.model, prompt_ids("two"), 1)
    h.remove()
    assert h.dumps == [tmp_path / "dialog_0", tmp_path / "dialog_1"]
    assert all(LlmflowDumpReader(d).meta()["complete"] for d in h.dumps)
    with pytest.raises(UserError, match="backend"):
        set_dump_path(str(tmp_path), backend="acl")
    with pytest.raises(UserError, match="dump_tag"):
        set_dump_path(str(tmp_path), dump_tag="../up")


def test_save_records_into_the_current_step(tmp_path):
    class Saver(torch.nn.Module):
        def forward(self, x):
            y = x * 3
            llmflow.save("my_value", {"y": y, "parts": [x, x + 1]})
            return y

    h = register_hook(Saver(), DumpConfig(dump_path=str(tmp_path)))
    x = torch.randn(3)
    h.model(x)
    h.remove()
    r = LlmflowDumpReader(h.dumps[0])
    saved = {e.index: e for e in r.entries() if e.level == "save"}
    assert set(saved) == {"y", "parts.0", "parts.1"}
    assert all(e.name == "my_value" and e.step == 0 for e in saved.values())
    assert bits_equal(r.load(saved["y"]), x * 3) and bits_equal(r.load(saved["parts.1"]), x + 1)
    assert save("late", torch.ones(1)) is False  # no dump open any more


def test_save_goes_to_the_model_running_now(tmp_path):
    """Another hooked model whose dump is still open must not take a value saved from inside
    this model's forward."""
    class Saver(torch.nn.Module):
        def forward(self, x):
            save("mine", x + 1)
            return x

    idle = register_hook(Saver(), DumpConfig(dump_path=str(tmp_path / "idle")))
    idle.model(torch.zeros(2))  # its dump is open (never removed) but it is not running now
    busy = register_hook(Saver(), DumpConfig(dump_path=str(tmp_path / "busy")))
    busy.model(torch.ones(2))
    busy.remove()
    idle.remove()
    saved = {d: [e for e in LlmflowDumpReader(h.dumps[0]).entries() if e.level == "save"]
             for d, h in (("idle", idle), ("busy", busy))}
    assert len(saved["idle"]) == 1 and len(saved["busy"]) == 1
    assert bits_equal(LlmflowDumpReader(busy.dumps[0]).load(saved["busy"][0]), torch.full((2,), 2.0))


def test_top_level_names_are_msit_compatible():
    from llmflow import DumpConfig as D
    from llmflow import register_hook as rh
    from llmflow import save as s
    from llmflow import set_dump_path as sdp

    assert (D, rh, s, sdp) == (DumpConfig, register_hook, save, set_dump_path)


def test_module_list_auto_dumps_the_decoder_layers_through_dump_run_and_register_hook(tmp_path):
    """``module_list=["auto"]`` means the decoder-layer classes whichever way the dump is taken,
    and the caller's config is left as given."""
    reader, _ = dump(tmp_path, module_list=["auto"])
    names = {e.name for e in reader.entries() if e.level == "module"}
    assert names and all(n.startswith("model.layers.") and n.count(".") == 2 for n in names), sorted(names)
    config = DumpConfig(dump_path=str(tmp_path / "hooked"), module_list=["auto"])
    loaded = tiny()
    handle = register_hook(loaded.model, config)
    try:
        greedy_generate(loaded.model, prompt_ids(), 1)
    finally:
        handle.remove()
    assert config.module_list == ["auto"]
    hooked = LlmflowDumpReader(handle.dumps[0])
    assert {e.name for e in hooked.entries() if e.level == "module" and e.step == 0} == \
        {e.name for e in reader.entries() if e.level == "module" and e.step == 0}


class _CountingSink(Sink):
    """Records the ops of the modules it wants, and counts how often it was asked."""

    def __init__(self, wanted: set[str]):
        self.wanted = wanted
        self.asked: list[str] = []
        self.ops: list[str] = []

    def wants_op(self, module: str) -> bool:
        self.asked.append(module)
        return module in self.wanted

    def op_inputs(self, name, api, func, args, kwargs) -> None:
        self.ops.append(name)


class _SlottedSink:
    """The same, as a class whose instances take no weak reference (``__slots__`` without
    ``__weakref__``; a sink need not derive from ``Sink``)."""

    __slots__ = ("wanted", "asked", "ops")
    active = True
    exec_order = None
    __init__, wants_op, op_inputs = _CountingSink.__init__, _CountingSink.wants_op, _CountingSink.op_inputs

    def op_output(self, name, api, func, output) -> None:
        pass


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_each_module_is_asked_once_per_sink_whether_its_ops_are_wanted(compiled):
    """API mode asks a sink's ``wants_op`` once per module and keeps the answer for that sink; the
    next sink (a dialogue's next dump, say) is asked again, and a sink without weak references
    every time. Both dispatches (C and Python) answer the same."""
    from llmflow.dump.api import use_compiled_dispatch
    from llmflow.dump.recorder import Recorder

    if compiled and not use_compiled_dispatch(True):
        pytest.skip("no compiled capture here")
    use_compiled_dispatch(compiled)
    try:
        torch.manual_seed(0)
        model = Toy()
        recorder = Recorder(model, lambda name, _m: False, ops=True)
        x = torch.randn(2, 4)

        def run(sink: _CountingSink, times: int = 2) -> list[str]:
            recorder.attach(sink)
            for _ in range(times):
                recorder.op_counts.clear()
                with recorder.recording_ops():
                    model(x)
            return sink.ops

        first = _CountingSink({"inner"})
        assert run(first) == ["inner/linear.0"] * 2
        assert sorted(first.asked) == ["", "inner"]  # once each, over both forwards
        second = _CountingSink({""})
        assert run(second) == ["/matmul.0", "/add.0", "/tanh.0", "/add.1", "/softmax.0"] * 2
        assert sorted(second.asked) == ["", "inner"]
        slotted = _SlottedSink({"inner"})
        assert run(slotted) == ["inner/linear.0"] * 2
        assert len(slotted.asked) == 2 * 6  # every recorded call of both forwards
        recorder.remove()
    finally:
        use_compiled_dispatch(True)
