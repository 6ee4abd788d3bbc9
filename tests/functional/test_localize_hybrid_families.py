"""The bisect on hybrid decoder families, whose layers are of two kinds and whose decode steps read
more than keys and values: Qwen3-Next and Qwen3.5 (Gated DeltaNet linear attention beside full
attention; MoE), MiniMax (lightning linear attention, its own cache class), Hunyuan's MoE, LFM2
(short convolutions beside attention), Falcon-H1 and Bamba (Mamba mixers). Tiny seeded models,
both directions:

* the target model replayed on the golden inputs (``isolate: target_model``): a fault in a
  layer's token mixer (linear attention, convolution, Mamba or attention) is named to that
  module, one in lm_head to lm_head, one in a layer's own code on the decode path only to the
  layer at a decode step; a clean bf16 target blames nothing;
* the golden modules replayed on the target's dump (``isolate: target_dump``), of every module
  or of the decoder layers alone: the module or the layer is named, or, for a difference that
  arises between a layer's modules, INCONCLUSIVE naming the layer; never PASSED for a fault,
  never FAILED for a clean target;
* ``llmflow run`` names the fault the user's way, both recipes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, golden_maker, make_dumps, user_dump, user_golden_maker  # noqa: E402
from example_faults import OUTSIDE_FAULTS, faulty_module  # noqa: E402

from llmflow.models import load_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FAULTS_FILE = REPO / "plugins" / "example_faults.py"
SIZE = "layers=5,hidden=64,intermediate=128,seed=3"
PROMPT = "Tell me a story."
#: family -> the layer whose token mixer the fault breaks: a linear-attention, convolution or
#: Mamba layer where the family has them (MiniMax's layer 2 is a full attention, its 1 a linear one)
MIXER_LAYER = {"qwen3-next": 2, "minimax": 1, "hunyuan-moe": 2, "lfm2": 2, "qwen3.5": 2, "qwen3.5-moe": 2,
               "falcon-h1": 2, "bamba": 2}
#: LFM2's short convolutions and Falcon-H1's Mamba mixers add little to the residual stream at the
#: default init: one scaled by 1.5 moves its layer's output less than bf16 rounding does. At init
#: 0.2 they weigh as a trained model's do.
OWN_SIZE = {"lfm2": SIZE + ",init=0.2", "falcon-h1": SIZE + ",init=0.2"}
#: every fault, both directions; the later families (Qwen3.5, Falcon-H1, Bamba) with a fault in
#: their token mixer, the golden model on the target's inputs
FAMILIES = ["qwen3-next", "minimax", "hunyuan-moe", "lfm2"]
MORE_FAMILIES = ["qwen3.5", "qwen3.5-moe", "falcon-h1", "bamba"]
IN_LAYER_FAULTS = ["none", "scale_attn_out", "decode_layer_code"]
TARGET_MODEL_CASES = ([(f, fault) for f in FAMILIES for fault in IN_LAYER_FAULTS]
                      + [("minimax", "scale_lm_head")] + [(f, "scale_attn_out") for f in MORE_FAMILIES])
EVERY_MODULE_CASES = [(f, fault) for f in FAMILIES for fault in IN_LAYER_FAULTS]
LAYERS_ONLY_CASES = [(f, fault) for f in FAMILIES for fault in IN_LAYER_FAULTS] + [("lfm2", "scale_lm_head")]
CODE_LAYER = 2  # decode_layer_code's layer


def spec(family: str) -> str:
    return f"tiny-{family}:{OWN_SIZE.get(family, SIZE)}"


def assert_not_failed(v: dict) -> None:
    """A clean target: PASSED, or INCONCLUSIVE saying why and what to run next, never FAILED."""
    assert v["status"] in ("pass", "inconclusive"), v["headline"]
    if v["status"] == "inconclusive":
        assert v["inconclusive"]["reason"] and v["inconclusive"]["next"], v["inconclusive"]


def patch_of(family: str, fault: str) -> str | None:
    if fault == "none":
        return None
    if fault in OUTSIDE_FAULTS:
        return f"{FAULTS_FILE}:{fault}"
    layer = CODE_LAYER if fault == "decode_layer_code" else MIXER_LAYER[family]
    return f"{FAULTS_FILE}:{fault}_layer_{layer}"


def expected_module(family: str, fault: str) -> str:
    model = load_model(spec(family)).model
    if fault in OUTSIDE_FAULTS:
        return OUTSIDE_FAULTS[fault][1](model)
    layer = CODE_LAYER if fault == "decode_layer_code" else MIXER_LAYER[family]
    return faulty_module(model, fault, layer)


# -- the target model on the golden inputs --------------------------------------------------------

@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return golden_maker(tmp_path_factory, spec)


@pytest.mark.parametrize(("family", "fault"), TARGET_MODEL_CASES)
def test_the_target_model_names_the_fault(family, fault, goldens, tmp_path):
    dumps = make_dumps(tmp_path, spec(family), patch=patch_of(family, fault), golden_dir=goldens(family))
    v = bisect_dumps(dumps, estimate_cost=False)
    if fault == "none":
        assert_not_failed(v)
        return
    want = expected_module(family, fault)
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == want, [c["name"] for c in v["candidates"][:3]]
    if fault == "decode_layer_code":  # the prefill is untouched: the layer at a decode step
        assert v["headline"].startswith(f"{want}'s own code is the fault"), v["headline"]
        assert v["replay"]["step"] > 0, v["headline"]
    else:
        assert v["first_bad_op"] and v["first_bad_op"].startswith(want + "/"), v["first_bad_op"]


# -- the golden modules on the target's dump ------------------------------------------------------

EVERY_MODULE: dict = {}
LAYERS_ONLY = {"module_list": ["auto"]}


@pytest.fixture(scope="module")
def dump_goldens(tmp_path_factory):
    return user_golden_maker(tmp_path_factory)


def bisect_target_dump(family: str, fault: str, scope: dict, dump_goldens, tmp_path: Path) -> dict:
    target = user_dump(tmp_path / "target", spec(family), scope, dtype="bfloat16",
                       patch=patch_of(family, fault))
    return bisect_dumps({"golden_dump": dump_goldens(spec(family), scope), "target_dump": target,
                         "golden_spec": {"model": spec(family), "device": "cpu", "dtype": "float32"}},
                        isolate="target_dump", estimate_cost=False)


@pytest.mark.parametrize(("family", "fault"), EVERY_MODULE_CASES)
def test_a_dump_of_every_module_names_the_module_or_the_layer(family, fault, dump_goldens, tmp_path):
    v = bisect_target_dump(family, fault, EVERY_MODULE, dump_goldens, tmp_path)
    if fault == "none":
        assert_not_failed(v)
        return
    want = expected_module(family, fault)
    if fault == "scale_attn_out":
        assert v["status"] == "fail" and v["first_bad_module"] == want, v["headline"]
        return
    # the layer's output scaled after its modules ran: from the target's inputs no module shows it,
    # the layer replayed whole does, at a decode step
    assert v["status"] == "inconclusive", v["headline"]
    reason = v["inconclusive"]["reason"]
    assert reason.startswith(f"{want}, replayed whole from the target dump, has "), reason
    assert "at decode step" in reason and "isolate: target_model" in v["inconclusive"]["next"]


@pytest.mark.parametrize(("family", "fault"), LAYERS_ONLY_CASES)
def test_a_dump_of_the_layers_names_the_layer_or_the_tail(family, fault, dump_goldens, tmp_path):
    v = bisect_target_dump(family, fault, LAYERS_ONLY, dump_goldens, tmp_path)
    if fault == "none":
        assert_not_failed(v)
        return
    want = expected_module(family, fault)
    assert v["status"] == "fail", v["headline"]
    if fault == "scale_lm_head":
        covers = v["candidates"][0]["covers"]
        assert covers[-1] == want and len(covers) == 2, covers  # the final norm, then lm_head
        assert v["headline"].startswith(" and ".join(covers) + " are the fault"), v["headline"]
        return
    layer = want if fault == "decode_layer_code" else want.rsplit(".", 1)[0]
    assert v["first_bad_module"] == layer, v["headline"]
    if fault == "decode_layer_code":
        assert v["replay"]["step"] > 0, v["headline"]


# -- the user's way ---------------------------------------------------------------------------------

def llmflow_run(cwd: Path, workflow: str, *sets: str) -> tuple[subprocess.CompletedProcess, str]:
    """``llmflow run WORKFLOW --set ...`` as a user types it: the process and its last line."""
    cmd = [sys.executable, "-m", "llmflow", "run", str(REPO / "workflows" / workflow), "--run-dir", "run",
           "--progress", "plain"]
    for value in sets:
        cmd += ["--set", value]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out[-3000:]
    return done, done.stdout.strip().splitlines()[-1]


def test_the_recipe_names_a_linear_attention_from_the_command_line(tmp_path):
    model = spec("qwen3-next")
    done, last = llmflow_run(tmp_path, "llama2_bisect.yaml", f"golden_model={model}", f"target_model={model}",
                             "max_new_tokens=4", f"target_patch={patch_of('qwen3-next', 'scale_attn_out')}")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert last.startswith("FAILED: model.layers.2.linear_attn is the fault"), last


def test_dump_bisect_on_a_users_dumps_names_the_layer_of_a_decode_fault(tmp_path):
    """MiniMax's decode steps read its own cache class (linear-attention states beside the keys and
    values): the golden layers are replayed over the target's recorded steps with one of their own."""
    for side, dtype, patch in (("golden", "float32", None),
                               ("target", "bfloat16", patch_of("minimax", "decode_layer_code"))):
        user_dump(tmp_path / side, spec("minimax"), LAYERS_ONLY, dtype=dtype, patch=patch)
    done, last = llmflow_run(tmp_path, "dump_bisect.yaml", "golden_dump=golden", "target_dump=target",
                             f"golden_model={spec('minimax')}")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert last.startswith(f"FAILED: model.layers.{CODE_LAYER} is the fault"), last
    assert "at decode step" in last, last
