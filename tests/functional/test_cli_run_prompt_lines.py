"""A prompt given on the command line keeps its lines: ``--set prompt=$'line one\\nline two'`` (a
line break typed in bash), bare or inside quotes, reaches the model and the generation file as two
lines (the other spellings: ``tests/unit/test_cli_validate.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

from llmflow.models import encode_prompt, load_model

REPO = Path(__file__).resolve().parents[2]
TINY = "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"
TWO_LINES = "line one\nline two"


def workflow(tmp_path: Path) -> Path:
    wf = tmp_path / "wf.yaml"
    wf.write_text(json.dumps({"name": "prompt-lines", "params": {
        "prompt": {"type": "string", "default": "hello"}}, "stages": {
        "dump": {"uses": "dump", "with": {"model": TINY, "prompt": "${params.prompt}", "max_new_tokens": 2,
                                          "token_range": [0]}}}}))
    return wf


@pytest.mark.parametrize("typed", [TWO_LINES, '"line one\nline two"'], ids=["as-typed", "quoted"])
def test_a_two_line_prompt_stays_two_lines(tmp_path: Path, typed: str) -> None:
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "llmflow.cli", "run", str(workflow(tmp_path)), "--run-dir",
                           str(run), "--progress", "plain", "--set", f"prompt={typed}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    generation = json.loads((run / "dump" / "generation.json").read_text())
    assert generation["prompt"] == TWO_LINES
    assert generation["input_ids"] == encode_prompt(load_model(TINY).tokenizer, TWO_LINES)
    assert json.loads((run / "summary.json").read_text())["params"]["prompt"] == TWO_LINES
