"""A decode-only fault in a model whose texts may part at the first token through bf16 rounding
(tiny Granite-MoE: a routing near-tie in an early layer). Where the texts part at the first
token, the prefill is the step the bisect looks at first; nothing stands out there, and the first
decode step is replayed too before anything passes: the fault is named at decode step 1, on every
CPU (whether bf16 parts the texts there is the machine's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-granite-moe:layers=6,hidden=64,intermediate=128,seed=3"


def test_a_decode_only_attention_fault_is_named_at_the_first_decode_step(tmp_path):
    patch = f"{REPO / 'plugins' / 'example_faults.py'}:decode_attn_scale_layer_5"
    args = ["run", "llama2_bisect", "--run-dir", str(tmp_path / "run"), "--progress", "plain",
            "--set", f"golden_model={MODEL}", "--set", f"target_model={MODEL}", "--set", "max_new_tokens=8",
            "--set", f"target_patch={patch}"]
    proc = subprocess.run([sys.executable, "-m", "llmflow", *args], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last.startswith("FAILED: model.layers.5.self_attn is the fault") and "decode step 1" in last, last
    verdict = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    assert verdict["first_bad_module"] == "model.layers.5.self_attn"
