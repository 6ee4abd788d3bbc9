"""Real SmolLM2 (slow): a float32 golden and a bfloat16 target on CPU diverge within 20 tokens."""

from __future__ import annotations

import json

import pytest

from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.workflow import run_workflow

PROMPT = "Tell me a story about a dragon."


@pytest.mark.slow
def test_smollm2_fp32_and_bf16_texts_differ_within_20_tokens(tmp_path):
    common = {"model": "smollm2", "prompt": PROMPT, "max_new_tokens": 20, "mode": "none"}
    wf = tmp_path / "wf.yaml"
    wf.write_text(json.dumps({"name": "smollm2-dtypes", "stages": {
        "golden": {"uses": "dump", "with": {**common, "dtype": "float32"}},
        "target": {"uses": "dump", "with": {**common, "dtype": "bfloat16",
                                            "mode": "module", "module_list": ["LlamaDecoderLayer"],
                                            "tensor_part": 1, "token_range": [0]}},
    }}))
    res = run_workflow(wf, run_dir=tmp_path / "run", workers=2)
    golden, target = res.stages["golden"], res.stages["target"]
    assert golden.status == "done" and target.status == "done", (golden.error, target.error)
    g, t = golden.outputs["output_ids"], target.outputs["output_ids"]
    assert len(g) == len(t) == 20
    first = next(i for i, (a, b) in enumerate(zip(g, t, strict=True)) if a != b)
    assert first < 20 and golden.outputs["text"] != target.outputs["text"]
    assert golden.outputs["text"].startswith("The story of a dragon")
    # the target dump holds the 30 decoder layers' outputs at the prefill step, in bf16
    r = LlmflowDumpReader(target.outputs["dump_dir"])
    layers = [e for e in r.entries() if e.level == "module"]
    assert len({e.name for e in layers}) == 30 and {e.dtype for e in layers if e.index == "0"} == {"bfloat16"}
    assert len([e for e in r.entries() if e.level == "logits"]) == 20
