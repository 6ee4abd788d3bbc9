"""The dump stage end to end (workflow runner, subprocess worker) and crash tolerance (SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from path_helpers import checkout_path

from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.stages.dump import DumpStage
from llmflow.workflow import run_workflow

TINY = "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"


def _workflow(tmp_path: Path, **dump_with) -> Path:
    with_ = {"model": TINY, "prompt": "hello there", "max_new_tokens": 3,
             "seed_settings": "${stages.seed.outputs.settings}", **dump_with}
    wf = tmp_path / "wf.yaml"
    wf.write_text(json.dumps({"name": "dump-test", "stages": {
        "seed": {"uses": "seed", "with": {"seed": 7}},
        "dump-golden": {"uses": "dump", "needs": ["seed"], "with": with_},
    }}))
    return wf


def test_dump_stage_through_the_runner(tmp_path):
    res = run_workflow(_workflow(tmp_path, mode="all", token_range=[0, 2]), run_dir=tmp_path / "run")
    st = res.stages["dump-golden"]
    assert st.status == "done", st.error
    out = st.outputs
    final = tmp_path / "run" / "dump-golden"
    assert out["dump_dir"] == str(final / "dump")
    gen = json.loads(Path(out["generation_file"]).read_text())
    assert gen["prompt"] == "hello there" and gen["output_ids"] == out["output_ids"]
    assert len(out["output_ids"]) == 3
    assert gen["input_ids"][0] == 256 and out["text"] == gen["text"]
    assert out["model_spec"] == {"model": TINY, "device": "cpu", "dtype": "float32", "patch": None,
                                 "base_dir": str(tmp_path)}
    r = LlmflowDumpReader(out["dump_dir"])
    meta = r.meta()
    assert meta["complete"] and meta["config"]["token_range"] == [0, 2]
    assert {e.level for e in r.entries()} == {"module", "api", "logits"}
    assert {e.step for e in r.entries() if e.level == "module"} == {0, 2}
    assert r.env()["seed"]["seed"] == 7 and r.env()["generation"]["max_new_tokens"] == 3
    summary = res.summary["dump-golden"]["dump"]
    assert summary["steps"] == 3 and summary["entries"] > 100 and summary["bytes"] > 0
    # the worker ran in its own process with the seed's environment
    assert r.env()["env_vars"].get("PYTHONHASHSEED") == "7"


@pytest.mark.parametrize(("params", "message"), [
    ({"model": "no/such/model"}, "model 'no/such/model'"),
    ({"model": "m.py:make"}, "model 'm.py:make': returned str, not a torch.nn.Module"),
    ({"prompt": "x" * 600}, "prompt: 601 prompt tokens + max_new_tokens 3 exceed the model's context"),
])
def test_dump_stage_bad_input_is_a_user_error(tmp_path, params, message):
    (tmp_path / "m.py").write_text("def make():\n    return 'not a model'\n")
    res = run_workflow(_workflow(tmp_path, **params), run_dir=tmp_path / "run")
    st = res.stages["dump-golden"]
    assert st.status == "failed" and st.user_error, st.error
    assert message in st.error and "\n" not in st.error.strip()
    assert not (tmp_path / "run" / "dump-golden").exists()


def test_bad_dtype_is_caught_when_the_workflow_is_checked(tmp_path):
    from llmflow.errors import UserError

    with pytest.raises(UserError, match=r"stages.dump-golden.with.dtype: 'float8' is not one of"):
        run_workflow(_workflow(tmp_path, dtype="float8"), run_dir=tmp_path / "run")


def test_dump_stage_unwritable_dump_dir(tmp_path):
    from llmflow.errors import UserError
    from llmflow.stages.base import StageContext

    blocker = tmp_path / "file"
    blocker.write_text("")
    params = {"model": TINY, "prompt": "x", "dump_dir": str(blocker / "sub")}
    ctx = StageContext("d", params, tmp_path / "out", tmp_path / "final", tmp_path, tmp_path, {})
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="dump_dir .* not writable"):
        DumpStage().run(ctx)
    assert DumpStage().resources({"device": "cuda:1"}) == {"device:cuda:1"}
    assert DumpStage().resources({"device": "cpu"}) == set()


KILL_SCRIPT = textwrap.dedent("""
    import sys, torch
    from llmflow.dump import DumpConfig, register_hook
    from llmflow.models import load_model, greedy_generate
    lm = load_model("tiny-llama:layers=2,hidden=64,max_pos=4096")
    h = register_hook(lm.model, DumpConfig(dump_path=sys.argv[1], token_range="all"))
    greedy_generate(lm.model, [256, 1, 2, 3], 3000, eos_token_id=-1)
""")


def test_sigkill_mid_dump_leaves_a_readable_dump(tmp_path):
    script = tmp_path / "victim.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stderr=subprocess.PIPE)
    index = tmp_path / "llmflow_dump" / "rank0" / "index.jsonl"
    deadline = time.time() + 60
    try:
        while time.time() < deadline and (not index.exists() or index.stat().st_size < 200_000):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    r = LlmflowDumpReader(tmp_path / "llmflow_dump")
    meta = r.meta()
    assert meta["complete"] is False
    entries = r.entries()
    assert len(r.steps()) >= 3
    for e in entries:
        if e.has_data:
            assert r.load(e).shape == e.shape
    assert r.topology()["execution"]["0"]


EXITING_CODE = textwrap.dedent("""
    import os
    import sys

    from llmflow.models import load_model


    def exit_politely(model):
        sys.exit(0)


    def exit_hard(model):
        os._exit(0)


    def exit_mid_run(model):  # the patch returns; its hook ends the process during the second step
        calls = []

        def hook(module, args):
            calls.append(1)
            if len(calls) == 2:
                sys.exit(0)
        model.register_forward_pre_hook(hook)


    def make_then_exit():
        os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.parametrize(("setting", "message"), [
    ("patch=user.py:exit_politely", "dump: patch 'user.py:exit_politely' called sys.exit(0) before the dump "
                                    "finished"),
    ("patch=user.py:exit_hard", "dump: the dump worker exited with status 0 before writing its result: did "
                                "the patch 'user.py:exit_hard' call sys.exit or os._exit?"),
    ("patch=user.py:exit_mid_run",
     "patch 'user.py:exit_mid_run' called sys.exit(0) before the dump finished"),
    ("model=user.py:make_then_exit", "did the model 'user.py:make_then_exit' call sys.exit or os._exit?"),
])
def test_user_code_that_ends_the_worker_is_named_in_one_line(tmp_path, setting, message):
    """``llmflow run`` with a patch (or a file.py:callable model) that calls sys.exit(0) or
    os._exit(0): exit status 2, one line naming it, no traceback, no stage marked done."""
    (tmp_path / "user.py").write_text(EXITING_CODE)
    (tmp_path / "wf.yaml").write_text(textwrap.dedent(f"""
        name: exiting-user-code
        params:
          model: {{type: string, default: "{TINY}"}}
          patch: {{type: string, default: ""}}
        stages:
          dump:
            uses: dump
            with: {{model: "${{params.model}}", patch: "${{params.patch}}", prompt: hi, max_new_tokens: 3}}
    """))
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "llmflow.cli", "run", str(tmp_path / "wf.yaml"), "--set", setting,
           "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(root)}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert message in out and "Traceback" not in out and "KeyError" not in out
    assert out.strip().splitlines()[-1].startswith("FAILED")
    assert not (tmp_path / "run" / "dump").exists()


def test_a_patch_that_raises_is_bad_input_named_by_its_exception_with_its_traceback_kept(tmp_path):
    """``llmflow run`` with a patch that raises on the model: bad input (exit 2), the last line
    names the patch and what it raised; the worker's log keeps the patch's traceback."""
    (tmp_path / "user.py").write_text("def unsupported(model):\n"
                                      "    raise RuntimeError('kernel not supported')\n")
    (tmp_path / "wf.yaml").write_text(json.dumps({
        "name": "raising-patch",
        "stages": {"dump": {"uses": "dump", "with": {"model": TINY, "patch": "user.py:unsupported",
                                                     "prompt": "hi", "max_new_tokens": 1}}},
    }))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "llmflow", "run", "wf.yaml", "--run-dir", "run"],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(root)}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED: stage 'dump' failed: ")
    said = "patch 'user.py:unsupported' failed on LlamaForCausalLM: RuntimeError: kernel not supported"
    assert said in last, last
    assert "Traceback" not in out  # one line, no traceback on the terminal
    log = tmp_path / "run" / ".failed" / "dump" / "worker.log"
    assert "raise RuntimeError('kernel not supported')" in log.read_text()
