"""The recorder is one capture core: a call is named and seen the same way by every sink."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from llmflow import DumpConfig, register_hook
from llmflow.dump.memory import CallRecorder, capture_calls
from llmflow.dump.recorder import Recorder, Sink
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.localize.cost import estimate_api_dump_bytes
from llmflow.localize.ops import capture_ops
from llmflow.models import greedy_generate


def _tiny_llama(seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


def _api_dump(model: torch.nn.Module, path, steps: int, prompt: tuple[int, ...] = (1, 5, 9, 3)
              ) -> LlmflowDumpReader:
    handle = register_hook(model, DumpConfig(dump_path=str(path), mode="api", token_range="all"))
    with torch.no_grad():
        greedy_generate(model, list(prompt), steps)
    handle.remove()
    return LlmflowDumpReader(path / "llmflow_dump")


def _held_api_bytes(reader: LlmflowDumpReader) -> dict[int, int]:
    """Bytes of tensor data an API dump holds per step (a tensor stored once counts once)."""
    held: dict[int, int] = {0: 0, 1: 0}
    keys: set[tuple[int, str]] = set()
    for e in reader.entries():
        if e.level == "api" and e.has_data and (e.step, e.key) not in keys:
            keys.add((e.step, e.key))
            held[e.step] += reader.load(e).nbytes
    return held


def test_op_replay_names_ops_as_the_api_dump_does(tmp_path):
    model = _tiny_llama()
    reader = _api_dump(model, tmp_path / "dump", 1)
    layer = "model.layers.1"
    in_layer = [e for e in sorted(reader.entries(), key=lambda e: e.order) if e.step == 0
                and e.level == "api" and (e.name.startswith(layer + "/") or e.name.startswith(layer + "."))]
    dumped_names = list(dict.fromkeys(e.name for e in in_layer))  # inputs and outputs share a name
    calls = capture_calls(model, lambda: model(torch.tensor([[1, 5, 9, 3]])),
                          select=lambda name, _m: name == layer)
    module = dict(model.named_modules())[layer]
    ops = capture_ops(module, layer, calls[layer], device=torch.device("cpu"), dtype=torch.float32)
    replayed = [op.name for op in ops]
    assert replayed, "the op replay recorded nothing"
    assert [n for n in dumped_names if n in set(replayed)] == replayed
    assert set(replayed) <= set(dumped_names)


@pytest.mark.parametrize("dump_leaves_first", [True, False])
def test_recorders_stack_on_one_model_and_come_off_in_any_order(tmp_path, dump_leaves_first):
    model = _tiny_llama()
    ids = torch.tensor([[1, 5, 9, 3]])
    handle = register_hook(model, DumpConfig(dump_path=str(tmp_path / "d"), mode="all"))
    memory = CallRecorder(model, lambda name, _m: name.endswith("mlp"))
    with torch.no_grad():
        model(ids)
    assert set(memory.calls) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    first, second = (handle.remove, memory.close) if dump_leaves_first else (memory.close, handle.remove)
    first()
    memory.calls.clear()
    with torch.no_grad():
        model(ids)
    assert bool(memory.calls) is dump_leaves_first  # the one still on keeps recording
    second()
    assert all("forward" not in m.__dict__ for m in model.modules()), "a wrapper was left behind"
    dumps, calls = list(handle.dumps), dict(memory.calls)
    with torch.no_grad():
        model(ids)
    assert handle.dumps == dumps and memory.calls == calls  # nothing records any more


def test_memory_keeps_what_a_module_hook_made_of_the_output():
    """A fault injected by a forward hook rewrites the output after forward returns: the memory
    sink, like the dump, keeps what the call really returned."""
    model = _tiny_llama()
    mlp = model.model.layers[0].mlp
    hook = mlp.register_forward_hook(lambda _m, _a, out: out * 3)
    calls = capture_calls(model, lambda: model(torch.tensor([[1, 5, 9]])),
                          select=lambda name, _m: name == "model.layers.0.mlp")
    hook.remove()
    call = calls["model.layers.0.mlp"]
    with torch.no_grad():
        plain = mlp(*call.args, **call.kwargs)
    torch.testing.assert_close(call.outputs["0"], plain * 3)


def test_the_api_dump_estimate_counts_what_the_api_dump_holds(tmp_path):
    """Ops are recorded in the first layer only and counted once per layer: identical dense layers
    write identical bytes, so the estimate is exact."""
    model = _tiny_llama(layers=3)
    estimate = estimate_api_dump_bytes(model, [1, 5, 9, 3], 2)
    held = _held_api_bytes(_api_dump(model, tmp_path / "dump", 2))
    assert held[0] > 0 and held[1] > 0
    assert (estimate["prefill_bytes"], estimate["decode_step_bytes"]) == (held[0], held[1])
    assert (estimate["method"], estimate["layers"]) == ("one layer x N", 3)
    assert all("forward" not in m.__dict__ for m in model.modules()), "a wrapper was left behind"


def test_the_api_dump_estimate_of_an_moe_model_is_within_two_percent(tmp_path):
    """An MoE layer's routing differs from layer to layer, so one layer times N is an
    extrapolation there: within 2% of what the dump holds (8 experts, a 3-token prompt: not
    every expert runs in every layer)."""
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)).eval()
    estimate = estimate_api_dump_bytes(model, [1, 5, 9], 2)
    held = _held_api_bytes(_api_dump(model, tmp_path / "dump", 2, prompt=(1, 5, 9)))
    assert held[0] > 0 and held[1] > 0
    assert estimate["method"] == "one layer x N" and estimate["layers"] == 4
    assert abs(estimate["prefill_bytes"] - held[0]) <= 0.02 * held[0]
    assert abs(estimate["decode_step_bytes"] - held[1]) <= 0.02 * held[1]


class _StepLog(Sink):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def begin_step(self, step: int) -> None:
        self.events.append(("begin", step))

    def end_step(self, step: int, output, error, raised_in) -> None:
        self.events.append(("end", step, output is not None, error, raised_in))


def test_the_recorder_drives_steps_from_the_root_calls_and_numbers_them_per_sink():
    model = _tiny_llama()
    first = _StepLog()
    recorder = Recorder(model, lambda name, _m: name == "model.embed_tokens", sink=first, steps=True)
    with torch.no_grad():
        greedy_generate(model, [1, 5, 9, 3], 2)
        with pytest.raises(IndexError):
            model(torch.tensor([[1, 999]]))  # out of the vocabulary: the embedding raises
    second = _StepLog()
    recorder.attach(second)
    with torch.no_grad():
        model(torch.tensor([[1, 5]]))
    recorder.remove()
    with torch.no_grad():
        model(torch.tensor([[1, 5]]))
    assert first.events == [("begin", 0), ("end", 0, True, None, None),
                            ("begin", 1), ("end", 1, True, None, None),
                            ("begin", 2), ("end", 2, False, "IndexError: index out of range in self",
                                           "model.embed_tokens")]
    assert second.events == [("begin", 0), ("end", 0, True, None, None)]
