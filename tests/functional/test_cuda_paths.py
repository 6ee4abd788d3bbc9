"""The CUDA paths on a real GPU: capture (asynchronous copies into pinned memory, statistics
reduced on the device), a CUDA target bisected against a CPU golden (replay on the GPU), and the
dump stage with ``device: cuda``.

Skipped where torch sees no CUDA device: CI has none. They run wherever one is (a lent GPU
machine: docs/benchmarks.md has the figures of a run on an H100).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from llmflow.dump import DumpConfig, dump_run
from llmflow.dump.stats import batched_stats
from llmflow.formats.base import STAT_KEYS
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.models import greedy_generate, load_model
from llmflow.workflow import run_workflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the holding tests' model
from bisect_helpers import bisect_dumps, make_dumps  # noqa: E402
from dump_helpers import TINY, assert_copies_taken_at_capture, bits_equal, dump, prompt_ids  # noqa: E402
from example_faults import FAULT_MODULES  # noqa: E402
from path_helpers import checkout_path  # noqa: E402
from test_dump_native_capture import FAMILIES, _assert_same_dump  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")


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


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_held_tensors_dump_what_copies_dump(tmp_path, monkeypatch, keepers, family, data_mode, batches):
    """Module dumps on the GPU hold the tensors themselves after two learning steps: the dump is
    the one ``LLMFLOW_DUMP_COPIES=always`` writes, byte for byte (its index lines may come in
    another order: held tensors are read at flushes, copies at fences; the reader sorts them)."""
    dtype = "bfloat16" if family.endswith("bf16") else "float32"
    lm = load_model(FAMILIES[family], device="cuda", dtype=dtype)
    ids = prompt_ids()
    for out, copies in (("held", "auto"), ("copied", "always")):
        monkeypatch.setenv("LLMFLOW_DUMP_COPIES", copies)
        dump_run(lm, ids, 5, DumpConfig(dump_path=str(tmp_path / out), token_range="all",
                                        data_mode=data_mode))
    held, always = keepers
    assert held.holding and held.why_copying is None, held.why_copying
    assert not always.holding
    _assert_same_dump(tmp_path / "held", tmp_path / "copied", any_order=True)


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
def test_cuda_a_held_tensor_changed_later_is_not_stored(tmp_path, keepers, data_mode):
    from test_dump_holding import Model, _assert_dumped, _steps

    seen = _steps(Model(change_from=3).cuda(), tmp_path / "d", data_mode, device="cuda")
    (keeper,) = keepers
    assert not keeper.holding and "changed in place" in keeper.why_copying
    _assert_dumped(tmp_path / "d", seen, data_mode, lost=frozenset({3}))


@pytest.mark.parametrize("how", ["inplace", "data"])
def test_cuda_a_change_in_the_learning_steps_keeps_copies(tmp_path, keepers, how):
    from test_dump_holding import Model, _assert_dumped, _steps

    seen = _steps(Model(change_from=0, how=how).cuda(), tmp_path / "d", "tensor", device="cuda")
    (keeper,) = keepers
    assert not keeper.holding and keeper.why_copying
    _assert_dumped(tmp_path / "d", seen, "tensor")


def test_cuda_holding_waits_for_a_side_stream(tmp_path, keepers):
    """A forward on a side stream keeps its copies (holding takes the default stream's tensors)."""
    from test_dump_holding import Model, _assert_dumped, _steps

    with torch.cuda.stream(torch.cuda.Stream()):
        seen = _steps(Model(change_from=10**6).cuda(), tmp_path / "d", "tensor", device="cuda")
    (keeper,) = keepers
    assert keeper.learning and not keeper.holding  # nothing was held: nothing learned either
    _assert_dumped(tmp_path / "d", seen, "tensor")


def test_cuda_a_users_quick_start_script_holds_and_dumps_what_copies_dump(tmp_path):
    """msit's quick start on a GPU, run as the user runs it (a script in its own process, the hook
    never removed, the process just ends), once holding tensors (the default) and once with
    ``LLMFLOW_DUMP_COPIES=always``: the same dump, complete, with no problems."""
    import os
    import subprocess
    import textwrap

    from llmflow.formats import open_dump

    script = tmp_path / "quick_start.py"
    script.write_text(textwrap.dedent("""\
        import sys
        import torch
        from llmflow import DumpConfig, register_hook
        from llmflow.models import build_tiny

        model = build_tiny("llama", "layers=4,hidden=256").cuda()
        register_hook(model, DumpConfig(dump_path=sys.argv[1], token_range=list(range(8))))
        ids = torch.tensor([[256, 104, 101, 108, 108, 111]], device="cuda")
        model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=258)
        """))
    root = Path(__file__).resolve().parents[2]
    for out, copies in (("held", "auto"), ("copied", "always")):
        env = {**os.environ, "PYTHONPATH": checkout_path(root), "LLMFLOW_DUMP_COPIES": copies}
        done = subprocess.run([sys.executable, str(script), str(tmp_path / out)], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        reader = open_dump(tmp_path / out / "llmflow_dump")
        assert reader.problems() == [] and reader.meta()["complete"] is True
    _assert_same_dump(*(tmp_path / out / "llmflow_dump" for out in ("held", "copied")), any_order=True)
