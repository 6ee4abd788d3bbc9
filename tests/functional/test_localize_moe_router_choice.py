"""A router that chooses wrong is named, not the layer's code nor nothing: an MoE block is replayed
with the golden routing forced into it (so near-tied experts its rounding swaps are no fault),
which hides whatever a router computes after its logits. A router that returns its choice too
(indices and routing weights: transformers' ``*TopKRouter``) is judged on the weights of the tokens
whose experts agree, and on how many experts it picks a token. Faults a port makes in a router:
top-1 where the model routes top-2, and the top-k weights not renormalised; families x faults,
each bisected the user's way (``llmflow run llama2_bisect`` with a patch file)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bisect_helpers import bisect_dumps, make_dumps
from path_helpers import checkout_path

REPO = Path(__file__).resolve().parents[2]
LAYER = 1
PATCHES = f'''
import torch

LAYER = {LAYER}


def top1(model):
    model.model.layers[LAYER].mlp.gate.top_k = 1


def no_renormalisation(model):
    gate = model.model.layers[LAYER].mlp.gate
    if hasattr(gate, "norm_topk_prob"):
        gate.norm_topk_prob = False
        return
    forward = gate.forward

    def without(hidden):  # the top-k softmax probabilities as they are, not divided by their sum
        logits, _weights, experts = forward(hidden)
        return logits, torch.softmax(logits.float(), -1).gather(-1, experts).to(_weights.dtype), experts
    gate.forward = without
'''


@pytest.fixture(scope="module")
def golden_runs() -> dict[str, Path]:
    """family -> the run dir of its first bisect. Every bisect of a family runs the same golden (the
    unpatched model in fp32, the recipe's prompt, 4 tokens): a later one starts from a copy of that
    run dir, where the golden's dump is reused and only the target's stages run again."""
    return {}


@pytest.mark.parametrize(("family", "fault"), [("mixtral", "top1"), ("mixtral", "no_renormalisation"),
                                               ("qwen3-moe", "top1"), ("deepseek-v3", "no_renormalisation")])
def test_a_router_choosing_wrong_is_named(tmp_path, family, fault, golden_runs):
    (tmp_path / "router_faults.py").write_text(PATCHES, encoding="utf-8")
    model = f"tiny-{family}:layers=4"
    run_dir = tmp_path / "run"
    reused = family in golden_runs
    if reused:
        shutil.copytree(golden_runs[family], run_dir, symlinks=True)
    cmd = [sys.executable, "-m", "llmflow", "run", "llama2_bisect", "--run-dir", str(run_dir), "--progress",
           "plain", "--set", f"golden_model={model}", "--set", f"target_model={model}",
           "--set", "max_new_tokens=4", "--set", f"target_patch={tmp_path / 'router_faults.py'}:{fault}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    if reused:
        assert "dump-golden: cached" in done.stdout, done.stdout[-3000:]
    elif "dump-golden: done" in done.stdout:
        golden_runs[family] = run_dir
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    gate = f"model.layers.{LAYER}.mlp.gate"
    assert last.startswith(f"FAILED: {gate} is the fault"), last
    verdict = json.loads((run_dir / "bisect" / "verdict.json").read_text())
    assert verdict["first_bad_module"] == gate, verdict["headline"]
    chosen = next(c for c in verdict["candidates"] if c["name"] == gate)
    assert chosen["anomalous"], chosen


def test_a_phimoe_port_blames_no_router_for_bf16_and_names_one_computing_wrong(tmp_path):
    """PhiMoE's router (sparsemixer) weighs a token's experts by the softmax of the logits within a
    margin of the best: where bf16 moves a logit across it, a weight jumps though the experts agree
    (on some CPUs its own error is 20-30x the other layers' routers on a clean port). The golden
    router run in bf16 jumps alike: a clean port is never failed; a router computing wrong is named."""
    model = "tiny-phimoe:layers=4,hidden=64,intermediate=128,seed=1"
    dumps = make_dumps(tmp_path / "clean", model)
    clean = bisect_dumps(dumps, estimate_cost=False)
    assert clean["status"] != "fail" and clean["first_bad_module"] is None, clean["headline"]
    routers = [c for c in clean["candidates"] if c["name"].endswith("mlp.router") and c.get("rounding_ratio")]
    assert all(c["rounding_ratio"] < 3 for c in routers), routers  # (where they stood out: set aside)
    (tmp_path / "faulty").mkdir()
    patch = "plugins/example_faults.py:wrong_router_layer_2"
    faulty_dumps = make_dumps(tmp_path / "faulty", model, golden_dir=dumps["golden_dump"], patch=patch)
    faulty = bisect_dumps(faulty_dumps, estimate_cost=False)
    assert faulty["status"] == "fail", faulty["headline"]
    assert faulty["first_bad_module"] == "model.layers.2.mlp.router", faulty["headline"]
