"""dump_bisect on msprobe's own L0 tensor dumps of attention that takes ``attention_mask=None``
(Qwen2 at the prefill: msprobe writes ``"attention_mask": null`` in the record's ``input_kwargs``).
The replay passes the None as it was given: a clean bf16 target passes, an attention fault is
named at its layer, never "could not be replayed"; a fault between a layer's modules is a lead
(a user's msprobe script run as a subprocess)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

pytest.importorskip("msprobe.pytorch", reason="mindstudio-probe is not installed (optional: "
                                              "pip install mindstudio-probe)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from workflow_helpers import REPO, llmflow  # noqa: E402

MODEL = "tiny-qwen2:layers=4,hidden=64,intermediate=128,seed=3"
SCRIPT = """
import json, sys, torch
from msprobe.pytorch import PrecisionDebugger
from llmflow.models import encode_prompt, load_model

out, dtype, patch = sys.argv[1], sys.argv[2], sys.argv[3]
lm = load_model({model!r}, dtype=dtype, patch=patch if ".py:" in patch else None, base_dir={repo!r})
if patch == "attn":  # layer 1's attention kernel takes a wrong softmax scale
    lm.model.model.layers[1].self_attn.scaling *= 2.5
config = {{"task": "tensor", "dump_path": out, "rank": [], "step": [], "level": "L0",
           "tensor": {{"scope": [], "list": [], "data_mode": ["all"]}}}}
with open(out + ".json", "w") as f:
    json.dump(config, f)
debugger = PrecisionDebugger(config_path=out + ".json")
ids, past, made = torch.tensor([encode_prompt(lm.tokenizer, "The story of a dragon")]), None, []
with torch.no_grad():
    for _ in range(3):  # one msprobe step per token, as a serving loop steps it
        debugger.start(model=lm.model)
        result = lm.model(input_ids=ids, past_key_values=past, use_cache=True)
        debugger.stop()
        debugger.step()
        past, ids = result.past_key_values, result.logits[:, -1:].argmax(-1)
        made.append(int(ids))
with open(out + ".tokens.json", "w") as f:
    json.dump(made, f)
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("msprobe_qwen2")
    script = out / "dump_with_msprobe.py"
    script.write_text(SCRIPT.format(model=MODEL, repo=str(REPO)), encoding="utf-8")
    env = {"PYTHONPATH": checkout_path(REPO)}
    runs = {"golden": ("float32", ""), "clean": ("bfloat16", ""),
            "attn": ("float32", "attn"),
            # a forward hook scales layer 1's attention output after msprobe has recorded it: the
            # fault lies between the layer's modules
            "hook": ("float32", "plugins/example_faults.py:scale_attn_out_layer_1")}
    for name, (dtype, patch) in runs.items():
        proc = subprocess.run([sys.executable, str(script), str(out / name), dtype, patch],
                              capture_output=True, text=True, timeout=600, cwd=out, env={**os.environ, **env})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


@pytest.mark.parametrize(("target", "code", "named"), [("clean", 0, None),
                                                       ("attn", 1, "model.layers.1.self_attn")])
def test_dump_bisect_replays_attention_given_a_none_mask(tmp_path, dumps, target, code, named):
    proc = _dump_bisect(tmp_path, dumps, target)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "could not be replayed" not in proc.stdout
    if named:
        assert last.startswith(f"FAILED: {named} is the fault"), last
    else:
        assert last.startswith("PASSED"), last


def test_a_fault_between_a_layers_modules_is_a_lead_never_a_pass(tmp_path, dumps):
    """Every module matches its golden to the bit except what happens between them in layer 1:
    the layer replayed whole stands out against layers that match exactly (an own error of 0), and
    the bisect says so, INCONCLUSIVE (a golden module on a target dump's inputs is only a lead)."""
    proc = _dump_bisect(tmp_path, dumps, "hook")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last.startswith("INCONCLUSIVE: model.layers.1, replayed whole from the target dump"), last


def test_the_tokens_of_a_loop_whose_prefill_computes_every_position_are_read_step_by_step(tmp_path, dumps):
    """The loop calls the model itself: its prefill's lm_head gives every prompt position's logits
    (msprobe records ``[1, prompt, vocab]``), the decode steps one position's. Each step's token is
    the last position's choice, so the verdict's tokens are the ones the loop generated, at their
    steps, and the decode-only attention fault's tokens part where they do."""
    made = {name: json.loads((dumps / f"{name}.tokens.json").read_text()) for name in ("golden", "attn")}
    _dump_bisect(tmp_path, dumps, "attn")
    verdict = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    rows = {r["step"]: r for r in verdict["token_rows"]}
    assert sorted(rows) == [0, 1, 2], sorted(rows)
    assert [rows[s]["golden_token"] for s in range(3)] == made["golden"]
    assert [rows[s]["target_token"] for s in range(3)] == made["attn"]
    parted = next((s for s in range(3) if made["golden"][s] != made["attn"][s]), None)
    assert verdict["first_mismatch_token"] == parted


def test_inspect_of_the_prefill_head_says_where_the_logits_are(dumps):
    """The head's file holds every prompt position; the step's logits are its last position: asked
    by the file's locator, inspect shows the head's tensor and says which entry is the logits."""
    logits = llmflow("inspect", str(dumps / "golden"), "logits", "--step", "0")
    assert logits.returncode == 0, logits.stdout[-2000:] + logits.stderr[-2000:]
    assert re.search(r"shape \[1, \d+\]", logits.stdout), logits.stdout[:500]  # the last position's
    lines = logits.stdout.splitlines()
    where = next(line.split()[1] for line in lines if line.strip().startswith("locator "))
    head = llmflow("inspect", str(dumps / "golden"), where)
    assert head.returncode == 0, head.stdout[-2000:] + head.stderr[-2000:]
    assert head.stdout.startswith("lm_head output 0"), head.stdout[:500]
    assert "the same tensor is also: logits output 0 (its last position" in head.stdout, head.stdout[-800:]


def _dump_bisect(tmp_path: Path, dumps: Path, target: str):
    return llmflow("run", "dump_bisect", "--run-dir", str(tmp_path / "run"),
                   "--set", f"golden_dump={dumps / 'golden'}", "--set", f"target_dump={dumps / target}",
                   "--set", f"golden_model={MODEL}")
