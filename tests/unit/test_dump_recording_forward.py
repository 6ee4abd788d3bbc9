"""The recorder's recording forward in C (capture.cpp's ``RecordingForward``) does what its Python
closure does: the same calls reach the sink with the same values in the same order under the same
module stack; an exception, from the model or from the sink, names the innermost module it left
and leaves the stack as it was; a wrapped model still copies, still reports its forward's
signature, and comes off again whichever implementation wrapped it and in whatever order."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmflow.dump import recorder as recorder_module
from llmflow.dump.recorder import Recorder, Sink, use_compiled_forward
from llmflow.models import greedy_generate

IMPLEMENTATIONS = ("compiled", "python")


@pytest.fixture(autouse=True)
def _compiled_forward_back_on() -> Iterator[None]:
    yield
    use_compiled_forward(True)


def _use(implementation: str) -> None:
    compiled = use_compiled_forward(implementation == "compiled")
    if implementation == "compiled":
        assert compiled, "the dump capture (capture.cpp) did not build here"


def _tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


def _describe(value: Any) -> Any:
    """A value as a comparable description: tensors by shape, dtype and a checksum."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), float(value.double().sum()))
    if isinstance(value, (tuple, list)):
        return type(value).__name__, [_describe(v) for v in value]
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


class _CallLog(Sink):
    """Every call the recorder sends, with the stack the recorder held at that moment."""

    def __init__(self, recorder_of: list[Recorder], fail_on: str | None = None):
        self.recorder_of = recorder_of
        self.fail_on = fail_on
        self.calls: list[tuple] = []
        self.exec_order: list[str] = []

    def module_inputs(self, name: str, mtype: str, module: torch.nn.Module, args: tuple,
                      kwargs: dict) -> None:
        assert type(args) is tuple and type(kwargs) is dict
        self.calls.append(("in", name, mtype, type(module).__name__, list(self.recorder_of[0].stack),
                           _describe(args), _describe(kwargs)))
        if name == self.fail_on:
            raise RuntimeError(f"sink refused {name}")

    def module_output(self, name: str, mtype: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None:
        self.calls.append(("out", name, list(self.recorder_of[0].stack), _describe(args), _describe(kwargs),
                           _describe(output)))


def _record(implementation: str, select: Any, *, ops: bool = False, inputs: bool = True, outputs: bool = True,
            fail_on: str | None = None, tokens: int = 2) -> tuple[_CallLog, list, str | None]:
    _use(implementation)
    model = _tiny_llama()
    holder: list[Recorder] = []
    sink = _CallLog(holder, fail_on)
    rec = Recorder(model, select, sink=sink, inputs=inputs, outputs=outputs, ops=ops)
    holder.append(rec)
    wrapped = [m for m in model.modules() if "forward" in m.__dict__]
    wrapper = type(wrapped[0].__dict__["forward"])
    assert (wrapper.__name__ == "RecordingForward") == (implementation == "compiled"), wrapper
    error = None
    try:
        with torch.no_grad():
            greedy_generate(model, [1, 5, 9, 3], tokens)
    except RuntimeError as exc:
        error = str(exc)
    stack_after, raised_in = list(rec.stack), rec.raised_in
    rec.remove()
    assert not any("forward" in m.__dict__ for m in wrapped)
    return sink, stack_after, (error, raised_in)


SELECTS = {
    "every module": lambda name, _m: True,
    "mlps": lambda name, _m: name.endswith(".mlp"),
    "layers": lambda name, _m: name.count(".") == 2 and ".layers." in name,
}


@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("flags", [{}, {"inputs": False}, {"outputs": False}, {"ops": True}])
def test_both_implementations_send_the_same_calls(select: str, flags: dict) -> None:
    compiled, c_stack, c_error = _record("compiled", SELECTS[select], **flags)
    python, p_stack, p_error = _record("python", SELECTS[select], **flags)
    assert compiled.calls and compiled.calls == python.calls
    assert compiled.exec_order == python.exec_order
    assert c_stack == p_stack == [] and c_error == p_error == (None, None)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_sink_that_raises_names_its_module_and_leaves_the_stack_empty(implementation: str) -> None:
    sink, stack, (error, raised_in) = _record(implementation, SELECTS["every module"],
                                              fail_on="model.layers.1.mlp.down_proj")
    assert error == "sink refused model.layers.1.mlp.down_proj"
    assert raised_in == "model.layers.1.mlp.down_proj" and stack == []
    assert sink.calls[-1][:2] == ("in", "model.layers.1.mlp.down_proj")
    assert sink.calls[-1][4] == ["model", "model.layers.1", "model.layers.1.mlp",
                                 "model.layers.1.mlp.down_proj"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_forward_that_raises_is_named_and_nothing_is_sent_for_its_output(implementation: str) -> None:
    _use(implementation)
    model = _tiny_llama()
    holder: list[Recorder] = []
    sink = _CallLog(holder)
    rec = Recorder(model, SELECTS["every module"], sink=sink)
    holder.append(rec)
    with torch.no_grad(), pytest.raises(IndexError):
        model(torch.tensor([[1, 999]]))  # out of the vocabulary: the embedding raises
    assert rec.raised_in == "model.embed_tokens" and rec.stack == []
    assert [c[:2] for c in sink.calls] == [("in", "model"), ("in", "model.embed_tokens")]
    rec.remove()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_an_inactive_sink_gets_nothing_and_a_naming_recorder_still_keeps_the_stack(implementation: str
                                                                                   ) -> None:
    _use(implementation)
    model = _tiny_llama()
    seen: list[list[str]] = []
    holder: list[Recorder] = []

    class Inactive(Sink):
        active = False
        exec_order = None

    rec = Recorder(model, SELECTS["every module"], sink=Inactive(), ops=True)
    holder.append(rec)
    original = model.model.layers[0].mlp.act_fn.forward
    model.model.layers[0].mlp.act_fn.forward = lambda x: (seen.append(list(rec.stack)), original(x))[1]
    with torch.no_grad():
        model(torch.tensor([[1, 5]]))
    assert seen == [["model", "model.layers.0", "model.layers.0.mlp"]] and rec.stack == []
    rec.remove()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_wrapped_model_copies_reports_its_signature_and_comes_off(implementation: str) -> None:
    _use(implementation)
    model = _tiny_llama()
    mlp = model.model.layers[0].mlp
    rec = Recorder(model, SELECTS["every module"], sink=Sink())
    assert inspect.signature(mlp.forward) == inspect.signature(mlp.forward.__wrapped__)
    assert list(inspect.signature(mlp.forward).parameters) == ["x"]  # the module's own forward's
    twin = copy.deepcopy(model)
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 9]])
        assert torch.equal(twin(ids).logits, model(ids).logits)
    rec.remove()
    assert "forward" not in mlp.__dict__


def test_recorders_of_both_implementations_stack_and_come_off_in_any_order() -> None:
    for first_off in (0, 1):
        model = _tiny_llama()
        mlp = model.model.layers[1].mlp
        with torch.no_grad():
            ids = torch.tensor([[1, 5, 9]])
            plain = model(ids).logits
        sinks, recorders = [], []
        for implementation in IMPLEMENTATIONS:
            _use(implementation)
            holder: list[Recorder] = []
            sinks.append(_CallLog(holder))
            recorders.append(Recorder(model, SELECTS["mlps"], sink=sinks[-1]))
            holder.append(recorders[-1])
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain)
        assert [c[1] for c in sinks[0].calls] == [c[1] for c in sinks[1].calls] != []
        recorders[first_off].remove()
        recorders[1 - first_off].remove()
        assert "forward" not in mlp.__dict__
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain)


def test_without_the_compiled_capture_the_python_closure_wraps() -> None:
    native = recorder_module._NATIVE
    try:
        recorder_module._NATIVE = None
        assert use_compiled_forward(True) is False
        model = _tiny_llama()
        rec = Recorder(model, SELECTS["mlps"], sink=Sink())
        assert callable(model.model.layers[0].mlp.__dict__["forward"])
        assert type(model.model.layers[0].mlp.__dict__["forward"]).__name__ == "function"
        rec.remove()
    finally:
        recorder_module._NATIVE = native
