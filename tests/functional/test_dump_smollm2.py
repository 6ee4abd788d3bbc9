"""Real SmolLM2 (slow) through the dump stage: an fp32 and a bf16 run, the recipe's dump of the
decoder layers at every step (found from the model's structure), the logits of every step."""

from __future__ import annotations

import json

import pytest

from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.workflow import run_workflow

PROMPT = "Tell me a story about a dragon."


@pytest.mark.slow
def test_smollm2_fp32_and_bf16_dumps_hold_every_layer_at_every_step(tmp_path):
    common = {"model": "smollm2", "prompt": PROMPT, "max_new_tokens": 20, "mode": "none"}
    wf = tmp_path / "wf.yaml"
    wf.write_text(json.dumps({"name": "smollm2-dtypes", "stages": {
        "golden": {"uses": "dump", "with": {**common, "dtype": "float32"}},
        "target": {"uses": "dump", "with": {**common, "dtype": "bfloat16",
                                            "mode": "module", "module_list": ["auto"],
                                            "tensor_part": 1, "token_range": "all"}},
    }}))
    res = run_workflow(wf, run_dir=tmp_path / "run", workers=2)
    golden, target = res.stages["golden"], res.stages["target"]
    assert golden.status == "done" and target.status == "done", (golden.error, target.error)
    g, t = golden.outputs["output_ids"], target.outputs["output_ids"]
    assert len(g) == len(t) == 20
    assert golden.outputs["text"].startswith("The story of a dragon")
    # the target dump holds the 30 decoder layers' outputs at each of the 20 steps, in bf16
    r = LlmflowDumpReader(target.outputs["dump_dir"])
    layers = [e for e in r.entries() if e.level == "module"]
    assert {e.name for e in layers} == {f"model.layers.{i}" for i in range(30)}
    assert {e.dtype for e in layers if e.index == "0"} == {"bfloat16"}
    assert {e.step for e in layers} == set(range(20))
    assert len([e for e in r.entries() if e.level == "logits"]) == 20
