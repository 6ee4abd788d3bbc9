"""The chosen module's golden calls at each step from its decoder layer re-run alone on the golden
dump's layer inputs (``golden_layer_steps``): the same calls, bit for bit, as a whole golden
re-run through the decoding loop, on dense, sliding-window and MoE families; the bisect takes them
where the dump holds them and falls back to the re-run where it does not (a prefill-only golden
dump, a static cache, a layer that no longer reproduces its dumped output), with the same rows."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import bisect_dumps, make_dumps  # noqa: E402

from llmflow.dump.config import DumpConfig  # noqa: E402
from llmflow.dump.memory import CacheSnapshot  # noqa: E402
from llmflow.dump.run import dump_run  # noqa: E402
from llmflow.formats import open_dump  # noqa: E402
from llmflow.localize import bisect as bisect_mod  # noqa: E402
from llmflow.localize.golden import LayerSteps, golden_layer_steps, golden_rerun_steps  # noqa: E402
from llmflow.models import encode_prompt, load_model  # noqa: E402
from llmflow.structure import find_layer_stack, resolve_module_classes  # noqa: E402

SIZE = "layers=4,hidden=64,intermediate=128,seed=3,init=0.2"
STATIC = Path(__file__).resolve().parents[1] / "fixtures" / "static_cache_model.py"
STEPS = 4


def same(a: Any, b: Any) -> bool:
    """Bit-identical call inputs/outputs: tensors equal, caches equal in the layer the module reads."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, CacheSnapshot):
        idx = a.idx if a.idx is not None else b.idx
        ka, kb = a.layer_kv(idx), b.layer_kv(idx)
        return (ka is None) == (kb is None) and (ka is None or all(map(torch.equal, ka, kb)))
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mixtral", "gpt2"])
def test_layer_re_run_gives_the_whole_re_runs_calls_bit_for_bit(family, tmp_path):
    golden = load_model(f"tiny-{family}:{SIZE}")
    ids = encode_prompt(golden.tokenizer, "Tell me a story.")
    config = DumpConfig(dump_path=str(tmp_path / "golden"), token_range="all", tensor_part=2,
                        module_list=resolve_module_classes(golden.model, ["auto"]))
    golden_ids = dump_run(golden, ids, STEPS + 1, config)
    stack = find_layer_stack(golden.model)
    layers = [stack.layers[1], stack.layers[-1]]
    modules = dict(golden.model.named_modules())
    wanted = {f"{layer}.{child}" for layer in layers for child, _ in modules[layer].named_children()}

    reader = open_dump(tmp_path / "golden")
    found = golden_layer_steps(reader, golden, layers, STEPS, lambda n, _m: n in wanted)
    assert found.missing is None and found.fidelity == 0.0
    rerun = golden_rerun_steps(golden, ids, golden_ids, set(range(STEPS)), lambda n, _m: n in wanted)
    assert sorted(found.calls) == sorted(rerun) == list(range(STEPS))
    for step in range(STEPS):
        assert found.calls[step].keys() == rerun[step].keys() == wanted
        for name, call in found.calls[step].items():
            other = rerun[step][name]
            assert same(call.args, other.args) and same(call.kwargs, other.kwargs), (step, name)
            assert same(call.outputs, other.outputs), (step, name)


def test_a_layer_that_no_longer_reproduces_its_dumped_output_is_refused(tmp_path):
    golden = load_model(f"tiny-llama:{SIZE}")
    ids = encode_prompt(golden.tokenizer, "Tell me a story.")
    dump_run(golden, ids, 3, DumpConfig(dump_path=str(tmp_path / "golden"), token_range="all", tensor_part=2,
                                        module_list=["LlamaDecoderLayer"]))
    with torch.no_grad():
        golden.model.model.layers[2].mlp.up_proj.weight.mul_(1.01)  # not the weights the dump ran
    found = golden_layer_steps(open_dump(tmp_path / "golden"), golden, ["model.layers.2"], 3,
                               lambda n, _m: n.endswith(".mlp"))
    assert found.missing is not None and "model.layers.2 re-run alone at step 0" in found.missing
    assert "from its dumped output" in found.missing and not found.calls


CUSTOM = "tests/fixtures/custom_model.py:build"  # hand-written, no config, no KV cache


@pytest.mark.parametrize("family", ["llama", "qwen2-moe", "custom"])
def test_bisect_takes_the_layer_re_run_and_the_whole_re_run_gives_the_same_rows(family, tmp_path,
                                                                                 monkeypatch):
    """A fault in every forward call: own error per step from the layer re-run; the same bisect
    with the layer re-run refused comes back to the whole re-run and the same numbers."""
    fault = "scale_attn_out_layer_2" if family == "qwen2-moe" else "scale_down_proj_layer_2"
    model = CUSTOM if family == "custom" else f"tiny-{family}:{SIZE}"
    dumps = make_dumps(tmp_path, model, patch=f"plugins/example_faults.py:{fault}")
    by_layer = bisect_dumps(dumps, estimate_cost=False, own_error_steps=STEPS)
    own = by_layer["own_error_steps"]
    assert by_layer["status"] == "fail", by_layer["headline"]
    assert own["module"] == by_layer["first_bad_module"]
    assert own["source"] == "dump + layer re-run" and len(own["rows"]) == STEPS

    monkeypatch.setattr(bisect_mod, "golden_layer_steps", lambda *_a, **_k: LayerSteps(missing="refused"))
    by_rerun = bisect_dumps(dumps, estimate_cost=False, own_error_steps=STEPS)
    assert by_rerun["own_error_steps"]["source"] == "golden re-run"
    assert by_rerun["own_error_steps"]["rows"] == own["rows"]
    reruns = by_layer["cost"]["model_runs"]["golden_reruns"]  # the isolation replay's own, at a decode step
    assert by_rerun["cost"]["model_runs"]["golden_reruns"] == reruns + 1


@pytest.mark.parametrize(("model", "golden_all"), [(f"tiny-llama:{SIZE}", True), (f"{STATIC}:build", False)])
def test_a_golden_dump_that_cannot_stand_for_the_run_falls_back_to_the_re_run(model, golden_all, tmp_path):
    """A golden dumped at the prefill only holds no layer inputs at the decode steps; a static
    cache cannot be given to one layer alone: both come from the golden re-run, right."""
    dumps = make_dumps(tmp_path, model, patch="plugins/example_faults.py:scale_down_proj_layer_2",
                       golden_all=golden_all)
    v = bisect_dumps(dumps, estimate_cost=False, own_error_steps=STEPS)
    assert v["status"] == "fail" and v["first_bad_module"].endswith("layers.2.mlp.down_proj"), v["headline"]
    assert v["own_error_steps"]["source"] == "golden re-run"
    rows = v["own_error_steps"]["rows"]
    assert len(rows) == STEPS and all(r["own_error"] > 10 * r["peer_median"] for r in rows), rows
