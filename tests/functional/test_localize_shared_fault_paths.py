"""A fault the decoder layers' copies of one module type share, on the decode path alone or in only
some of the layers: the verdict names the module type, says on which path the fault lives (the
decode path where the prefill was replayed clean; never the prefill as well), counts the faulty
copies ("in N of M layers") and names a faulty copy, never the clean one. Tiny Llama and Qwen2
through the bisect, and the CLI the user's way (``llmflow run llama2_bisect``, exit 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, golden_maker, make_dumps  # noqa: E402
from example_faults import faulty_module  # noqa: E402

from llmflow.models import load_model  # noqa: E402
from llmflow.structure import module_type  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# init=0.2: attention peaked enough that a decode-kernel fault moves the numbers (as in
# test_localize_decode); 4 layers keep each dump and bisect to seconds
SIZE = "layers=4,hidden=64,intermediate=128,seed=3,init=0.2"
LAYERS = 4
#: the wording of conclude._shared_fault for a fault found at a decode step
DECODE_PATH = "At the prefill its copies are within rounding, so the fault lives on the decode path."
NOT_MEASURED = "Whether the prefill has it too was not measured."
PREFILL_TOO = ("The prefill has it too", "on the prefill path as well")


def spec(family: str) -> str:
    return f"tiny-{family}:{SIZE}"


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return golden_maker(tmp_path_factory, spec)


@pytest.fixture(scope="module")
def dumps_of(tmp_path_factory, goldens):
    """(family, fault, layers or None for every layer) -> the bisect's dumps, made once: the target
    patched with ``fault`` in those decoder layers (a patch file of its own for a subset, as a user
    writes one; ``example_faults``' ``<fault>_every_layer`` for all)."""
    made: dict[tuple, dict] = {}

    def dumps(family: str, fault: str, layers: tuple[int, ...] | None = None) -> dict:
        key = (family, fault, layers)
        if key not in made:
            tmp = tmp_path_factory.mktemp(f"{family}-{fault}")
            if layers is None:
                patch = f"plugins/example_faults.py:{fault}_every_layer"
            else:
                patch = f"{some_layers_patch(tmp, fault, layers)}:patch"
            made[key] = make_dumps(tmp, spec(family), patch=patch, golden_dir=goldens(family))
        return made[key]
    return dumps


def some_layers_patch(directory: Path, fault: str, layers: tuple[int, ...]) -> Path:
    """A patch file that plants ``example_faults``' ``fault`` in ``layers`` alone."""
    path = directory / "some_layers.py"
    path.write_text("import sys\n"
                    f"sys.path.insert(0, {str(REPO / 'plugins')!r})\n"
                    "from example_faults import make_fault\n\n\n"
                    "def patch(model):\n"
                    f"    for layer in {list(layers)!r}:\n"
                    f"        make_fault({fault!r}, layer)(model)\n")
    return path


_MODELS: dict[str, object] = {}


def copies(family: str, fault: str, layers) -> list[str]:
    """The full paths of the modules ``fault`` breaks in ``layers`` of the family's model."""
    if family not in _MODELS:
        _MODELS[family] = load_model(spec(family)).model
    return [faulty_module(_MODELS[family], fault, i) for i in layers]


def assert_decode_path_only(v: dict) -> None:
    """Found at a decode step with the prefill replayed and clean: said to live on the decode path."""
    assert v["replay"]["step"] > 0 and 0 in v["replay"]["steps_tried"], v["replay"]
    assert f"at decode step {v['replay']['step']}" in v["headline"], v["headline"]
    assert DECODE_PATH in v["diagnosis"], v["diagnosis"]
    assert not any(p in v["diagnosis"] for p in PREFILL_TOO), v["diagnosis"]
    assert "at the prefill" not in v["headline"], v["headline"]


# -- a fault every layer shares, on the decode path alone -----------------------------------------
@pytest.mark.parametrize(("family", "fault"), [("llama", "decode_attn_scale"),
                                               ("qwen2", "decode_softmax_scale"),
                                               ("qwen2", "decode_rope_shift")])
def test_a_decode_only_fault_in_every_layer_is_named_on_the_decode_path(family, fault, dumps_of):
    v = bisect_dumps(dumps_of(family, fault), estimate_cost=False)
    first = copies(family, fault, [0])[0]
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == first, v["headline"]
    assert v["first_bad_layer"] and first.startswith(v["first_bad_layer"] + "."), v["first_bad_layer"]
    assert v["headline"].startswith(f"{module_type(first)} is the fault in every layer: "), v["headline"]
    assert f"(the median of {LAYERS} layers)" in v["headline"], v["headline"]
    assert v["first_bad_op"] is None
    assert_decode_path_only(v)


def test_a_decode_only_shared_fault_replayed_at_a_decode_step_alone_claims_no_path(dumps_of):
    """replay_step: 1 replays that step only: the prefill was never looked at, and the verdict says
    so rather than placing the fault on either path."""
    v = bisect_dumps(dumps_of("llama", "decode_attn_scale"), estimate_cost=False, replay_step=1)
    assert v["status"] == "fail" and v["replay"]["steps_tried"] == [1], v["replay"]
    assert v["headline"].startswith("model.layers.*.self_attn is the fault in every layer: "), v["headline"]
    assert NOT_MEASURED in v["diagnosis"], v["diagnosis"]
    assert DECODE_PATH not in v["diagnosis"] and not any(p in v["diagnosis"] for p in PREFILL_TOO)


def test_the_cli_fails_a_decode_kernel_fault_every_layer_shares(tmp_path):
    """The user's way: the recipe by its file, the patch relative to it as its comments show, a
    decode-attention softmax scale wrong in every layer (the demo's bug, in each layer's kernel)."""
    model = spec("llama")
    run_dir = tmp_path / "runs" / "decode-every"
    cmd = [sys.executable, "-m", "llmflow", "run", str(REPO / "workflows" / "llama2_bisect.yaml"),
           "--run-dir", str(run_dir), "--progress", "plain", "--set", f"golden_model={model}",
           "--set", f"target_model={model}", "--set", "max_new_tokens=4",
           "--set", "target_patch=../plugins/example_faults.py:decode_softmax_scale_every_layer"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED: model.layers.*.self_attn is the fault in every layer: "), last
    assert " at decode step " in last and "at the prefill" not in last, last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"]["status"] == "fail"
    v = summary["verdict"]
    assert v["first_bad_module"] == "model.layers.0.self_attn" and v["first_bad_layer"] == "model.layers.0"
    assert v["replay"]["source"] == "golden re-run"
    assert_decode_path_only(v)


# -- a fault in some of the layers ----------------------------------------------------------------
MOST = [("llama", "scale_down_proj", (1, 2, 3)),
        ("qwen2", "scale_down_proj", (0, 1, 3)),
        ("qwen2", "scale_attn_out", (0, 2, 3)),
        ("llama", "decode_attn_scale", (1, 2, 3)),
        ("qwen2", "decode_softmax_scale", (0, 2, 3))]


@pytest.mark.parametrize(("family", "fault", "layers"), MOST)
def test_a_fault_in_most_layers_is_counted_and_named_by_a_faulty_copy(family, fault, layers, dumps_of):
    """All layers but one: the faulty copies are the type's median, so no copy stands out from its
    peers; the verdict counts them, "in 3 of 4 layers (...)", and names the first, never the clean
    one. A decode-only fault among them is placed on the decode path as well."""
    v = bisect_dumps(dumps_of(family, fault, layers), estimate_cost=False)
    faulty = copies(family, fault, layers)
    clean = copies(family, fault, sorted(set(range(LAYERS)) - set(layers)))
    kind = module_type(faulty[0])
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == faulty[0], v["headline"]
    assert faulty[0].startswith(v["first_bad_layer"] + "."), v["first_bad_layer"]
    where = f"in {len(layers)} of {LAYERS} layers ({', '.join(faulty)})"
    assert v["headline"].startswith(f"{kind} is the fault {where}: "), v["headline"]
    assert f"(the median of {len(layers)} layers)" in v["headline"], v["headline"]
    assert not any(c in v["headline"] or c in v["diagnosis"] for c in clean), v["diagnosis"]
    if fault.startswith("decode_"):
        assert_decode_path_only(v)
    else:
        assert "decode path" not in v["diagnosis"], v["diagnosis"]


@pytest.mark.parametrize(("family", "fault", "layers"), [("llama", "scale_down_proj", (0, 2)),
                                                         ("qwen2", "wrong_act", (1, 3))])
def test_a_fault_in_half_the_layers_names_each_faulty_copy(family, fault, layers, dumps_of):
    """2 of 4 layers: each faulty copy stands out from the median of its peers (a clean one), so the
    verdict is the ranking's, not a shared fault's: it names a faulty copy and the other in "also
    in", and never a clean copy."""
    v = bisect_dumps(dumps_of(family, fault, layers), estimate_cost=False)
    faulty = copies(family, fault, layers)
    clean = copies(family, fault, sorted(set(range(LAYERS)) - set(layers)))
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] in faulty, v["headline"]
    other = next(c for c in faulty if c != v["first_bad_module"])
    assert v["headline"].startswith(f"{v['first_bad_module']} is the fault: "), v["headline"]
    assert v["headline"].endswith(f"; also in {other}"), v["headline"]
    assert "The same module stands out in 1 more layer(s)" in v["diagnosis"], v["diagnosis"]
    assert not any(c in v["headline"] or c in v["diagnosis"] for c in clean), v["diagnosis"]


# -- a decode-only shared fault the texts do not show ---------------------------------------------
# Gemma2 normalises each attention's output (post_attention_layernorm) before the residual add, so
# an attention output scaled at decode steps leaves the tokens and logits as the golden's; the bisect
# then replays the prefill and decode step 1 ("where the decode kernel runs against the KV cache"),
# and speaks of the step where the copies are off alike, though none stands out from its peers.
HIDDEN = [("gemma2", "decode_attn_scale", None), ("gemma2", "decode_attn_scale", (1, 2, 3))]


@pytest.mark.parametrize(("family", "fault", "layers"), HIDDEN)
def test_a_shared_decode_fault_hidden_from_the_texts_is_there_at_decode_step_1(family, fault, layers,
                                                                               dumps_of):
    """The premise of the next test: the texts and logits match, and decode step 1 replayed on its
    own (replay_step: 1) shows the shared fault."""
    v = bisect_dumps(dumps_of(family, fault, layers), estimate_cost=False, replay_step=1)
    assert v["first_mismatch_token"] is None and v["first_bad_token"] is None, v["token_detail"]
    n = LAYERS if layers is None else len(layers)
    where = "in every layer" if layers is None else f"in {n} of {LAYERS} layers"
    assert v["status"] == "fail", v["headline"]
    assert v["headline"].startswith(f"model.layers.*.self_attn is the fault {where}"), v["headline"]


@pytest.mark.parametrize(("family", "fault", "layers"), HIDDEN)
def test_a_shared_decode_fault_hidden_from_the_texts_is_still_named(family, fault, layers, dumps_of):
    v = bisect_dumps(dumps_of(family, fault, layers), estimate_cost=False)
    n = LAYERS if layers is None else len(layers)
    where = "in every layer" if layers is None else f"in {n} of {LAYERS} layers"
    assert v["status"] == "fail", v["headline"]
    assert v["headline"].startswith(f"model.layers.*.self_attn is the fault {where}"), v["headline"]
    assert v["first_bad_module"] == copies(family, fault, layers or range(LAYERS))[0]
    assert_decode_path_only(v)
