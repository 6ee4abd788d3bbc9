"""The bisect on decoder families users bring as a Hugging Face directory and that differ in what
the localisation reads: DeepSeek-V3 (multi-head latent attention, shared + routed experts, a dense
first layer), GLM-4 (four norms a layer, a fused gate/up projection), GLM-4.5's MoE, OLMo-2 (no
norm before the attention: the residual stream grows layer by layer into the projections),
StarCoder2 (LayerNorm, biases), GPT-OSS (attention sinks, routed experts only), Granite-MoE,
ERNIE-4.5's MoE, EXAONE 4 (its norms after the attention and the MLP, a QK-norm, sliding-window
layers) and Ministral (sliding-window attention). Each is a tiny seeded model saved with
``save_pretrained`` and a tokenizer: a clean bf16 target blames nothing, a planted fault is named
to its layer and module, and ``llmflow run`` names it the user's way (one run per family)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, golden_maker, make_dumps, run_bisect_recipe, tiny_model_dirs  # noqa: E402
from example_faults import faulty_module, make_fault  # noqa: E402

from llmflow.models import load_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAYER = 2
SIZE = "layers=4,hidden=64,intermediate=128,seed=3"
#: family -> (the fault run through `llmflow run`, the faults run through the library). In a
#: mixture-of-experts layer scale_down_proj and wrong_act break the shared expert.
FAULTS: dict[str, tuple[str, list[str]]] = {
    "deepseek-v3": ("scale_expert", ["scale_down_proj", "noisy_q_proj"]),
    "glm4": ("wrong_eps", ["scale_down_proj"]),
    "glm4-moe": ("wrong_router", ["wrong_act"]),
    "olmo2": ("scale_attn_out", ["wrong_eps"]),
    "starcoder2": ("wrong_act", ["scale_attn_out"]),
    "gpt-oss": ("scale_expert", ["wrong_router"]),
    "granite-moe": ("scale_expert", ["wrong_router"]),
    "ernie4.5-moe": ("scale_down_proj", ["scale_expert"]),
    "exaone4": ("wrong_eps", ["scale_attn_out"]),
    "ministral": ("scale_down_proj", []),
}
LIBRARY_CASES = [(family, fault) for family, (_, faults) in FAULTS.items() for fault in faults]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> Callable[[str], Path]:
    """family -> its tiny model saved as a Hugging Face directory with a tokenizer, made once."""
    return tiny_model_dirs(tmp_path_factory, SIZE)


@pytest.fixture(scope="module")
def goldens(tmp_path_factory, model_dirs):
    """One golden dump per family, made on first use."""
    return golden_maker(tmp_path_factory, lambda family: str(model_dirs(family)))


def _bisect(family: str, fault: str | None, model_dirs, goldens, tmp_path: Path) -> dict:
    patch = f"plugins/example_faults.py:{fault}_layer_{LAYER}" if fault else None
    dumps = make_dumps(tmp_path, str(model_dirs(family)), patch=patch, golden_dir=goldens(family))
    return bisect_dumps(dumps, estimate_cost=False)


def _faulty_module(model_dir: Path, fault: str) -> str:
    return faulty_module(load_model(str(model_dir)).model, fault, LAYER)


@pytest.mark.parametrize("family", list(FAULTS))
def test_clean_bf16_target_blames_nothing(family, model_dirs, goldens, tmp_path):
    v = _bisect(family, None, model_dirs, goldens, tmp_path)
    assert v["status"] == "pass", v["headline"]
    assert v["first_bad_module"] is None and v["replay"]["replayed"] > 0
    assert v["replay"]["not_replayable"] == 0, v["replay"]["reasons"]


@pytest.mark.parametrize(("family", "fault"), LIBRARY_CASES)
def test_fault_named_to_layer_and_module(family, fault, model_dirs, goldens, tmp_path):
    v = _bisect(family, fault, model_dirs, goldens, tmp_path)
    want = _faulty_module(model_dirs(family), fault)
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == want, [c["name"] for c in v["candidates"][:3]]
    assert v["first_bad_layer"] == f"model.layers.{LAYER}" and want.startswith(v["first_bad_layer"] + ".")
    assert v["first_bad_op"] and v["first_bad_op"].startswith(want)


def test_a_fault_in_a_module_no_other_layer_has_says_what_it_was_compared_with(model_dirs, goldens,
                                                                                  tmp_path):
    """DeepSeek-V3's first layer is dense: its MLP has no copy in the other layers (their MLPs are
    experts), so its own error is measured against the model's median module."""
    patch = "plugins/example_faults.py:scale_down_proj_layer_0"
    model = str(model_dirs("deepseek-v3"))
    dumps = make_dumps(tmp_path, model, patch=patch, golden_dir=goldens("deepseek-v3"))
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "fail" and v["first_bad_module"] == "model.layers.0.mlp.down_proj", v["headline"]
    assert "median own error of the model's modules (no other layer has this module)" in v["headline"]
    assert "same module in the other layers" not in v["headline"] + v["diagnosis"]


@pytest.mark.parametrize(("family", "fault", "says"), [
    ("deepseek-v3", "hand_attention", "DeepseekV3Attention has no q_proj, k_proj, v_proj"),
    ("gpt-oss", "wrong_act", "has no dense MLP: its mixture of experts has no shared expert"),
])
def test_a_fault_that_does_not_fit_the_family_says_why_before_anything_runs(family, fault, says, model_dirs):
    model = load_model(str(model_dirs(family))).model
    with pytest.raises(ValueError, match=says):
        make_fault(fault, LAYER)(model)


# -- the user's way --------------------------------------------------------------------------------

def _patch(fault: str) -> str:
    return f"{REPO / 'plugins' / 'example_faults.py'}:{fault}_layer_{LAYER}"


def _user_runs(model: Path, family: str, run_dir: Path) -> list[subprocess.CompletedProcess]:
    """The family's `llmflow run` with its fault; for GPT-OSS (routed experts only) then again in the
    same run dir (the golden's dump reused) with scale_down_proj, which has no MLP to break there."""
    sets = (f"golden_model={model}", f"target_model={model}")
    runs = [run_bisect_recipe(run_dir, *sets, f"target_patch={_patch(FAULTS[family][0])}", max_new_tokens=3)]
    if family == "gpt-oss":
        runs.append(run_bisect_recipe(run_dir, *sets, f"target_patch={_patch('scale_down_proj')}",
                                      max_new_tokens=3))
    return runs


@pytest.fixture(scope="module")
def user_runs(request, model_dirs, tmp_path_factory):
    """family -> its `llmflow run`s, for the families whose test is selected, run two at a time: each
    run is three Python processes importing transformers (~20 s of CPU), the bulk of this file."""
    selected = [item.callspec.params["family"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_llmflow_run_names_the_fault"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {family: pool.submit(_user_runs, model_dirs(family), family,
                                   tmp_path_factory.mktemp(f"run-{family}") / "run")
               for family in selected}


@pytest.mark.parametrize("family", list(FAULTS))
def test_llmflow_run_names_the_fault(family, model_dirs, user_runs):
    proc, *more = user_runs[family].result()
    model, fault = model_dirs(family), FAULTS[family][0]
    out = proc.stdout + proc.stderr
    want = _faulty_module(model, fault)
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"FAILED: {want} ") and " is the fault" in last, out[-2000:]
    run_dir = Path(proc.args[proc.args.index("--run-dir") + 1])
    verdict = json.loads((run_dir / "bisect" / "verdict.json").read_text())
    assert verdict["first_bad_module"] == want and verdict["first_bad_op"].startswith(want)
    if fault == "scale_expert":
        assert verdict["first_bad_expert"] == 1, verdict["headline"]

    for proc in more:  # a fault that does not fit the family: one line naming it, exit 2
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out[-3000:]
        assert "Traceback" not in out
        last = proc.stdout.strip().splitlines()[-1]
        assert last.startswith("FAILED") and "scale_down_proj_layer_2" in last, last
        assert "has no dense MLP" in last and "scale_expert" in last, last
