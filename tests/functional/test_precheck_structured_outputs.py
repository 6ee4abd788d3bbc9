"""Calls with several outputs (``torch.topk``, ``torch.sort``, ``Tensor.max(dim)``,
``torch.var_mean``) as `llmflow run api_precheck` meets them: one row per output, values judged by
the float rules and indices bit-exact; a sort kernel with swapped indices in a user's model and a
router top-k that ranks on a coarse copy of its input (Mixtral, Qwen2-MoE) are named with the
output that is wrong."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
FAULTS = TESTS / "precheck_faults.py"
SMALL = "layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"


def run_workflow(tmp: Path, model: str, patch: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", "run", "api_precheck", "--run-dir",
                           str(tmp / "run"), "--progress", "plain", "--set", f"model={model}",
                           "--set", f"patch={patch}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp)


def rows_by_output(tmp: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(tmp / "run" / "precheck" / "precheck.csv", newline="", encoding="utf-8") as f:
        return {(r["name"], r["output"]): r for r in csv.DictReader(f)}


def summary(tmp: Path) -> dict:
    return json.loads((tmp / "run" / "summary.json").read_text())["precheck"]


def test_each_output_of_topk_sort_max_and_var_mean_is_a_row_of_its_own(tmp_path):
    proc = run_workflow(tmp_path, f"{FAULTS}:sorting_model")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = rows_by_output(tmp_path)
    for call in ("/topk.0", "/sort.0", "/max.0", "/var_mean.0"):
        assert rows[(call, "0")]["status"] == rows[(call, "1")]["status"] == "pass"
    assert rows[("/sort.0", "0")]["dtype"] == "bfloat16" and rows[("/sort.0", "1")]["dtype"] == "int64"
    assert rows[("/var_mean.0", "1")]["dtype"] == "bfloat16"  # the mean: float rules, not bit-exact
    assert rows[("head/linear.0", "")]["status"] == "pass"  # a one-output call keeps one row
    s = summary(tmp_path)
    assert s["totals"]["calls"] == s["totals"]["pass"]  # counted per call, not per output
    assert s["counts"]["sort"] == {"pass": 1}


def test_a_sort_with_wrong_indices_fails_on_its_indices_only_and_reproduces(tmp_path):
    proc = run_workflow(tmp_path, f"{FAULTS}:sorting_model", f"{FAULTS}:swapped_sort_indices")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "first /sort.0 output 1 (step 0)" in last and "bit-exact" in last
    rows = rows_by_output(tmp_path)
    assert rows[("/sort.0", "0")]["status"] == "pass"  # its values are right
    assert rows[("/sort.0", "1")]["status"] == "fail"
    s = summary(tmp_path)
    assert s["totals"]["fail"] == 1 and s["first_fail"]["name"] == "/sort.0"
    script = tmp_path / "run" / "precheck" / s["repros"][0]["script"]
    fresh = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
    assert fresh.returncode == 1 and "REPRODUCED" in fresh.stdout, fresh.stdout + fresh.stderr


@pytest.mark.parametrize("family", ["tiny-mixtral", "tiny-qwen2-moe"])
def test_a_router_topk_ranking_a_coarse_copy_is_named(tmp_path, family):
    proc = run_workflow(tmp_path, f"{family}:{SMALL}", f"{FAULTS}:coarse_router_topk")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    s = summary(tmp_path)
    assert s["totals"]["fail"] == 1 and s["first_fail"]["name"] == "model.layers.1.mlp.gate/topk.0"
    rows = rows_by_output(tmp_path)
    wrong = rows[("model.layers.1.mlp.gate/topk.0", "1")]
    assert wrong["status"] == "fail" and "elements differ (bit-exact rule)" in wrong["reason"]
    assert rows[("model.layers.0.mlp.gate/topk.0", "1")]["status"] == "pass"  # the same op elsewhere
