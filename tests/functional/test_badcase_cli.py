"""``llmflow run badcase_bisect`` the user's way, with a prompts file one of whose prompts is longer
than a GPT-2 model's learned positions: bad input (exit 2, one line naming the prompt), found before
any prompt runs or any dump is made, never a traceback and never the exit code of a fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from path_helpers import checkout_path

REPO = Path(__file__).resolve().parents[2]
GPT2 = "tiny-gpt2:layers=2,hidden=64,seed=0"


def test_a_prompt_past_the_models_positions_is_bad_input_naming_it(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "x" * 600}) + "\n",
                       encoding="utf-8")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "llmflow", "run", "badcase_bisect", "--run-dir", str(run), "--progress",
           "plain", "--set", f"golden_model={GPT2}", "--set", f"target_model={GPT2}", "--set",
           "prompts=prompts.jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED: stage 'badcase' failed: badcase: prompt 2 of 2: "), last
    assert "exceed the model's context (max_position_embeddings=512)" in last, last
    assert not (run / "dump-golden").exists() and not (run / "badcase" / "ranking.json").exists()
