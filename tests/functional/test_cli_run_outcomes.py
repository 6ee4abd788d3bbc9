"""`llmflow run` of the bisect recipe as a user runs it (a subprocess, shipped workflow names,
--set overrides): the exit code and the last line say what was concluded, 1 FAILED naming the
module, 0 PASSED, 3 INCONCLUSIVE with a `next:` line saying what to run; the demo finds its
planted bug and the plain bf16 port of the same model passes, on any CPU."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import find, parse_dom, run_chromium  # noqa: E402

TINY = "tiny-llama:layers=4,hidden=64,seed=0"
FAULT = "../plugins/example_faults.py:decode_attn_scale_layer_2"  # relative to the workflow file


def llmflow_run(run_dir: Path, *sets: str, workflow: str = "llama2_bisect") -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "llmflow.cli", "run", workflow, "--run-dir", str(run_dir),
            "--progress", "plain"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=run_dir.parent)


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.strip().splitlines()[-1]


def tiny_sets(*extra: str) -> list[str]:
    return [f"golden_model={TINY}", f"target_model={TINY}", "max_new_tokens=6", *extra]


@pytest.fixture(scope="module")
def decode_fault_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run = tmp_path_factory.mktemp("decode-fault") / "run"
    return run, llmflow_run(run, *tiny_sets(f"target_patch={FAULT}"))


def test_a_decode_fault_fails_naming_its_module(decode_fault_run):
    run, proc = decode_fault_run
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert last_line(proc).startswith("FAILED: model.layers.2.self_attn is the fault")
    assert "decode step 1" in last_line(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["outcome"]["stages"] == ["bisect"]


def test_the_bisect_says_on_the_console_when_each_phase_ends(decode_fault_run):
    """One line per phase as it ends, in the order the bisect runs them, each with its seconds;
    the isolation replay says how many modules it replayed, the estimate how it counted."""
    _run, proc = decode_fault_run
    ended = [line.split("bisect: ", 1)[1] for line in proc.stdout.splitlines()
             if line.startswith("[") and "bisect: " in line and " done in " in line]
    phases = [line.split(" done in ")[0] for line in ended]
    assert phases == ["load target model", "token: logits per step", "module: isolation replay (step 1)",
                      "op: replay with API capture", "module: own error per step",
                      "cost: full API dump estimate"], proc.stdout[-3000:]
    assert all(re.search(r" done in \d+\.\d s", line) for line in ended)
    assert ended[2].endswith(" s (52 modules)") and ended[5].endswith(" s (one layer x N)")
    # the recipe's golden dump holds the decoder layers' inputs at every step: no golden re-run
    assert re.search(r" s \(\d+ steps x \d+ modules, dump \+ layer re-run\)$", ended[4]), ended[4]


def test_replaying_a_step_that_holds_no_fault_is_inconclusive_and_says_what_next(decode_fault_run, tmp_path):
    """In a copy of the decode fault's run dir: only the replayed step changes, so both dumps are
    reused and the bisect alone runs again, on the step the user chose."""
    run = tmp_path / "run"
    shutil.copytree(decode_fault_run[0], run, symlinks=True)
    proc = llmflow_run(run, *tiny_sets(f"target_patch={FAULT}", "replay_step=0"))
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "dump-golden: cached" in proc.stdout and "dump-npu: cached" in proc.stdout, proc.stdout[-3000:]
    assert last_line(proc).startswith("INCONCLUSIVE: the logits fail")
    nxt = [ln for ln in proc.stdout.splitlines() if ln.startswith("next:")]
    assert nxt and "--set replay_step=1" in nxt[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "inconclusive"
    assert summary["stages"]["bisect"]["outcome"]["next"].startswith("replay the step whose logits fail")
    # following the advice: the same run dir, the dumps reused, the fault named
    again = llmflow_run(run, *tiny_sets(f"target_patch={FAULT}", "replay_step=1"))
    assert again.returncode == 1 and "model.layers.2.self_attn" in last_line(again)
    assert "dump-golden: cached" in again.stdout and "dump-npu: cached" in again.stdout


def test_a_clean_port_passes(decode_fault_run, tmp_path):
    """In a copy of the decode fault's run dir (the same golden): the golden's dump is reused, the
    target without the fault is dumped again and passes."""
    shutil.copytree(decode_fault_run[0], tmp_path / "run", symlinks=True)
    proc = llmflow_run(tmp_path / "run", *tiny_sets())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert last_line(proc).startswith("PASSED")
    assert "dump-golden: cached" in proc.stdout and "dump-npu: cached" not in proc.stdout, proc.stdout[-3000:]


def test_a_bad_set_value_is_exit_2_in_one_line(tmp_path):
    proc = llmflow_run(tmp_path / "run", *tiny_sets("replay_step=-1"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "replay_step" in proc.stdout + proc.stderr and last_line(proc).startswith("FAILED")
    assert not (tmp_path / "run" / "bisect").exists()


@pytest.mark.slow
def test_the_demo_finds_its_planted_bug_and_the_plain_port_passes(tmp_path):
    """The README's main command: layer 17's decode attention carries a planted softmax-scale bug;
    without it, the same bf16 port passes whether or not this CPU's bf16 makes the texts part."""
    demo = llmflow_run(tmp_path / "demo")
    assert demo.returncode == 1, demo.stdout[-3000:] + demo.stderr[-2000:]
    assert last_line(demo).startswith("FAILED: model.layers.17.self_attn is the fault")
    assert "decode step" in last_line(demo) and "planted bug" in demo.stdout
    assert f"report: {tmp_path / 'demo' / 'report' / 'report.html'}" in demo.stdout
    # a copy of the demo's run dir: the golden's dump is reused, the target's stages run again
    shutil.copytree(tmp_path / "demo", tmp_path / "plain", symlinks=True)
    plain = llmflow_run(tmp_path / "plain", "target_model=smollm2")
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-2000:]
    assert last_line(plain).startswith("PASSED")
    assert "dump-golden: cached" in plain.stdout, plain.stdout[-3000:]
    check_demo_report(tmp_path / "demo")  # (last: it skips where no headless Chromium is installed)


def check_demo_report(run: Path) -> None:
    """The demo's compare and its page lead to the fault. The compare's first failing layer row is
    layer 17's, before the texts part (its error jumps over layer 16's, below the fail limits).
    In a headless browser: the heat map marks the replayed step and layer 17 and outlines that
    row's cell as the first failing one; the module tree has layer 17's attention outlined; the op
    panel shows the first bad op of layer 17's attention from its kept tensors."""
    summary = json.loads((run / "compare" / "compare_summary.json").read_text())
    parted = summary["divergence"]["first_differing_token"]
    first = summary["levels"]["layer"]["first_fail"]
    assert first["name"] == "model.layers.17" and first["code"] == "error_jump", first
    assert parted is None or first["step"] <= parted
    res = run_chromium(run / "report" / "report.html", "--dump-dom")
    if res.returncode != 0:
        raise AssertionError(res.stderr[-2000:])
    dom = parse_dom(res.stdout)
    (html,) = find(dom, "html")
    assert html.attrs.get("data-ready") == "1" and "data-js-error" not in html.attrs, html.attrs
    verdict = json.loads((run / "bisect" / "verdict.json").read_text())
    marks = sorted(m.text for m in find(dom, "path", "marker"))
    assert marks == ["first bad layer: 17", f"first bad token (logits): step {verdict['first_bad_token']}"]
    (cell,) = find(dom, "rect", "outline")
    assert cell.text == f"first failing cell: step {first['step']}, layer 17", cell.text
    (chosen,) = find(dom, "li", id="tree-module-chosen")
    assert chosen.attrs["data-name"] == "model.layers.17.self_attn"
    (panel,) = find(dom, "section", id="op-panel")
    (op_name,) = [c for c in find(dom, "code", "opname") if c.within("section", id="op-panel")]
    assert op_name.text == "model.layers.17.self_attn/scaled_dot_product_attention.0"
    assert "first_bad_op.safetensors" in panel.text
