"""A float16 port whose attention softmax skips the max-subtraction: where the model's attention
scores reach the 17-24 of a trained LLM (tests/fixtures/sharp_attention.py: layer 4), exp
overflows, the layer's output is NaN and the logits fail at token 0. The bisect names that
attention as an overflow, the op where it starts, and says its ops are not comparable with the
golden's (the port re-implements the attention). A hand-written attention with the same math
passes; one with a real fault (an off-by-one causal mask) is named, op level not comparable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import bisect_dumps, make_dumps  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARP = REPO / "tests" / "fixtures" / "sharp_attention.py"
LAYER = 4  # sharp_attention.SHARP_LAYER
ATTENTION = f"model.layers.{LAYER}.self_attn"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fp16_softmax_overflow_names_the_attention(family, tmp_path):
    dumps = make_dumps(tmp_path, f"{SHARP}:{family}", target_model=f"{SHARP}:{family}_port",
                       target_dtype="float16")
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "fail", v["diagnosis"]
    assert v["first_bad_token"] == 0 and v["first_bad_module"] == ATTENTION, v["candidates"][:3]
    top = v["candidates"][0]
    assert top["name"] == ATTENTION and top["overflow"] and "overflow" in top["reason"]
    assert not any(c.get("overflow") for c in v["candidates"][1:])  # only the sharp layer overflows
    assert v["first_bad_op"] == f"{ATTENTION}/exp.0" and v["overflow"]["op"]["inf"] > 0
    assert "overflows" in v["headline"] and "overflow" in v["diagnosis"]
    assert v["op_level"]["comparable"] is False and "op level not comparable" in v["headline"]
    assert v["op_level"]["target_ops_around"]
    iso = v["curves"]["relative L2 error"]["isolated (worst module, replay)"]
    assert iso[str(LAYER)] == "inf"  # drawn at the top, never as the quietest layer
    assert all(float(x) < 0.1 for k, x in iso.items() if k != str(LAYER))


def test_fp16_port_with_the_same_math_passes(tmp_path):
    dumps = make_dumps(tmp_path, f"{SHARP}:llama", target_model=f"{SHARP}:llama_exact_port",
                       target_dtype="float16")
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "pass", v["diagnosis"]
    assert v["first_bad_module"] is None and v["op_level"] is None and not v["overflow"]["modules"]


def test_reimplemented_attention_with_a_fault_is_named_op_level_not_comparable(tmp_path):
    model = "tiny-llama:layers=6,hidden=64,intermediate=128,seed=3"
    patch = f"plugins/example_faults.py:hand_attention_mask_layer_{LAYER}"
    dumps = make_dumps(tmp_path, model, patch=patch)
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "fail" and v["first_bad_module"] == ATTENTION, v["headline"]
    level = v["op_level"]
    assert level["comparable"] is False and "op level not comparable" in v["headline"]
    assert "not comparable" in v["diagnosis"]
    # the ops listed are the target's own, around where the golden's stop pairing
    around = level["target_ops_around"]
    assert around and all(o["name"].startswith(ATTENTION) for o in around)
    assert v["first_bad_op"] is None or v["first_bad_op"].split("/")[-1].split(".")[0] not in (
        "repeat_interleave", "cat", "mul", "sub", "add")


def test_cli_run_with_an_overflow_scan_names_the_attention(tmp_path):
    """The bisect recipe extended with an overflow-scan of the target dump, run as a user runs it."""
    recipe = REPO / "workflows" / "recipes" / "bisect_base.yaml"
    workflow = tmp_path / "fp16_port.yaml"
    workflow.write_text(f"""
name: fp16-port
extends: {recipe}
stages:
  overflow:
    uses: overflow-scan
    needs: [dump-npu]
    with:
      dump: ${{stages.dump-npu.outputs.dump_dir}}
  bisect:
    needs: [dump-golden, dump-npu, align, compare, overflow]
    with:
      overflow_report: ${{stages.overflow.outputs.report_file}}
""")
    run = tmp_path / "run"
    sets = [f"golden_model={SHARP}:llama", f"target_model={SHARP}:llama_port", "target_dtype=float16",
            "max_new_tokens=4", "prompt=Tell me a story."]
    cmd = [sys.executable, "-m", "llmflow", "run", str(workflow), "--run-dir", str(run),
           "--progress", "plain"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"FAILED: {ATTENTION} overflows"), last
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verdict"]["overflow"]["scan_agrees"] is True, summary["verdict"]
    assert summary["verdict"]["overflow"]["scan_origin"]["name"].startswith(f"model.layers.{LAYER}")
