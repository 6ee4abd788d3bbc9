"""A clean bf16 port of a model whose attention bf16 rounds more in one layer (Granite's unscaled
attention scores, Nemotron's) is not called a fault: the module standing out from its peers is
checked against the golden module itself run in bf16 on the same inputs, and set aside as the
dtype's rounding. A real fault in the same models is still named. Run as a user runs the recipe."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from workflow_helpers import REPO, llmflow  # noqa: E402

FAMILIES = ["granite", "nemotron"]
SIZE = "layers=5,init=0.2"


def _bisect(tmp_path: Path, family: str, *sets: str) -> tuple[int, str, dict]:
    model = f"tiny-{family}:{SIZE}"
    args = ["run", "llama2_bisect", "--run-dir", str(tmp_path / "run"), "--progress", "plain",
            "--set", f"golden_model={model}", "--set", f"target_model={model}",
            "--set", "target_dtype=bfloat16", "--set", "max_new_tokens=5"]
    for value in sets:
        args += ["--set", value]
    proc = llmflow(*args, timeout=600)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    verdict = json.loads(next((tmp_path / "run").rglob("verdict.json")).read_text())
    return proc.returncode, proc.stdout.strip().splitlines()[-1], verdict


@pytest.mark.parametrize("family", FAMILIES)
def test_a_module_bf16_rounds_more_is_set_aside_not_named(family: str, tmp_path: Path) -> None:
    rc, last, v = _bisect(tmp_path, family)
    assert rc == 0 and last.startswith("PASSED (no fault"), last
    assert v["first_bad_module"] is None, v["headline"]
    aside = [c for c in v["candidates"] if c.get("rounding_ratio") is not None]
    assert aside, [c["name"] for c in v["candidates"][:3]]
    # it stood out from the same module in the other layers, and is exactly the golden's bf16 rounding
    assert aside[0]["score"] >= 3 and aside[0]["rounding_ratio"] == pytest.approx(1.0, abs=0.05)
    assert not aside[0]["anomalous"]
    assert f"Set aside: {aside[0]['name']}" in v["diagnosis"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fault_in_the_same_model_is_still_named(family: str, tmp_path: Path) -> None:
    patch = REPO / "plugins" / "example_faults.py"
    rc, last, v = _bisect(tmp_path, family, f"target_patch={patch}:scale_down_proj_layer_2")
    assert rc == 1 and last.startswith("FAILED: model.layers.2.mlp.down_proj is the fault"), last
    named = v["candidates"][0]
    assert named["name"] == "model.layers.2.mlp.down_proj" and named["rounding_ratio"] > 10
    assert "what the golden module itself gives in the target's dtype" in v["diagnosis"]
