"""A bf16 port whose logits fail their thresholds with no module standing out is read against the
golden model itself run in bf16 on the same tokens: a port that drifts as bf16 itself does passes,
saying so with both figures; one whose logits go further at a later step (its forward's own code
scales the decode logits, outside any module) stays inconclusive, naming that step and both
figures. Run as a user runs it: ``llmflow run`` on a workflow of their own that extends the shipped
recipe with logits thresholds bf16 always exceeds (so the logits fail on every CPU), a golden given
as a model spec (loaded whole) and as a Hugging Face directory (streamed layer by layer)."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import tiny_model_dirs  # noqa: E402
from workflow_helpers import REPO, llmflow  # noqa: E402

SIZE = "layers=3,hidden=64,intermediate=128,seed=5"
#: family -> how the golden is given: a model spec (loaded whole) or a Hugging Face directory
#: (streamed layer by layer from its safetensors, in the target's dtype for the baseline too)
GOLDENS = {"qwen2": "spec", "gemma2": "directory"}

PATCHES = '''
import functools


def scale_logits(model):
    """The port's forward scales every step's logits by 1.1 (a temperature applied twice, say): no
    greedy token changes, and the bf16 logits warn at the shipped thresholds without failing."""
    forward = model.forward

    @functools.wraps(forward)
    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 1.1
        return out

    model.forward = scaled


def no_change(model):
    """A port that computes as the golden model does in its dtype (fused kernels, say, that round
    alike)."""


def scale_decode_logits(model):
    """The port's forward scales the logits of every decode step by 1.5 after lm_head ran (its own
    code, no module): each call after the first (the prefill) of its generation."""
    forward, calls = model.forward, []

    @functools.wraps(forward)
    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) > 1:
            out.logits = out.logits * 1.5
        return out

    model.forward = scaled
'''


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> dict[str, Path]:
    """The user's workflow (the shipped recipe, its logits judged at limits bf16 rounding always
    exceeds) and their patches."""
    folder = tmp_path_factory.mktemp("user")
    workflow = folder / "tight_logits.yaml"
    workflow.write_text(textwrap.dedent(f"""\
        name: tight-logits
        description: the bisect recipe, its bf16 logits judged at limits bf16 rounding always exceeds
        extends: {REPO / "workflows" / "recipes" / "bisect_base.yaml"}
        stages:
          bisect:
            with:
              thresholds: {{bfloat16: {{relative_euclidean_distance: {{warn: 1.0e-7, fail: 1.0e-6}}}}}}
        """), encoding="utf-8")
    from_dump = folder / "tight_logits_from_dump.yaml"
    from_dump.write_text(textwrap.dedent(f"""\
        name: tight-logits-from-dump
        description: the same, the target's modules known by its dump alone (inputs and outputs)
        extends: {workflow}
        stages:
          dump-npu:
            with:
              tensor_part: 2
          bisect:
            with:
              isolate: target_dump
        """), encoding="utf-8")
    shipped = folder / "shipped_limits.yaml"
    shipped.write_text(textwrap.dedent(f"""\
        name: shipped-limits
        description: the bisect recipe as shipped
        extends: {REPO / "workflows" / "recipes" / "bisect_base.yaml"}
        """), encoding="utf-8")
    warn_only = folder / "warn_only.yaml"
    warn_only.write_text(textwrap.dedent(f"""\
        name: warn-only
        description: the bisect recipe, its bf16 logits warned at any drift and failed at none
        extends: {REPO / "workflows" / "recipes" / "bisect_base.yaml"}
        stages:
          bisect:
            with:
              thresholds: {{bfloat16: {{relative_euclidean_distance: {{warn: 1.0e-7, fail: 10}}}}}}
        """), encoding="utf-8")
    patches = folder / "port.py"
    patches.write_text(PATCHES, encoding="utf-8")
    return {"workflow": workflow, "from_dump": from_dump, "shipped": shipped, "warn_only": warn_only,
            "patches": patches}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return tiny_model_dirs(tmp_path_factory, SIZE)


@pytest.fixture(scope="module")
def golden_runs() -> dict[str, Path]:
    """family -> the run dir of its first bisect: a later one starts from a copy (the golden's dump
    reused, only the target's stages run again)."""
    return {}


def _bisect(family: str, patch: str, tmp_path: Path, user_files, model_dirs,
            golden_runs, workflow: str = "workflow") -> tuple[int, str, dict]:
    """The user's workflow (``workflow``: its key in ``user_files``) run on the family's tiny model
    with the patch; (exit code, last line, verdict.json)."""
    model = f"tiny-{family}:{SIZE}" if GOLDENS[family] == "spec" else str(model_dirs(family))
    run = tmp_path / "run"
    reused = workflow == "workflow" and family in golden_runs
    if reused:
        shutil.copytree(golden_runs[family], run, symlinks=True)
    proc = llmflow("run", str(user_files[workflow]), "--run-dir", str(run), "--progress", "plain",
                   "--set", f"golden_model={model}", "--set", f"target_model={model}",
                   "--set", "max_new_tokens=3", "--set", f"target_patch={user_files['patches']}:{patch}",
                   timeout=600)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, proc.stderr[-3000:]
    if reused:
        assert "dump-golden: cached" in proc.stdout, proc.stdout[-3000:]
    elif "dump-golden: done" in proc.stdout and workflow == "workflow":
        golden_runs[family] = run
    if GOLDENS[family] == "directory":
        assert "golden model loaded streamed" in out, out[-3000:]
    verdict = json.loads((run / "bisect" / "verdict.json").read_text())
    return proc.returncode, proc.stdout.strip().splitlines()[-1], verdict


@pytest.mark.parametrize("family", GOLDENS)
def test_a_port_whose_logits_fail_as_the_dtype_itself_does_passes(family, tmp_path, user_files, model_dirs,
                                                                  golden_runs):
    rc, last, v = _bisect(family, "no_change", tmp_path, user_files, model_dirs, golden_runs)
    assert rc == 0 and last.startswith("PASSED (no fault: no module stands out at "), last
    assert ("the logits fail the bfloat16 thresholds at steps 0..2 no more than the golden model itself "
            "does in bfloat16 on cpu") in last, last
    base = v["dtype_baseline"]
    assert base["covers"] and base["failing_steps"] == [0, 1, 2] and base["error"] is None
    # the port computes as the golden model in bf16 does: the two errors are one
    for row in base["steps"]:
        assert row["target_rel_l2"] == pytest.approx(row["baseline_rel_l2"], rel=1e-3), row
        assert 0 < row["baseline_rel_l2"] < 0.1 and row["baseline_verdict"] == "fail", row
    assert "Against the dtype's own drift" in (tmp_path / "run" / "report" / "report.html").read_text()


def test_a_target_known_by_its_dump_is_read_against_the_golden_model_in_the_dumps_dtype(tmp_path,
                                                                                        user_files):
    """From the target's dump alone (an NPU's, say) the golden model runs in the dtype the dump
    records on the golden's own device: the same port passes, saying on which device."""
    model = f"tiny-qwen2:{SIZE}"
    proc = llmflow("run", str(user_files["from_dump"]), "--run-dir", str(tmp_path / "run"), "--progress",
                   "plain", "--set", f"golden_model={model}", "--set", f"target_model={model}",
                   "--set", "max_new_tokens=3", "--set", f"target_patch={user_files['patches']}:no_change",
                   timeout=600)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, last
    assert "no more than the golden model itself does in bfloat16 on cpu" in last, last
    v = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    assert v["isolation"] == "target_dump" and v["dtype_baseline"]["covers"], v["dtype_baseline"]


@pytest.mark.parametrize("family", GOLDENS)
def test_decode_logits_beyond_the_dtypes_drift_are_the_ports_own(family, tmp_path, user_files, model_dirs,
                                                                 golden_runs):
    rc, last, v = _bisect(family, "scale_decode_logits", tmp_path, user_files, model_dirs, golden_runs)
    assert rc == 3, last
    assert last.startswith("INCONCLUSIVE: the logits fail the bfloat16 thresholds at step 0"), last
    base = v["dtype_baseline"]
    assert not base["covers"] and base["step"] == 1 and base["failing_steps"] == [0, 1, 2]
    assert base["target_rel_l2"] > 10 * base["baseline_rel_l2"] > 0, base
    prefill = base["steps"][0]  # the prefill is the golden model's own drift: the fault is decode only
    assert prefill["target_rel_l2"] == pytest.approx(prefill["baseline_rel_l2"], rel=1e-3), prefill
    reason, nxt = v["inconclusive"]["reason"], v["inconclusive"]["next"]
    assert "at step 1 the target's logits are " in reason and "for the golden model itself in bfloat16 on " \
           "cpu: error of the port's own" in reason, reason
    assert "step 1" in nxt, nxt


def test_logits_that_warn_beyond_the_dtypes_drift_are_not_passed(tmp_path, user_files, model_dirs,
                                                                 golden_runs):
    """At the shipped thresholds a 10% logits scale warns and never fails, and changes no greedy
    token: read against the golden model itself in bf16 (streamed from the user's Gemma2 directory,
    whose forward soft-caps the logits) it is the port's own error, inconclusive."""
    rc, last, v = _bisect("gemma2", "scale_logits", tmp_path, user_files, model_dirs, golden_runs,
                          workflow="shipped")
    assert rc == 3 and last.startswith("INCONCLUSIVE: "), last
    assert "no step's logits fail the bfloat16 thresholds, but they warn at step" in last, last
    base = v["dtype_baseline"]
    assert base["warning"] and not base["covers"] and base["error"] is None, base
    assert base["target_rel_l2"] > 5 * base["baseline_rel_l2"] > 0, base
    assert v["first_bad_token"] is None and v["first_bad_module"] is None, v["headline"]
    reason, nxt = v["inconclusive"]["reason"], v["inconclusive"]["next"]
    assert "error of the port's own" in reason and "for the golden model itself in bfloat16 on cpu" in reason
    assert "logits scale" in nxt, nxt
    assert "whose logits warn (none fails)" in (tmp_path / "run" / "report" / "report.html").read_text()


def test_logits_that_warn_as_the_dtype_itself_does_pass(tmp_path, user_files, model_dirs, golden_runs):
    """Logits warned at any drift: a port that computes as the golden model does in bf16 passes,
    its diagnosis giving both figures."""
    rc, last, v = _bisect("qwen2", "no_change", tmp_path, user_files, model_dirs, golden_runs,
                          workflow="warn_only")
    assert rc == 0 and last.startswith("PASSED ("), last
    base = v["dtype_baseline"]
    assert base["warning"] and base["covers"] and base["failing_steps"] == [0, 1, 2], base
    assert "Where the logits warn (steps 0..2), they are no further from the golden's than those of the " \
           "golden model itself in bfloat16 on cpu" in v["diagnosis"], v["diagnosis"]
