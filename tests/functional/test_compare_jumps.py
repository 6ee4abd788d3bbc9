"""A layer whose error jumps over the previous layer's is the compare's first failing row, though
its error stays below the fail limits; clean targets of several families have no such row; the
ratio is set from ``llmflow compare --jump-ratio`` and from a workflow, and a bad one is refused
in one line (tiny seeded models, fp32 golden against a bf16 target)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import make_dumps  # noqa: E402

from llmflow.compare.divergence import first_mismatch  # noqa: E402
from llmflow.compare.run import CompareOptions, compare_dumps  # noqa: E402
from llmflow.report.html_compare import layer_heat_map, summarize_level  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SIZE = "layers=6,hidden=64,intermediate=128,seed=3"
LAYER = 4
# the activation of layer 4's MLP swapped: its output error ~8x layer 3's, warn level (rel L2 ~0.05)
FAULT = f"plugins/example_faults.py:wrong_act_layer_{LAYER}"


def llmflow(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO), "NO_COLOR": "1"})


def _rows(path: str | Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> dict:
    """Golden and faulty target dumps of a tiny llama (decoder-layer outputs at every step)."""
    return make_dumps(tmp_path_factory.mktemp("jump-llama"), f"tiny-llama:{SIZE}", patch=FAULT)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_layer_whose_error_jumps_is_the_first_failing_row(family, faulty, tmp_path):
    dumps = faulty if family == "llama" else make_dumps(tmp_path, f"tiny-{family}:{SIZE}", patch=FAULT)
    res = compare_dumps(dumps["golden_dump"], dumps["target_dump"], tmp_path / "out")
    first = res["summary"].levels["layer"].first_fail
    assert first is not None
    assert (first.name, first.step, first.code) == (f"model.layers.{LAYER}", 0, "error_jump")
    assert first.reason.startswith("error jump: relative_euclidean_distance ")
    assert f"x the previous layer's (model.layers.{LAYER - 1}: " in first.reason
    parted = first_mismatch(dumps["golden_ids"], dumps["target_ids"])
    assert parted is None or first.step <= parted  # before the texts part, if they part at all
    # the faulty layer's row jumps at every step; no other layer's does; nothing else fails
    rows = _rows(res["csv"]["layer"])
    jumped = {(r["name"], int(r["step"])) for r in rows if r["code"] == "error_jump"}
    assert jumped == {(f"model.layers.{LAYER}", s) for s in range(len(dumps["target_ids"]))}
    assert all(r["verdict"] != "fail" for r in rows if r["code"] != "error_jump")
    saved = json.loads(Path(res["summary_file"]).read_text())
    assert saved["levels"]["layer"]["first_fail"]["code"] == "error_jump"
    assert saved["outcome"]["headline"].endswith(f"first: model.layers.{LAYER} (step 0, error_jump)")
    # the report's heat map outlines the same cell as its first failing one
    heat = layer_heat_map(summarize_level("layer", rows, max_rows=50), None)
    assert heat is not None and (heat["outline"]["step"], heat["outline"]["layer"]) == (0, LAYER)
    # a ratio the faulty layer's jump (7x to 11x here) does not reach: no row jumps
    high = compare_dumps(dumps["golden_dump"], dumps["target_dump"], tmp_path / "high",
                         CompareOptions(jump_ratio=50))
    assert "error_jump" not in high["summary"].codes
    # without the rule the same rows only warn: nothing fails, no first failing row
    off = compare_dumps(dumps["golden_dump"], dumps["target_dump"], tmp_path / "off",
                        CompareOptions(jump_ratio=0))
    assert off["summary"].levels["layer"].first_fail is None and off["summary"].counts["fail"] == 0
    assert {r["code"] for r in _rows(off["csv"]["layer"]) if r["name"] == f"model.layers.{LAYER}"} \
        == {"threshold_warn"}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_clean_targets_have_no_error_jump(family, tmp_path):
    dumps = make_dumps(tmp_path, f"tiny-{family}:{SIZE}")
    # every row held to a warn limit it exceeds, so the rule looks at every layer-to-layer step
    strict = {"bfloat16": {"relative_euclidean_distance": {"warn": 1e-4, "fail": 0.2}}}
    res = compare_dumps(dumps["golden_dump"], dumps["target_dump"], tmp_path / "out",
                        CompareOptions(thresholds=strict))
    layer = _rows(res["csv"]["layer"])
    assert len({r["name"] for r in layer}) == 6 and all(r["code"] == "threshold_warn" for r in layer)
    assert res["summary"].counts["fail"] == 0 and "error_jump" not in res["summary"].codes


def test_jump_ratio_from_the_command_line(faulty, tmp_path):
    g, t = str(faulty["golden_dump"]), str(faulty["target_dump"])
    done = llmflow("compare", "-gp", g, "-mp", t, "-o", "default", cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].endswith(f"first: model.layers.{LAYER} (step 0, error_jump)")
    done = llmflow("compare", "-gp", g, "-mp", t, "-o", "off", "--jump-ratio", "0", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1].startswith("PASSED")
    for bad in ("0.5", "inf"):
        done = llmflow("compare", "-gp", g, "-mp", t, "-o", "bad", "--jump-ratio", bad, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert done.stderr.strip() == \
            f"error: --jump-ratio: expected 0 (off) or a ratio above 1, got {float(bad)!r}"
        assert done.stdout.strip().splitlines()[-1].startswith("FAILED: --jump-ratio: ")
    assert not (tmp_path / "bad").exists()


WORKFLOW = """\
name: jumps
params:
  golden_dump: {type: string}
  target_dump: {type: string}
  jump_ratio: {type: number, default: 5}
stages:
  align:
    uses: align
    with: {golden_dump: "${params.golden_dump}", target_dump: "${params.target_dump}"}
  compare:
    uses: compare
    needs: [align]
    with:
      golden_dump: ${stages.align.outputs.golden_dump}
      target_dump: ${stages.align.outputs.target_dump}
      pairs_file: ${stages.align.outputs.pairs_file}
      jump_ratio: ${params.jump_ratio}
"""


def test_jump_ratio_from_a_workflow(faulty, tmp_path):
    wf = tmp_path / "jumps.yaml"
    wf.write_text(WORKFLOW)
    dumps = ["--set", f"golden_dump={faulty['golden_dump']}", "--set", f"target_dump={faulty['target_dump']}"]
    done = llmflow("run", str(wf), "--run-dir", "on", *dumps, cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "on" / "summary.json").read_text())
    first = summary["compare"]["levels"]["layer"]["first_fail"]
    assert (first["name"], first["code"]) == (f"model.layers.{LAYER}", "error_jump")
    done = llmflow("run", str(wf), "--run-dir", "off", *dumps, "--set", "jump_ratio=0", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    done = llmflow("run", str(wf), "--run-dir", "bad", *dumps, "--set", "jump_ratio=0.5", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]
    # (refused before any stage runs, at the workflow's line that sets it)
    assert done.stdout.strip().splitlines()[-1] == (
        f"FAILED: {wf}:17:19: compare: jump_ratio: expected 0 (off) or a ratio above 1, got 0.5")
    assert not (tmp_path / "bad").exists()
