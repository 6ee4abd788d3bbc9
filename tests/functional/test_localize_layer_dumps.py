"""Bisect from dumps of the decoder layers alone, the way a user's own script writes them
(``DumpConfig(module_list=["auto"])`` on both sides, or ``layer_name`` over the layers' modules):

* the decoder layers, replayed whole on the target's recorded inputs, are the rows ranked: a
  fault inside a layer names that layer;
* the final norm and lm_head, which no such dump holds, are replayed together on the target's
  recorded output of the last decoder layer against its recorded logits: a fault there is named,
  never PASSED; where the model's forward does more between them and the logits (Gemma-2's
  softcap), they are not replayed, and the verdict never names the wrong module;
* the embedding's fault shows in the hidden states entering the first layer, but these dumps do
  not record the token ids: INCONCLUSIVE, naming the embedding as the lead;
* a clean bf16 target is never FAILED."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import bisect_dumps, user_dump, user_golden_maker  # noqa: E402

from llmflow.models import load_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "plugins" / "example_faults.py"
SIZE = "layers=5,hidden=64,intermediate=128,seed=3"
PROMPT = "Tell me a story."
LAYERS_ONLY = {"module_list": ["auto"]}


def spec(family: str) -> str:
    return f"tiny-{family}:{SIZE}"


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return user_golden_maker(tmp_path_factory)


def _bisect(tmp_path: Path, model_spec: str, goldens, patch: str | None, scope: dict = LAYERS_ONLY) -> dict:
    target = user_dump(tmp_path / "target", model_spec, scope, dtype="bfloat16",
                       patch=f"{FAULTS}:{patch}" if patch else None)
    return bisect_dumps({"golden_dump": goldens(model_spec, scope), "target_dump": target,
                         "golden_spec": {"model": model_spec, "device": "cpu", "dtype": "float32"}},
                        isolate="target_dump", estimate_cost=False)


FAMILIES = ["llama", "qwen2", "gpt2", "phi3", "mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fault", ["scale_lm_head", "scale_final_norm"])
def test_a_fault_after_the_last_layer_is_named_from_dumps_of_the_layers(family, fault, goldens, tmp_path):
    v = _bisect(tmp_path, spec(family), goldens, fault)
    model = load_model(spec(family)).model
    lm_head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == lm_head
    covers = v["candidates"][0]["covers"]
    assert covers[-1] == lm_head and len(covers) == 2  # the final norm, then lm_head
    assert " and ".join(covers) in v["headline"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fault_inside_a_layer_names_the_layer_from_dumps_of_the_layers(family, goldens, tmp_path):
    v = _bisect(tmp_path, spec(family), goldens, "scale_attn_out_layer_2")
    stack_path = v["first_bad_module"].rsplit(".", 1)[0]
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == f"{stack_path}.2"
    assert f"layer_name: {stack_path}.2.*" in v["diagnosis"]  # what to dump to name the module


@pytest.mark.parametrize("family", FAMILIES)
def test_an_embedding_fault_is_a_lead_not_a_verdict_without_the_token_ids(family, goldens, tmp_path):
    v = _bisect(tmp_path, spec(family), goldens, "scale_embedding")
    assert v["status"] == "inconclusive", v["headline"]
    assert v["first_bad_module"] is None
    assert "embedding" in v["headline"] and "token ids" in v["inconclusive"]["next"]


@pytest.mark.parametrize("family", [*FAMILIES, "gemma2"])
def test_a_clean_target_is_never_failed_from_dumps_of_the_layers(family, goldens, tmp_path):
    v = _bisect(tmp_path, spec(family), goldens, None)
    assert v["status"] != "fail", v["headline"]


def test_a_softcapped_tail_is_not_replayed_and_never_blamed_wrongly(goldens, tmp_path):
    """Gemma-2 softcaps its logits in the model's forward, after lm_head (at 30: weights drawn
    large enough for logits of ~20 make it bite): the final norm and lm_head alone do not give its
    logits, so they are not replayed; the verdict names no module."""
    v = _bisect(tmp_path, f"tiny-gemma2:{SIZE},init=1.0", goldens, "scale_lm_head")
    assert v["status"] != "pass" and v["first_bad_module"] is None, v["headline"]
    assert "outside the decoder layers, not replayed: model.norm and lm_head" in v["diagnosis"]


def test_dumps_of_the_layers_modules_name_lm_head_beside_them(goldens, tmp_path):
    """``layer_name`` over the layers: every module inside them, none outside."""
    scope = {"layer_name": "model.layers.*"}
    v = _bisect(tmp_path, spec("llama"), goldens, "scale_lm_head", scope)
    assert v["status"] == "fail" and v["first_bad_module"] == "lm_head", v["headline"]
    replayed = {c["name"] for c in v["candidates"]}
    assert any(".self_attn." in n for n in replayed)  # the modules inside the layers were ranked too


def test_the_recipe_names_the_tail_from_a_users_layer_dumps(goldens, tmp_path):
    """``llmflow run dump_bisect`` on dumps a user's script wrote with ``module_list=["auto"]``."""
    script = tmp_path / "dump_target.py"
    script.write_text(
        "import sys\n"
        "from llmflow.dump import DumpConfig, dump_run\n"
        "from llmflow.models import encode_prompt, load_model\n"
        f"m = load_model({spec('llama')!r}, dtype='bfloat16', patch={str(FAULTS) + ':scale_final_norm'!r})\n"
        f"ids = encode_prompt(m.tokenizer, {PROMPT!r})\n"
        "dump_run(m, ids, 5, DumpConfig(dump_path=sys.argv[1], token_range='all', module_list=['auto']))\n")
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
    subprocess.run([sys.executable, str(script), "target"], cwd=tmp_path, env=env, check=True, timeout=300)
    done = subprocess.run(
        [sys.executable, "-m", "llmflow", "run", str(REPO / "workflows" / "dump_bisect.yaml"),
         "--run-dir", "run", "--progress", "plain",
         "--set", f"golden_dump={goldens(spec('llama'), LAYERS_ONLY)}", "--set", "target_dump=target",
         "--set", f"golden_model={spec('llama')}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    last = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert last.startswith("FAILED: model.norm and lm_head are the fault"), last


@pytest.mark.parametrize(("fault", "scope"), [(None, LAYERS_ONLY), ("scale_attn_out_layer_5", LAYERS_ONLY),
                                             (None, {})])
def test_smollm2_layer_dumps_blame_no_clean_layer_and_name_a_faulty_one(fault, scope, goldens, tmp_path):
    """Real weights: a clean bf16 SmolLM2's layer 28 adds so much to the residual stream that it
    rounds 14x the other layers' error; it must not be blamed, from dumps of the layers alone or
    of every module (where the layers are replayed whole since no module stands out), and a real
    fault still is."""
    v = _bisect(tmp_path, "smollm2", goldens, fault, scope)
    if fault is None:  # neither blamed nor pointed at as the lead
        assert v["status"] != "fail" and "model.layers." not in v["headline"], v["headline"]
    else:
        assert v["status"] == "fail" and v["first_bad_module"] == "model.layers.5", v["headline"]


def test_a_tensor_parallel_target_dumped_by_layers_names_the_layer(tmp_path):
    """Two ranks under torchrun, each dumping its decoder layers alone: the layer holding a faulty
    shard is named (its output is all-reduced: the same on both ranks, so no rank), a clean port
    is not failed."""
    from tp_helpers import TP_FAULTS, TP_GOLDEN_MODEL, launch_tp

    from llmflow.localize.bisect import run_bisect
    from llmflow.localize.options import BisectInputs

    layers_only = ("--module-list", "auto")
    launch_tp(tmp_path, ["golden"], 1, options=layers_only)
    launch_tp(tmp_path, ["clean", f"mlp_rank1={TP_FAULTS['mlp_rank1']}"], 2, options=layers_only)
    verdicts = {name: run_bisect(BisectInputs(golden_dump=str(tmp_path / "golden" / "llmflow_dump"),
                                              target_dump=str(tmp_path / name / "llmflow_dump"),
                                              golden_spec={"model": TP_GOLDEN_MODEL}), log=lambda _m: None)
                for name in ("clean", "mlp_rank1")}
    assert verdicts["clean"].status != "fail", verdicts["clean"].headline
    faulty = verdicts["mlp_rank1"]
    assert faulty.status == "fail" and faulty.first_bad_module == "model.layers.1", faulty.headline
    assert faulty.replay.source == "target dump"
