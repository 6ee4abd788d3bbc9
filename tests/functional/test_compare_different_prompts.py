"""Two runs given different prompts compare different inputs at every step: ``llmflow compare``
says so (INCONCLUSIVE, exit 3) instead of naming a failing row, when each dump's
``generation.json`` records its prompt's token ids, or when the dumps record the model's token
ids at the prefill (a user's own script's dumps, no generation record); the same prompt (or no
record of it) leaves the verdict to the rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_helpers import as_dump  # noqa: E402
from workflow_helpers import llmflow  # noqa: E402

NEXT = ("next: dump both sides from the same token ids (the same prompt, chat template, BOS token and "
        "tokenizer), then compare again")
MODEL = "tiny-qwen2:layers=2,hidden=32,intermediate=64,seed=5"


def faulty(layer, x):
    return x * 1.5 if layer == 2 else x


def record(dump: Path, **fields) -> None:
    (dump / "generation.json").write_text(json.dumps({"prompt": "p", "output_ids": [4, 5, 6], **fields}))


@pytest.mark.parametrize("target_fault", [None, faulty])
def test_different_prompts_are_inconclusive_whatever_the_rows(tmp_path, target_fault):
    record(as_dump(tmp_path, "golden"), input_ids=[1, 2, 3])
    record(as_dump(tmp_path, "target", fault=target_fault), input_ids=[1, 2, 9, 7])
    done = llmflow("compare", "-gp", "golden", "-mp", "target", "-o", "out", "--no-xlsx", cwd=tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == ("INCONCLUSIVE: the two runs were not given the same inputs: their prompts' token "
                         "ids differ (3 and 4 tokens; golden/generation.json, target/generation.json)")
    assert NEXT in lines
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    assert summary["different_inputs"].startswith("their prompts' token ids differ (3 and 4 tokens")
    assert summary["outcome"]["status"] == "inconclusive" and summary["verdict"] == "inconclusive"


@pytest.mark.parametrize("prompts", ["same", "not recorded"])
def test_the_same_prompt_leaves_the_verdict_to_the_rows(tmp_path, prompts):
    fields = {"input_ids": [1, 2, 3]} if prompts == "same" else {}
    record(as_dump(tmp_path, "golden"), **fields)
    record(as_dump(tmp_path, "target", fault=faulty), **fields)
    done = llmflow("compare", "-gp", "golden", "-mp", "target", "-o", "out", "--no-xlsx", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("FAILED: ")
    assert "first: model.layers.2" in done.stdout.strip().splitlines()[-1]
    assert "not given the same inputs" not in done.stdout
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    assert summary["different_inputs"] is None


def dump_of(path: Path, prompt: str, patch=None) -> Path:
    """A module dump with inputs, as a user's own script writes one (no generation record)."""
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.models import encode_prompt, load_model

    lm = load_model(MODEL)
    if patch is not None:
        patch(lm.model)
    dump_run(lm, encode_prompt(lm.tokenizer, prompt), 2,
             DumpConfig(dump_path=str(path), token_range="all", tensor_part=2, data_mode="tensor"))
    assert not (path / "generation.json").exists() and not (path.parent / "generation.json").exists()
    return path


def scale_last_layer(model) -> None:
    layer = model.model.layers[-1]
    forward = layer.mlp.forward
    layer.mlp.forward = lambda *a, **k: forward(*a, **k) * 1.5


@pytest.mark.parametrize("patch", [None, scale_last_layer])
def test_dumps_of_different_prompts_without_a_generation_record(tmp_path, patch):
    dump_of(tmp_path / "g" / "dump", "Tell me a story.")
    dump_of(tmp_path / "t" / "dump", "Tell me a poem, please.", patch)
    done = llmflow("compare", "-gp", "g/dump", "-mp", "t/dump", "-o", "out", "--no-xlsx", cwd=tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("INCONCLUSIVE: the two runs were not given the same inputs: "), last
    assert NEXT in done.stdout.splitlines()


def test_dumps_of_one_prompt_without_a_generation_record_are_judged_by_their_rows(tmp_path):
    dump_of(tmp_path / "g" / "dump", "Tell me a story.")
    dump_of(tmp_path / "t" / "dump", "Tell me a story.", scale_last_layer)
    done = llmflow("compare", "-gp", "g/dump", "-mp", "t/dump", "-o", "out", "--no-xlsx", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "model.layers.1.mlp" in done.stdout.strip().splitlines()[-1]
