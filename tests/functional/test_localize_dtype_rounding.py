"""A clean bf16 port of a model whose attention bf16 rounds more in one layer (Granite's unscaled
attention scores, Nemotron's) is not called a fault: the module standing out from its peers is
checked against the golden module itself run in bf16 on the same inputs, and set aside as the
dtype's rounding. A real fault in the same models is still named. Run as a user runs the recipes:
the bisect with the target model, and dump_bisect on the user's own dumps."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from workflow_helpers import REPO, llmflow  # noqa: E402

FAMILIES = ["granite", "nemotron"]
SIZE = "layers=5,init=0.2"


@pytest.fixture(scope="module")
def golden_runs() -> dict[str, Path]:
    """family -> the run dir of its first bisect. Every bisect of a family runs the same golden (the
    model in fp32, the recipe's prompt, 5 tokens): a later one starts from a copy of that run dir,
    where the golden's dump is reused and only the target's stages run again."""
    return {}


def _bisect(tmp_path: Path, family: str, golden_runs: dict[str, Path], *sets: str) -> tuple[int, str, dict]:
    model = f"tiny-{family}:{SIZE}"
    run = tmp_path / "run"
    reused = family in golden_runs
    if reused:
        shutil.copytree(golden_runs[family], run, symlinks=True)
    args = ["run", "llama2_bisect", "--run-dir", str(run), "--progress", "plain",
            "--set", f"golden_model={model}", "--set", f"target_model={model}",
            "--set", "target_dtype=bfloat16", "--set", "max_new_tokens=5"]
    for value in sets:
        args += ["--set", value]
    proc = llmflow(*args, timeout=600)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    if reused:
        assert "dump-golden: cached" in proc.stdout, proc.stdout[-3000:]
    elif "dump-golden: done" in proc.stdout:
        golden_runs[family] = run
    verdict = json.loads(next(run.rglob("verdict.json")).read_text())
    return proc.returncode, proc.stdout.strip().splitlines()[-1], verdict


def _set_aside(v: dict, threshold: float = 3.0) -> list[dict]:
    """The candidates checked against their golden rounding: each must be exactly it (the target
    is the golden model in bf16, so its module computes as the golden module cast to bf16)."""
    aside = [c for c in v["candidates"] if c.get("rounding_ratio") is not None]
    for c in aside:
        assert c["score"] >= threshold and c["rounding_ratio"] == pytest.approx(1.0, abs=0.05), c
        assert not c["anomalous"] and f"{c['name']} ({c['score']:.1f}x its peers" in v["diagnosis"]
    return aside


@pytest.mark.parametrize("family", FAMILIES)
def test_a_module_bf16_rounds_more_is_set_aside_not_named(family: str, tmp_path: Path,
                                                          golden_runs: dict[str, Path]) -> None:
    rc, last, v = _bisect(tmp_path, family, golden_runs)
    # never a fault
    assert rc in (0, 3) and not last.startswith("FAILED"), last
    assert v["first_bad_module"] is None, v["headline"]
    aside = _set_aside(v)
    if family == "granite":  # 6x its peers on every CPU measured; Nemotron's 3.5x is near the threshold
        assert aside, [(c["name"], c["score"]) for c in v["candidates"][:3]]
    # the target is the golden model itself in bf16: logits failing its thresholds there are bf16's
    # own drift, said as such, never an inconclusive verdict advising that very run
    if v["first_bad_token"] is not None and rc == 0:
        assert last.startswith("PASSED (no fault: the target is the golden model itself in bfloat16; its "
                               "logits fail the bfloat16 thresholds at step "), last
    if rc == 3:
        assert not v["inconclusive"]["reason"].startswith("the logits fail"), v["inconclusive"]["reason"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fault_in_the_same_model_is_still_named(family: str, tmp_path: Path,
                                                  golden_runs: dict[str, Path]) -> None:
    patch = REPO / "plugins" / "example_faults.py"
    rc, last, v = _bisect(tmp_path, family, golden_runs, f"target_patch={patch}:scale_down_proj_layer_2")
    assert rc == 1 and last.startswith("FAILED: model.layers.2.mlp.down_proj is the fault"), last
    named = v["candidates"][0]
    assert named["name"] == "model.layers.2.mlp.down_proj" and named["rounding_ratio"] > 10
    assert "what the golden module itself gives in the target's dtype" in v["diagnosis"]


@pytest.fixture(scope="module")
def granite_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's own dumps of tiny Granite (every module, inputs and outputs): fp32, bf16, and bf16
    with a planted fault."""
    from bisect_helpers import user_dump

    root, model = tmp_path_factory.mktemp("granite"), f"tiny-granite:{SIZE}"
    prompt = "Tell me a story about a dragon."
    user_dump(root / "golden", model, {}, prompt=prompt)
    user_dump(root / "clean", model, {}, dtype="bfloat16", prompt=prompt)
    user_dump(root / "fault", model, {}, dtype="bfloat16", prompt=prompt,
              patch=f"{REPO / 'plugins' / 'example_faults.py'}:scale_down_proj_layer_2")
    return root


@pytest.mark.parametrize("target", ["clean", "fault"])
def test_dump_bisect_checks_a_candidate_against_the_golden_rounding(target: str, granite_dumps: Path,
                                                                   tmp_path: Path) -> None:
    """From the target's dump the golden module runs on the target's recorded inputs; its rounding
    is the same module cast to bf16 on them (a decode step's attention over the steps before it).
    The ratio threshold is lowered so that the clean dump's attention stands out."""
    args = ["run", "dump_bisect", "--run-dir", str(tmp_path / "run"), "--progress", "plain",
            "--set", f"golden_dump={granite_dumps / 'golden'}",
            "--set", f"target_dump={granite_dumps / target}",
            "--set", f"golden_model=tiny-granite:{SIZE}", "--set", "ratio_threshold=1.5"]
    proc = llmflow(*args, timeout=600)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    v = json.loads(next((tmp_path / "run").rglob("verdict.json")).read_text())
    if target == "fault":
        assert proc.returncode == 1 and last.startswith("FAILED: model.layers.2.mlp.down_proj is the fault")
        assert v["candidates"][0]["rounding_ratio"] > 10
        return
    assert proc.returncode in (0, 3) and not last.startswith("FAILED"), last
    assert _set_aside(v, threshold=1.5), [(c["name"], c["score"]) for c in v["candidates"][:3]]
