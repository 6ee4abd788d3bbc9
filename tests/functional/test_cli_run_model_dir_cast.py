"""`llmflow run` with the target a Hugging Face directory stored in fp32 and run in bf16, as a user
ports their own checkpoint: the target is cast tensor by tensor (the dump worker's console line
says so), generates what ``from_pretrained`` would have, and the bisect names the planted fault;
a directory whose config cannot be read is a one-line error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import save_char_tokenizer  # noqa: E402

from llmflow.models import build_tiny, encode_prompt, greedy_generate  # noqa: E402
from llmflow.plugins import load_file_ref  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FAULT = f"{REPO / 'plugins' / 'example_faults.py'}:scale_attn_out_layer_2"
PROMPT = "Tell me a story."
CAST_LINE = "casting the checkpoint to bfloat16 tensor by tensor"


def llmflow_run(run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "llmflow", "run", "llama2_bisect", "--run-dir", str(run_dir),
            "--progress", "plain", "--set", f"prompt={PROMPT}", "--set", "max_new_tokens=4"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=run_dir.parent)


def save_qwen2_tied(directory: Path) -> Path:
    """A tiny Qwen2 with tied embeddings, saved in fp32 with a tokenizer."""
    model = build_tiny("qwen2", "layers=4,hidden=64,intermediate=128,seed=3,init=0.2")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(str(directory))
    save_char_tokenizer(directory)
    return directory


def test_a_bf16_target_from_an_fp32_directory_is_cast_and_bisected(tmp_path):
    model = save_qwen2_tied(tmp_path / "qwen2-hf")
    proc = llmflow_run(tmp_path / "run", f"golden_model={model}", f"target_model={model}",
                       "target_dtype=bfloat16", f"target_patch={FAULT}")
    out = proc.stdout
    assert proc.returncode == 1, out[-2000:] + proc.stderr[-2000:]
    assert out.strip().splitlines()[-1].startswith("FAILED: model.layers.2.self_attn")
    assert any("dump-npu:" in line and CAST_LINE in line for line in out.splitlines()), out[-3000:]
    assert "Traceback" not in out + proc.stderr

    # the target generated exactly what transformers' own bf16 load of the same files generates
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16)
    load_file_ref(FAULT, REPO)(reference)
    reference = reference.to(torch.bfloat16).eval()
    ids = encode_prompt(AutoTokenizer.from_pretrained(str(model)), PROMPT)
    generated = json.loads((tmp_path / "run" / "dump-npu" / "generation.json").read_text())
    assert generated["output_ids"] == greedy_generate(reference, ids, 4)


def test_a_directory_with_a_broken_config_is_a_one_line_error(tmp_path):
    model = save_qwen2_tied(tmp_path / "qwen2-hf")
    (model / "config.json").write_text("{not json")
    proc = llmflow_run(tmp_path / "run", f"golden_model={model}", f"target_model={model}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert str(model) in last and "cannot load a Hugging Face model" in last, last
