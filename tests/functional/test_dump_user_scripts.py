"""A user's dump script, run as the user runs it, ends however it ends: the dump is finished, or
it is readable and says why it is not whole.

msit's quick start hooks the model, generates and lets the process end: nobody calls
``remove()``. Each script here is a user's file run with ``subprocess.run([python, script])``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from path_helpers import checkout_path

from llmflow.formats import open_dump
from llmflow.formats.llmflow_dump import LlmflowDumpReader

ROOT = Path(__file__).resolve().parents[2]
HEAD = """\
import gc, os, signal, sys, time
import torch
from llmflow import DumpConfig, register_hook
from llmflow.models import build_tiny

model = build_tiny("llama", "layers=8,hidden=512")
"""
HOOK = """\
register_hook(model, DumpConfig(dump_path=sys.argv[1], token_range=list(range(8))))
ids = torch.tensor([[256, 104, 101, 108, 108, 111]])
"""
GENERATE = "model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=258)\n"
QUICK_START = HEAD + HOOK + GENERATE  # msit's documented usage: no remove(), the process just ends


def _run(script: str, tmp: Path, name: str, writer: str = "thread"
         ) -> tuple[subprocess.CompletedProcess, Path]:
    """Run ``script`` as a user's file; returns the finished process and its dump folder."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"{name}.py"
    path.write_text(textwrap.dedent(script))
    out = tmp / f"{name}_dump"
    env = {**os.environ, "PYTHONPATH": checkout_path(ROOT), "LLMFLOW_DUMP_WRITER": writer}
    proc = subprocess.run([sys.executable, str(path), str(out)], capture_output=True, text=True, env=env,
                          cwd=tmp, timeout=300)
    return proc, out / "llmflow_dump"


def assert_whole(dump: Path, steps: int = 5) -> LlmflowDumpReader:
    """The dump is finished: complete, no problems, no unfinished file, every step indexed with
    tensor data."""
    r = open_dump(dump)
    assert isinstance(r, LlmflowDumpReader)
    assert r.problems() == [] and r.meta()["complete"] is True
    assert not list(dump.rglob("*.tmp"))
    assert r.steps() == list(range(steps))
    with_data = {e.step for e in r.entries() if e.has_data}
    assert with_data == set(range(steps))
    last = [e for e in r.entries() if e.step == steps - 1 and e.has_data]
    assert r.load(last[-1]).numel() > 0  # the last thing written loads
    return r


@pytest.mark.slow
def test_quick_start_script_finishes_its_dump_every_time(tmp_path: Path) -> None:
    """Six runs of the quick start, three with the writer thread and three inline (two runs at a
    time, so exits overlap other work): exit status 0 every time, no abort at exit, no unfinished
    data file, every step in the index, the dump complete."""
    writers = ["thread", "inline"] * 3
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda i: _run(QUICK_START, tmp_path, f"run{i}", writers[i]),
                             range(len(writers))))
    for (proc, dump), writer in zip(runs, writers, strict=True):
        assert proc.returncode == 0, (writer, proc.stderr[-2000:])
        assert "terminate called" not in proc.stderr, writer
        assert_whole(dump)


@pytest.mark.slow
@pytest.mark.parametrize(("ending", "status"), [("sys.exit(3)", 3), ("raise SystemExit('bye')", 1),
                                                ("raise ValueError('after the run')", 1)])
def test_the_script_keeps_its_own_exit_status(tmp_path: Path, ending: str, status: int) -> None:
    proc, dump = _run(QUICK_START + ending + "\n", tmp_path, "script")
    assert proc.returncode == status, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr and "llmflow" not in proc.stderr.lower()
    assert_whole(dump)


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["thread", "inline"])
def test_a_collected_model_finishes_its_dump_while_the_process_lives_on(tmp_path: Path, writer: str) -> None:
    """``del model; gc.collect()``: the dump is complete while the script still sleeps. The model
    is a GPT-2 (transformers' own class from a config), not the Llama of the other tests."""
    script = """\
    import gc, sys, time
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from llmflow import DumpConfig, register_hook

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=300))
    register_hook(model, DumpConfig(dump_path=sys.argv[1], token_range="all"))
    model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    del model
    gc.collect()
    open(sys.argv[1] + ".collected", "w").close()
    time.sleep(120)
    """
    path = tmp_path / "gc_script.py"
    path.write_text(textwrap.dedent(script))
    out = tmp_path / "gc_dump"
    env = {**os.environ, "PYTHONPATH": checkout_path(ROOT), "LLMFLOW_DUMP_WRITER": writer}
    proc = subprocess.Popen([sys.executable, str(path), str(out)], env=env, cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True)
    try:
        marker = Path(f"{out}.collected")
        for _ in range(1200):
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists() and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        assert_whole(out / "llmflow_dump")  # finished by the collection, the process still sleeping
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_forward_that_raises_keeps_the_dump_and_says_where(tmp_path: Path) -> None:
    """A patched module raises in step 2 and the script catches it: the dump holds steps 0-1 whole
    and step 2 up to the fault, it is complete, and its one problem names the step, the error
    and the module. The script's next prompt goes to a dump of its own, whole."""
    fault = textwrap.dedent("""\
        mlp = model.model.layers[1].mlp
        forward, calls = mlp.forward, []
        def flaky(*args, **kwargs):  # a fault patched in before the hook goes on
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected fault")
            return forward(*args, **kwargs)
        mlp.forward = flaky
        """)
    run = textwrap.dedent("""\
        try:
            model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=258)
        except RuntimeError as exc:
            print("caught:", exc)
        model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=258)
        """)
    script = HEAD + fault + HOOK + run
    proc, dump = _run(script, tmp_path, "raises")
    assert proc.returncode == 0 and "caught: injected fault" in proc.stdout, proc.stderr[-2000:]
    r = open_dump(dump)
    assert r.meta()["complete"] is True and r.steps() == [0, 1, 2]
    problems = r.problems()
    assert len(problems) == 1
    assert "step 2" in problems[0] and "RuntimeError: injected fault" in problems[0]
    assert "model.layers.1.mlp" in problems[0]
    step2 = {(e.name, e.kind) for e in r.entries() if e.step == 2}
    assert ("model.layers.1.mlp", "input") in step2 and ("model.layers.1.mlp", "output") not in step2
    assert ("model.layers.2", "input") not in step2 and ("logits", "output") not in step2
    assert ("logits", "output") in {(e.name, e.kind) for e in r.entries() if e.step == 1}
    for e in r.entries():
        if e.has_data:
            r.load(e)
    assert_whole(dump.parent / "llmflow_dump_1")  # the next prompt: a new dump, whole


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["thread", "inline"])
def test_a_killed_script_leaves_a_readable_dump_that_says_so(tmp_path: Path, writer: str) -> None:
    """SIGKILL in the middle of step 3: what reached disk loads, and problems() says the dump
    was never closed."""
    script = HEAD + """\
calls = []
def kill(module, args):
    calls.append(1)
    if len(calls) == 4:  # step 3, halfway through the layers
        os.kill(os.getpid(), signal.SIGKILL)
model.model.layers[4].register_forward_pre_hook(kill)
""" + HOOK + GENERATE
    proc, dump = _run(script, tmp_path, "killed", writer)
    assert proc.returncode == -signal.SIGKILL
    r = open_dump(dump)
    assert r.meta()["complete"] is False
    problems = r.problems()
    assert any("never closed" in p for p in problems) and all("\n" not in p for p in problems)
    assert 0 in r.steps() and max(r.steps()) <= 3
    loaded = 0
    for e in r.entries():
        if e.has_data:
            assert r.load(e).shape == e.shape
            loaded += 1
    assert loaded > 0  # step 0's tensors reached disk with its end


RANKED = """\
import sys
import torch
from llmflow import DumpConfig, register_hook
from llmflow.models import build_tiny

model = build_tiny("llama", "layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64," + sys.argv[2])
register_hook(model, DumpConfig(dump_path=sys.argv[1], token_range=[0, 1]))
model.generate(torch.tensor([[256, 104, 105]]), max_new_tokens=2, do_sample=False, pad_token_id=258)
"""


def test_a_one_rank_dump_over_a_two_rank_one_leaves_the_old_rank_out(tmp_path: Path) -> None:
    """A tensor-parallel dump (RANK 0 and 1 of WORLD_SIZE 2), then a one-process dump of another
    model into the same dump_path: the new dump reads as one rank, the old rank1 is named and left
    out (kept on disk), and it compares with a one-process dump of the same model as the same run."""
    script = tmp_path / "dump.py"
    script.write_text(RANKED)

    def dump(where: str, seed: int, **env: str) -> None:
        run_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        proc = subprocess.run([sys.executable, str(script), where, f"seed={seed}"], capture_output=True,
                              text=True, cwd=tmp_path,
                              env={**run_env, "PYTHONPATH": checkout_path(ROOT), **env},
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]

    dump("shared", 1, RANK="0", WORLD_SIZE="2")  # an earlier model
    dump("shared", 1, RANK="1", WORLD_SIZE="2")
    ranks = {e.rank for e in LlmflowDumpReader(tmp_path / "shared" / "llmflow_dump").entries()}
    assert ranks == {0, 1}
    dump("shared", 2)  # the model of today, twice
    dump("alone", 2)
    cli = [sys.executable, "-m", "llmflow", "compare", "-gp", "alone", "-mp", "shared", "-o", "cmp"]
    proc = subprocess.run(cli, capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED") and "0 unmatched" in proc.stdout
    assert "left out rank1: written by an earlier dump of 2 ranks into the same folder" in proc.stderr
    assert (tmp_path / "shared" / "llmflow_dump" / "rank1" / "rank.json").is_file()  # never deleted


def test_a_golden_and_a_target_hooked_with_one_dump_path_get_a_dump_each(tmp_path: Path) -> None:
    """One script hooks an fp32 golden and a bf16 copy with the same dump_path and generates with
    both, interleaved: two dumps, each of its own model, not one dump written by both."""
    script = HEAD + textwrap.dedent("""\
        import copy
        target = copy.deepcopy(model).to(torch.bfloat16)
        for m in (model, target):
            register_hook(m, DumpConfig(dump_path=sys.argv[1], token_range="all"))
        ids = torch.tensor([[256, 104, 101, 108, 108, 111]])
        for m in (model, target):
            m.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=258)
        """)
    proc, dump = _run(script, tmp_path, "two_models")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in dump.parent.iterdir()) == ["llmflow_dump", "llmflow_dump_1"]
    dtypes = []
    for path in (dump, dump.parent / "llmflow_dump_1"):
        r = assert_whole(path, steps=2)
        found = {e.dtype for e in r.entries() if e.name.endswith("mlp.down_proj") and e.kind == "output"}
        assert len(found) == 1
        dtypes.append(found.pop())
    assert dtypes == ["float32", "bfloat16"]


def test_a_token_range_the_run_never_reaches_is_said_when_the_dump_ends(tmp_path):
    """token_range=[50] on a 5-token generation dumps the logits alone: the user is told, once, when
    the dump ends, not left with a dump that holds no module."""
    script = HEAD + HOOK.replace("token_range=list(range(8))", "token_range=[50, 60]") + GENERATE
    proc, dump = _run(script, tmp_path, "late")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("token_range [50, 60]: the run made steps 0..4 only, so no step of it was "
                             "dumped") == 1, proc.stderr[-2000:]
    assert {e.level for e in open_dump(dump).entries()} == {"logits"}
    proc, _ = _run(QUICK_START, tmp_path, "reached")
    assert "token_range" not in proc.stderr, proc.stderr[-2000:]
