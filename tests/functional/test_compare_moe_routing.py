"""MoE routers in a compare: a difference in a router's integer expert indices is reported as a
routing flip (``routing_mismatch``, a warning), never as the first failing row; the float rows
(the router's logits, the MoE block's output) carry the verdict. Run through ``llmflow compare``
on dumps of a tiny seeded Mixtral and Qwen2-MoE, as a user's script writes them."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmflow.dump import DumpConfig, dump_run
from llmflow.models import load_model

PROMPT = [1, 7, 12, 30, 41, 5]


def _flip_layer_routing(model: torch.nn.Module, layer: int) -> None:
    """The router's top-1 and top-2 expert indices swapped (its logits untouched): what a fused
    top-k kernel that orders its outputs differently does; the chosen weights follow the indices."""
    gate = model.model.layers[layer].mlp.gate

    def swap(_m, _args, out):
        if not (isinstance(out, tuple) and len(out) == 3):
            return None
        logits, scores, idx = out
        return logits, scores, idx.flip(-1)
    gate.register_forward_hook(swap)


def _dump(spec: str, path: Path, flip: bool, dtype: str = "float32") -> Path:
    loaded = load_model(spec, dtype=dtype)
    if flip:
        _flip_layer_routing(loaded.model, 1)
    dump_run(loaded, PROMPT, 2, DumpConfig(dump_path=str(path), token_range=[0]))
    return path


def _compare(golden: Path, target: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow.cli", "compare", "-gp", str(golden), "-mp",
                           str(target), "-o", str(out)], capture_output=True, text=True, timeout=300)


def _rows(out: Path, level: str = "module") -> list[dict[str, str]]:
    with open(out / f"compare_{level}.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_swapped_expert_indices_are_a_routing_row_not_the_first_fail(family, tmp_path):
    spec = f"tiny-{family}:layers=2,hidden=64,seed=0"
    if not isinstance(getattr(load_model(spec).model.model.layers[1].mlp, "gate", None), torch.nn.Module):
        pytest.skip(f"{family}: no router module in this transformers release")
    golden = _dump(spec, tmp_path / "g", flip=False)
    target = _dump(spec, tmp_path / "t", flip=True)
    out = tmp_path / "cmp"
    proc = _compare(golden, target, out)
    assert proc.returncode in (0, 1), proc.stderr
    rows = _rows(out)
    moe = "model.layers.1.mlp"
    routing = [r for r in rows if r["verdict"] != "unmatched" and r["golden_dtype"].startswith("int")
               and ((r["name"] == f"{moe}.gate" and r["kind"] == "output")
                    or (r["name"] == f"{moe}.experts" and r["kind"] == "input"))]
    assert routing, "the router's indices were compared"
    assert all(r["code"] == "routing_mismatch" and r["verdict"] == "warn" for r in routing), routing
    assert "routing flip" in routing[0]["reason"]
    logits = [r for r in rows if r["name"] == f"{moe}.gate" and r["kind"] == "output"
              and not r["golden_dtype"].startswith("int") and r["verdict"] != "unmatched"]
    assert logits and all(r["verdict"] == "pass" for r in logits)  # the router itself agrees
    # the swapped indices give each expert the other's weight: the block's output shows it, and
    # it (not an index row) is the first failing row
    summary = json.loads((out / "compare_summary.json").read_text())
    first = summary["levels"]["module"]["first_fail"]
    assert first is not None and "int" not in str(first.get("golden_dtype", "")), first
    assert first["name"].startswith(moe), first
    assert proc.returncode == 1 and "routing" not in proc.stdout.strip().splitlines()[-1]


def test_an_untouched_moe_model_has_no_routing_rows(tmp_path):
    spec = "tiny-mixtral:layers=2,hidden=64,seed=0"
    golden = _dump(spec, tmp_path / "g", flip=False)
    target = _dump(spec, tmp_path / "t", flip=False)
    out = tmp_path / "cmp"
    proc = _compare(golden, target, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED")
    assert not [r for r in _rows(out) if r["code"] == "routing_mismatch"]
