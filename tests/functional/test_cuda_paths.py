"""The CUDA paths on a real GPU: capture (asynchronous copies into pinned memory, statistics
reduced on the device), a CUDA target bisected against a CPU golden (replay on the GPU), and the
dump stage with ``device: cuda``.

Skipped where torch sees no CUDA device: CI has none. They run wherever one is (a lent GPU
machine: docs/benchmarks.md has the figures of a run on an H100).
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from llmflow.dump import capture as dump_capture
from llmflow.dump.stats import batched_stats
from llmflow.dump.writer import AsyncWriter
from llmflow.formats.base import STAT_KEYS
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.models import greedy_generate, load_model
from llmflow.workflow import run_workflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, make_dumps  # noqa: E402
from dump_helpers import TINY, assert_copies_taken_at_capture, bits_equal, dump, prompt_ids  # noqa: E402
from example_faults import FAULT_MODULES  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")


@pytest.fixture(params=["batches", "small batches"])
def batches(request, monkeypatch):
    """The writer's default batches, or batches of a few KiB: a fence every 2 KiB of copies and
    data files written at those fences, the mid-step path a big model's dump takes."""
    if request.param == "small batches":
        monkeypatch.setattr(dump_capture, "AsyncWriter",
                            functools.partial(AsyncWriter, batch_bytes=4096, wake_bytes=2048))
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_dump_equals_what_a_forward_hook_sees(tmp_path, writer_mode, dtype, batches):
    lm = load_model(TINY, device="cuda", dtype=dtype)
    seen: dict[tuple[int, str, str], torch.Tensor] = {}
    calls = {"n": -1}

    def root_pre(_mod, _args, _kwargs):
        calls["n"] += 1

    def make(name):
        def hook(_mod, args, out):
            first = out[0] if isinstance(out, tuple) else out
            if isinstance(first, torch.Tensor):
                seen[(calls["n"], name, "output")] = first.detach().clone()
            if args and isinstance(args[0], torch.Tensor):
                seen[(calls["n"], name, "input")] = args[0].detach().clone()
        return hook

    model = lm.model
    handles = [model.register_forward_pre_hook(root_pre, with_kwargs=True)]
    handles += [m.register_forward_hook(make(n)) for n, m in model.named_modules() if n]
    try:
        r, out = dump(tmp_path, new_tokens=3, loaded=lm)
    finally:
        for h in handles:
            h.remove()
    assert out == greedy_generate(model, prompt_ids(), 3)  # the dump does not change what is generated
    checked = 0
    for e in r.entries():
        key = (e.step, e.name, e.kind)
        if e.level == "module" and e.index == "0" and key in seen:
            got = r.load(e)
            assert got.device.type == "cpu"
            assert bits_equal(got, seen[key].cpu()), key  # dtype included: bf16 stays bf16
            checked += 1
    assert checked > 60


def test_cuda_copy_is_taken_at_capture_time(tmp_path, writer_mode):
    """Kernels queued after the capture (in-place ops on a big tensor) must not reach the copy."""
    assert_copies_taken_at_capture(tmp_path, torch.randn(2048, 2048, device="cuda"), additions=20, amount=1.0)


def test_cuda_copies_queued_on_a_side_stream_are_waited_for(tmp_path, writer_mode):
    """A forward on a stream of its own: the writer waits on that stream, not the default one."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.randn(2048, 2048, device="cuda")
        assert_copies_taken_at_capture(tmp_path, x, additions=20, amount=1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_statistics_are_those_of_the_dumped_tensors(tmp_path, writer_mode, dtype, batches):
    """Statistics reduced on the GPU (statistics mode) against the CPU's of the same tensors
    dumped in full from the same greedy run."""
    lm = load_model(TINY, device="cuda", dtype=dtype)
    stats_r, out_s = dump(tmp_path / "s", new_tokens=2, loaded=lm, data_mode="statistics", mode="all")
    full_r, out_t = dump(tmp_path / "t", new_tokens=2, loaded=lm, mode="all")
    assert out_s == out_t
    full = {(e.step, e.name, e.kind, e.index): e for e in full_r.entries() if e.has_data}
    stat_entries = [e for e in stats_r.entries() if e.stats is not None and e.level != "weight"]
    assert len(stat_entries) > 100 and not any(e.has_data for e in stat_entries)
    matched = 0
    for e in stat_entries:
        twin = full.get((e.step, e.name, e.kind, e.index))
        if twin is None:
            continue
        want = dict(zip(STAT_KEYS, batched_stats([full_r.load(twin)])[0], strict=True))
        for k in STAT_KEYS:
            a, b = e.stats[k], want[k]
            if math.isnan(b):
                assert math.isnan(a), (e.name, k)
            else:
                assert a == pytest.approx(b, rel=1e-4, abs=1e-5), (e.name, e.index, k, a, b)
        matched += 1
    assert matched > 100


def test_cuda_api_mode_captures_ops_on_the_device(tmp_path):
    lm = load_model(TINY, device="cuda", dtype="float32")
    r, _ = dump(tmp_path, new_tokens=2, loaded=lm, mode="api", token_range=[1])
    apis = {e.name: e for e in r.entries() if e.level == "api"}
    q = next(e for n, e in apis.items() if n.startswith("model.layers.0.self_attn.q_proj/linear"))
    assert any("/matmul" in n for n in apis), sorted(apis)[:20]  # the `@` of attention
    assert r.load(q).dtype == torch.float32 and r.load(q).device.type == "cpu"


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cuda-golden")
    make_dumps(tmp, BISECT_MODEL)
    return tmp / "golden"


BISECT_MODEL = "tiny-llama:layers=6,hidden=64,intermediate=128,seed=3"


@pytest.mark.parametrize("fault", ["scale_down_proj", "wrong_eps"])
def test_cuda_target_bisected_against_a_cpu_golden(fault, golden_dir, tmp_path):
    """The usual port: golden fp32 on the CPU, target bf16 on the GPU, modules replayed there."""
    dumps = make_dumps(tmp_path, BISECT_MODEL, patch=f"plugins/example_faults.py:{fault}_layer_4",
                       golden_dir=golden_dir, target_device="cuda")
    v = bisect_dumps(dumps, estimate_cost=False)
    module = f"model.layers.4.{FAULT_MODULES[fault]}"
    assert v["first_bad_layer"] == "model.layers.4", v["diagnosis"]
    assert v["first_bad_module"] == module, v["candidates"][:3]
    assert v["first_bad_op"] and v["first_bad_op"].startswith(module), v["ops"]


def test_cuda_target_without_a_fault_names_nothing(golden_dir, tmp_path):
    v = bisect_dumps(make_dumps(tmp_path, BISECT_MODEL, golden_dir=golden_dir, target_device="cuda"))
    assert v["first_bad_module"] is None, v["candidates"][:3]


def test_dump_stage_on_cuda(tmp_path):
    wf = tmp_path / "wf.yaml"
    wf.write_text(json.dumps({"name": "dump-cuda", "stages": {
        "seed": {"uses": "seed", "with": {"seed": 7}},
        "dump-npu": {"uses": "dump", "needs": ["seed"], "with": {
            "model": TINY, "prompt": "hello there", "max_new_tokens": 3, "device": "cuda",
            "dtype": "bfloat16", "seed_settings": "${stages.seed.outputs.settings}"}},
    }}))
    res = run_workflow(wf, run_dir=tmp_path / "run")
    st = res.stages["dump-npu"]
    assert st.status == "done", st.error
    assert st.outputs["model_spec"]["device"] == "cuda"
    r = LlmflowDumpReader(st.outputs["dump_dir"])
    assert r.meta()["complete"]
    assert r.env()["versions"]["cuda"] == torch.version.cuda
    assert {e.dtype for e in r.entries() if e.level == "module" and e.kind == "output"} >= {"bfloat16"}
    assert len([e for e in r.entries() if e.level == "logits"]) == 3
