"""The bisect with its golden streamed (each decoder layer's weights read from the golden's
safetensors checkpoint while it runs) reaches the verdict the whole golden reaches, number for
number, at the prefill and at a decode step, on two families; and `llmflow run` takes
``--set golden_weights=streamed`` on a Hugging Face directory golden."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import bisect_dumps, make_dumps, save_char_tokenizer  # noqa: E402

from llmflow.errors import UserError  # noqa: E402
from llmflow.models import build_tiny  # noqa: E402

SIZE = "layers=4,hidden=64,intermediate=128,seed=3"
FAULTS = {"llama": "plugins/example_faults.py:scale_down_proj_layer_2",
          "qwen2": "plugins/example_faults.py:scale_attn_out_layer_2"}


def save_hf_dir(directory: Path, family: str) -> Path:
    """``tiny-<family>:SIZE`` written as a Hugging Face directory (config + safetensors)."""
    build_tiny(family, SIZE).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module", params=list(FAULTS))
def dumps(request, tmp_path_factory) -> dict:
    """A faulty bf16 target against the fp32 golden, the golden read back from its HF directory."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    made = make_dumps(tmp, f"tiny-{family}:{SIZE}", patch=FAULTS[family])
    made["golden_spec"] = {"model": str(save_hf_dir(tmp / "golden-hf", family)), "device": "cpu",
                           "dtype": "float32"}
    return made


def _comparable(verdict: dict) -> dict:
    """The verdict without what differs between two runs of the same bisect (timings, the cost)."""
    return {k: v for k, v in verdict.items() if k not in ("cost",)}


@pytest.mark.parametrize("replay_step", [None, 2])
def test_streamed_golden_gives_the_whole_goldens_verdict(dumps, replay_step):
    whole = bisect_dumps(dumps, golden_weights="whole", replay_step=replay_step)
    streamed = bisect_dumps(dumps, golden_weights="streamed", replay_step=replay_step)
    assert whole["cost"]["model_runs"]["golden_weights"] == "whole"
    assert streamed["cost"]["model_runs"]["golden_weights"] == "streamed"
    assert streamed["first_bad_module"] and streamed["status"] == "fail", streamed["headline"]
    assert _comparable(streamed) == _comparable(whole)
    runs = {k: v for k, v in streamed["cost"]["model_runs"].items() if k != "golden_weights"}
    assert runs == {k: v for k, v in whole["cost"]["model_runs"].items() if k != "golden_weights"}
    if replay_step:  # replayed from a golden re-run through the decoding loop, with the KV cache
        # (the chosen module's own error per step comes from its layer re-run on the dump's inputs)
        assert streamed["cost"]["model_runs"]["golden_reruns"] == 1
        assert streamed["own_error_steps"]["source"] == "dump + layer re-run"
    else:  # the golden layers recomputed from their dumped inputs, and the op level ran
        assert streamed["cost"]["model_runs"]["golden_layers_recomputed"] > 0 and streamed["first_bad_op"]


def test_auto_streams_a_checkpoint_golden_and_loads_a_built_one_whole(dumps):
    auto = bisect_dumps(dumps, estimate_cost=False, op_level=False)
    assert auto["cost"]["model_runs"]["golden_weights"] == "streamed"
    built = dict(dumps, golden_spec={"model": f"tiny-llama:{SIZE}", "device": "cpu", "dtype": "float32"})
    whole = bisect_dumps(built, estimate_cost=False, op_level=False)
    assert whole["cost"]["model_runs"]["golden_weights"] == "whole"


def test_streamed_asked_of_a_golden_without_checkpoint_names_the_field(dumps):
    built = dict(dumps, golden_spec={"model": f"tiny-llama:{SIZE}", "device": "cpu", "dtype": "float32"})
    with pytest.raises(UserError, match=r"^golden_weights: streamed .*no safetensors checkpoint"):
        bisect_dumps(built, golden_weights="streamed")
    patched = dict(dumps, golden_spec={**dumps["golden_spec"], "patch": FAULTS["llama"]})
    with pytest.raises(UserError, match=r"^golden_weights: streamed .*patch"):
        bisect_dumps(patched, golden_weights="streamed")


def test_a_checkpoint_converted_on_load_is_loaded_whole_by_auto_and_refused_by_streamed(tmp_path):
    """transformers fuses Mixtral's per-expert tensors on load: no parameter is stored as it is."""
    spec = "tiny-mixtral:layers=3,hidden=64,intermediate=128,seed=3"
    dumps = make_dumps(tmp_path, spec, patch="plugins/example_faults.py:scale_expert_layer_1",
                       max_new_tokens=3)
    model = str(tmp_path / "mixtral-hf")
    build_tiny("mixtral", spec.split(":", 1)[1]).save_pretrained(model)
    dumps["golden_spec"] = {"model": model, "device": "cpu", "dtype": "float32"}
    auto = bisect_dumps(dumps, estimate_cost=False)
    assert auto["cost"]["model_runs"]["golden_weights"] == "whole"
    assert auto["first_bad_layer"] == "model.layers.1", auto["headline"]
    with pytest.raises(UserError, match=r"^golden_weights: streamed cannot load the golden model: .*tensor"):
        bisect_dumps(dumps, golden_weights="streamed", estimate_cost=False)


# -- the user's way --------------------------------------------------------------------------------

def llmflow_run(run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "llmflow.cli", "run", "llama2_bisect", "--run-dir", str(run_dir),
            "--progress", "plain"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=run_dir.parent)


def test_llmflow_run_bisects_with_the_golden_streamed(tmp_path):
    model = save_hf_dir(tmp_path / "tiny-hf", "llama")
    save_char_tokenizer(model)
    proc = llmflow_run(tmp_path / "run", f"golden_model={model}", f"target_model={model}",
                       "max_new_tokens=4", "target_patch=../plugins/example_faults.py:wrong_act_layer_2",
                       "golden_weights=streamed")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("FAILED: model.layers.2.mlp.act_fn")
    verdict = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    assert verdict["cost"]["model_runs"]["golden_weights"] == "streamed"
    assert verdict["first_bad_op"] == "model.layers.2.mlp.act_fn/relu.0"


def test_llmflow_run_refuses_streamed_for_a_golden_built_in_code(tmp_path):
    tiny = f"tiny-llama:{SIZE}"
    proc = llmflow_run(tmp_path / "run", f"golden_model={tiny}", f"target_model={tiny}", "max_new_tokens=2",
                       "golden_weights=streamed")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "golden_weights" in last and "no safetensors checkpoint" in last, last
    proc = llmflow_run(tmp_path / "run2", f"golden_model={tiny}", "golden_weights=sideways")
    assert proc.returncode == 2 and "golden_weights=sideways: 'sideways' is not one of" in proc.stderr
