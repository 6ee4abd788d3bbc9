"""A msit user's script that calls ``register_hook`` twice on one model (a notebook cell run
again) and never ``remove()``: the model is dumped once, by the second hook, with a warning that
names the earlier one; no second copy of every dump (``dialog_0_1`` beside ``dialog_0``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from path_helpers import checkout_path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, torch
from llmflow import DumpConfig, register_hook, set_dump_path
from llmflow.models import encode_prompt, load_model

out = sys.argv[1]
lm = load_model("tiny-qwen2:layers=2,hidden=32,intermediate=64,seed=3")
register_hook(lm.model, DumpConfig(dump_path=out, token_range=[0, 1]))
register_hook(lm.model, DumpConfig(dump_path=out, token_range=[0, 1, 2]))  # the cell run again
for i, prompt in enumerate(["What's deep learning?", "Tell me a story"]):
    set_dump_path(out, dump_tag=f"dialog_{i}")
    ids = torch.tensor([encode_prompt(lm.tokenizer, prompt)])
    with torch.no_grad():
        lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=3)
"""


def test_a_second_register_hook_replaces_the_first(tmp_path):
    script = tmp_path / "infer.py"
    script.write_text(SCRIPT, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "dump")], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == ["dialog_0", "dialog_1"]
    assert "was hooked already; the earlier hook is removed" in proc.stderr
    from llmflow.formats import open_dump

    steps = open_dump(tmp_path / "dump" / "dialog_0").steps()
    assert steps == [0, 1, 2]  # the second hook's token_range
