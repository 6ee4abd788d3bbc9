"""Two runs given different prompts compare different inputs at every step: ``llmflow compare``
says so (INCONCLUSIVE, exit 3) instead of naming a failing row, when each dump's
``generation.json`` records its prompt's token ids; the same prompt (or no record of it) leaves
the verdict to the rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_helpers import as_dump  # noqa: E402
from workflow_helpers import llmflow  # noqa: E402


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
    assert lines[-1] == ("INCONCLUSIVE: the two runs were given different prompts (3 and 4 tokens, "
                         "generation.json): every row compares different inputs")
    assert "next: dump both sides with the same prompt, then compare again" in lines
    assert ("prompts differ: golden/generation.json and target/generation.json record different "
            "input_ids") in lines
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    assert summary["divergence"]["prompt_tokens"] == [3, 4]
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
    assert "prompts differ" not in done.stdout
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    assert summary["divergence"]["prompt_tokens"] is None
