"""An msModelSlim checkpoint as the bisect's target: quantized by the real tool on the CPU from a
tiny seeded float model, loaded by llmflow with its quantized Linear layers computing as the
Ascend kernels do, and bisected against the float model.

What is checked: the emulation computes what msModelSlim's own fake-quantized model computes (W8A16,
W4A16 per-group packed, W8A8 static, W8A8 anti-outlier smoothed); W8A8_DYNAMIC quantizes each token
alone and W8A8_MIX is dynamic at the prefill, static at a decode step; a smoothed checkpoint's
modules replay on the float model's inputs; a calibration that clipped one layer's activations, a wrong
weight scale and a clipped decode-only (W8A8_MIX) layer are each named to their Linear layer
(Llama, and Qwen2 with its biased projections); MoE checkpoints quantized expert by expert (Qwen3-MoE;
Mixtral in transformers 4's layout: ``block_sparse_moe``, experts' ``w1``/``w3``/``w2``;
DeepSeek-V3, its experts W8A8_DYNAMIC) run split back from transformers 5's fused experts, and a
broken expert is named down to its Linear layer, by the names msModelSlim gave it; an honest
checkpoint is never called a fault: the verdict says the drift is the quantization's own and which
Linear layers to keep in float, and a layer standing out through its calibration's clip of a few
values is set aside as its quantization's (Qwen2, Mistral, Phi3), while one int8 output channel
negated in another layer is named over it; a weight_scale the kernel does not read (deq_scale no
longer their product) is noted at load; types llmflow cannot run, and quantized tensors with no
Linear layer to go to, are bad input in one line.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from path_helpers import checkout_path

pytest.importorskip("msmodelslim", reason="msmodelslim (the test extra) is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import bisect_dumps, golden_maker, make_dumps, run_bisect_recipe, tiny_model_dirs  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from llmflow.errors import UserError  # noqa: E402
from llmflow.models import load_model  # noqa: E402
from llmflow.quantized import UnfusedExperts, W8A8Linear, deq_scale_as_float, unfuse_experts  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SIZE = "layers=4,hidden=64,intermediate=128,seed=3"
LAYER = 2
#: ids the fake-quantized model and llmflow's emulation both run
IDS = [[5, 9, 30, 41, 7, 12, 3, 77]]
#: scheme -> msModelSlim QuantConfig arguments, whether it calibrates on prompts, its save type
SCHEMES: dict[str, tuple[dict, bool, str]] = {
    "w8a16": ({"w_bit": 8, "a_bit": 16, "w_sym": True}, False, "safe_tensor"),
    "w4a16_group": ({"w_bit": 4, "a_bit": 16, "w_sym": False, "is_lowbit": True, "open_outlier": False,
                     "group_size": 32}, False, "ascendV1"),
    "w8a8": ({"w_bit": 8, "a_bit": 8, "w_sym": True}, True, "safe_tensor"),
    "w8a8_dynamic": ({"w_bit": 8, "a_bit": 8, "w_sym": True, "is_dynamic": True}, True, "safe_tensor"),
    "w8a8_mix": ({"w_bit": 8, "a_bit": 8, "w_sym": True, "pdmix": True}, True, "ascendV1"),
    # smoothed first (AntiOutlier m2): each norm divided by a per-channel scale its readers take on
    "w8a8_anti_outlier": ({"w_bit": 8, "a_bit": 8, "w_sym": True}, True, "safe_tensor"),
}


def _quantize(float_dir: Path, scheme: str, out: Path) -> Path:
    """msModelSlim's checkpoint of ``float_dir`` beside the float model's config and tokenizer, as a
    user lays it out; ``fake_logits.pt`` holds the logits of msModelSlim's own fake-quantized model."""
    from msmodelslim import logger as mslogger
    from msmodelslim.pytorch.llm_ptq.llm_ptq_tools import Calibrator, QuantConfig

    mslogger.setLevel(logging.ERROR)
    kwargs, calibrates, save_type = SCHEMES[scheme]
    cfg = QuantConfig(disable_names=[], dev_type="cpu", **{"mm_tensor": False, **kwargs})
    out.mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(out)  # the calibrator leaves a features.npy in the working directory
    try:
        model = load_model(str(float_dir)).model
        # a mixture of experts as transformers 4 holds it, one Linear per expert projection:
        # msModelSlim quantizes those one by one (transformers 5 fuses them into 3-D tensors)
        if model.config.model_type == "mixtral":
            _as_transformers4_mixtral(model)
        unfuse_experts(model, lambda _key: True)
        # (Mixtral routes to 2 of 4 experts: 3 prompts leave one expert of a layer without a token,
        # which msModelSlim cannot calibrate)
        count = 8 if model.config.model_type == "mixtral" else 3
        prompts = [[torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(i))]
                   for i in range(count)]
        if scheme.endswith("anti_outlier"):
            from msmodelslim.pytorch.llm_ptq.anti_outlier import AntiOutlier, AntiOutlierConfig

            smooth = AntiOutlierConfig(anti_method="m2", dev_type="cpu")
            AntiOutlier(model, calib_data=prompts, cfg=smooth).process()
        calibrator = Calibrator(model, cfg, calib_data=prompts if calibrates else None, disable_level="L0")
        calibrator.run()
        with torch.no_grad():
            fake = model(torch.tensor(IDS)).logits
        calibrator.save(str(out), save_type=[save_type])
    finally:
        os.chdir(cwd)
    (out / "features.npy").unlink(missing_ok=True)
    torch.save(fake, out.parent / f"{out.name}.fake_logits.pt")
    for f in float_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def _as_transformers4_mixtral(model: torch.nn.Module) -> None:
    """Mixtral's modules under the names transformers 4 gives them, which msModelSlim keeps in its
    checkpoint: each layer's ``block_sparse_moe`` (transformers 5: ``mlp``), each expert's
    ``w1``, ``w3``, ``w2`` (gate, up, down)."""
    for layer in model.model.layers:
        moe = layer._modules.pop("mlp")
        moe.experts = UnfusedExperts(moe.experts, names=("w1", "w3", "w2"))
        layer._modules["block_sparse_moe"] = moe
        object.__setattr__(layer, "mlp", moe)  # (what the layer's forward calls, not a child name)


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory) -> Callable[[str], Path]:
    return tiny_model_dirs(tmp_path_factory, SIZE, "float")


@pytest.fixture(scope="module")
def quantized(float_dirs, tmp_path_factory) -> Callable[[str, str], Path]:
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, scheme: str) -> Path:
        if (family, scheme) not in made:
            made[family, scheme] = _quantize(float_dirs(family), scheme,
                                             tmp_path_factory.mktemp(f"{family}-{scheme}") / "quant")
        return made[family, scheme]
    return get


@pytest.fixture(scope="module")
def goldens(tmp_path_factory, float_dirs):
    return golden_maker(tmp_path_factory, lambda family: str(float_dirs(family)))


@pytest.fixture(scope="module")
def golden_runs() -> dict[str, Path]:
    """golden model dir -> the run dir of the first `llmflow run` of it. The runs of one golden dump
    the same thing (the float model in fp32, the recipe's prompt, 4 tokens): a later one starts from a
    copy of that run dir, where the golden's dump is reused and only the target's stages run again."""
    return {}


def _run_recipe(run: Path, golden: Path, golden_runs: dict[str, Path],
                *sets: str) -> subprocess.CompletedProcess:
    """``run_bisect_recipe`` of ``golden`` (4 tokens) against ``sets``, from a copy of an earlier
    run dir of the same golden where there is one (its golden dump then cached)."""
    reused = str(golden) in golden_runs
    if reused:
        shutil.copytree(golden_runs[str(golden)], run, symlinks=True)
    proc = run_bisect_recipe(run, f"golden_model={golden}", *sets, max_new_tokens=4)
    if reused:
        assert "dump-golden: cached" in proc.stdout, proc.stdout[-3000:]
    elif "dump-golden: done" in proc.stdout:
        golden_runs[str(golden)] = run
    return proc


def _edited(folder: Path, dest: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of an msModelSlim checkpoint folder with its tensors edited."""
    shutil.copytree(folder, dest)
    weights = next(dest.glob("quant_model_weight*.safetensors"))
    tensors = load_file(str(weights))
    edit(tensors)
    save_file(tensors, str(weights))
    return dest


def _scale_activation_range(prefix: str, factor: float) -> Callable[[dict[str, torch.Tensor]], None]:
    """A calibration that saw ``factor`` x smaller activations at one Linear layer: input_scale and,
    consistent with it, deq_scale divided by ``factor`` (the device clips what lies beyond)."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[prefix + "input_scale"] = t[prefix + "input_scale"] / factor
        deq = deq_scale_as_float(t[prefix + "deq_scale"]) / factor
        stored = t[prefix + "deq_scale"]
        t[prefix + "deq_scale"] = deq if stored.dtype.is_floating_point else \
            deq.view(torch.int32).to(torch.int64)
    return edit


def _scale_weight(prefix: str, factor: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[prefix + "weight_scale"] = t[prefix + "weight_scale"] * factor
    return edit


def _scale_deq(prefix: str, factor: float) -> Callable[[dict[str, torch.Tensor]], None]:
    """A W8A8 layer whose output the device scales ``factor`` x too far (a wrong deq_scale)."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        deq = deq_scale_as_float(t[prefix + "deq_scale"]) * factor
        stored = t[prefix + "deq_scale"]
        t[prefix + "deq_scale"] = deq if stored.dtype.is_floating_point else \
            deq.view(torch.int32).to(torch.int64)
    return edit


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# -- the emulation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["w8a16", "w4a16_group", "w8a8", "w8a8_anti_outlier"])
def test_emulation_computes_what_msmodelslims_fake_quantized_model_computes(scheme, quantized, float_dirs):
    folder = quantized("llama", scheme)
    fake = torch.load(folder.parent / f"{folder.name}.fake_logits.pt", weights_only=True)
    float_logits = load_model(str(float_dirs("llama"))).model(torch.tensor(IDS)).logits
    loaded = load_model(str(folder))
    with torch.no_grad():
        ours = loaded.model(torch.tensor(IDS)).logits
    quant_error = _rel(fake, float_logits)
    assert quant_error > 1e-3  # the checkpoint is quantized: the check below can tell
    assert _rel(ours, fake) < max(1e-5, 0.05 * quant_error), (_rel(ours, fake), quant_error)
    assert len(loaded.quantized) == 4 * 7 and "msModelSlim checkpoint" in loaded.note


def test_explain_says_what_a_static_quantization_does_to_an_input(quantized):
    """An input far beyond the calibrated range is clipped; one far inside it (a scale calibrated on
    one token's massive activation, a normal token after it) rounds to the zero point: both said."""
    model = load_model(str(quantized("llama", "w8a8"))).model
    linear = model.get_submodule(f"model.layers.{LAYER}.mlp.down_proj")
    assert isinstance(linear, W8A8Linear)
    x = torch.randn(1, 1, linear.in_features, generator=torch.Generator().manual_seed(0))
    step = float(linear.input_scale_bits.view(torch.float32).mean())
    assert "clips" in linear.explain(x * step * 1000)
    said = linear.explain(x * step * 0.1)
    assert "rounds 100% of the input's nonzero values to its zero point" in said, said
    assert linear.explain(x * step * 20) is None  # within range, well resolved: nothing to say


def test_a_weight_scale_the_kernel_does_not_read_is_noted_where_the_checkpoint_is_read(quantized, tmp_path,
                                                                                     caplog):
    """A static W8A8 layer computes with deq_scale: a weight_scale times 10 changes nothing that runs,
    but the checkpoint no longer holds deq_scale = input_scale x weight_scale, and the load says so
    (the note the console and the verdict repeat, and a warning); an honest one says nothing of it."""
    folder = quantized("qwen2", "w8a8")
    name = f"model.layers.{LAYER}.self_attn.o_proj"
    edited = _edited(folder, tmp_path / "scaled", _scale_weight(name + ".", 10.0))
    honest = load_model(str(folder))
    assert "deq_scale" not in honest.note, honest.note
    with caplog.at_level(logging.WARNING, logger="llmflow.models"):
        scaled = load_model(str(edited))
    said = (f"Its {name} stores a deq_scale that is not input_scale x weight_scale ({name}: deq_scale is "
            "0.1x input_scale x weight_scale in 64 of 64 channels")
    assert said in scaled.note, scaled.note
    assert any(said in r.getMessage() for r in caplog.records), caplog.text
    with torch.no_grad():  # (what runs is the same)
        assert torch.equal(honest.model(torch.tensor(IDS)).logits, scaled.model(torch.tensor(IDS)).logits)


def test_dynamic_quantizes_each_token_alone_and_mix_is_static_at_a_decode_step(quantized):
    dynamic = load_model(str(quantized("llama", "w8a8_dynamic"))).model
    layer = dynamic.model.layers[1].mlp.down_proj
    assert isinstance(layer, W8A8Linear) and layer.mode == "dynamic"
    x = torch.randn(1, 5, layer.in_features, generator=torch.Generator().manual_seed(0))
    x[0, 2] *= 50  # one token's outlier moves its own scale only
    whole = layer(x)
    assert torch.equal(whole[0, 0], layer(x[:, :1])[0, 0])
    assert torch.equal(whole[0, 4], layer(x[:, 4:5])[0, 0])

    mix = load_model(str(quantized("llama", "w8a8_mix"))).model.model.layers[1].mlp.down_proj
    assert isinstance(mix, W8A8Linear) and mix.qtype == "W8A8_MIX"
    assert torch.equal(mix(x[:, :1]), mix._static(x[0, :1]).to(x.dtype).reshape(1, 1, -1))
    assert torch.equal(mix(x), mix._dynamic(x[0]).to(x.dtype).reshape(1, 5, -1))
    assert not torch.equal(mix(x)[0, :1], mix(x[:, :1])[0])  # prefill and decode differ


def test_a_smoothed_checkpoint_replays_each_module_on_the_float_models_inputs(quantized, goldens, float_dirs,
                                                                              tmp_path):
    """Anti-outlier divides each norm by a scale its Linear readers take on: replayed alone on the
    golden's (unsmoothed) inputs, every attention and MLP would err by 100%+. The bisect moves the
    smoothing into the readers first: every module's own error is the quantization's size, and a
    clipped reader of a smoothed norm is named."""
    folder = quantized("llama", "w8a8_anti_outlier")
    loaded = load_model(str(folder))
    smoothed = [n for n, m in loaded.model.named_modules() if type(m).__name__ == "NormBias"]
    assert len(smoothed) == 2 * 4 + 1, smoothed
    dumps = make_dumps(tmp_path / "honest", str(float_dirs("llama")), target_model=str(folder),
                       golden_dir=goldens("llama"))
    v = bisect_dumps(dumps, estimate_cost=False)
    assert max(c["error"] for c in v["candidates"] if c.get("error") is not None) < 0.3, v["candidates"][:3]
    assert not any("could not be moved" in n for n in v["notes"]), v["notes"]
    name = f"model.layers.{LAYER}.mlp.gate_proj"  # reads the smoothed post-attention norm
    target = _edited(folder, tmp_path / "clipped", _scale_activation_range(name + ".", 8.0))
    dumps = make_dumps(tmp_path / "clipped", str(float_dirs("llama")), target_model=str(target),
                       golden_dir=goldens("llama"))
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "fail" and v["first_bad_module"] == name, v["headline"]


# -- the bisect, families x faults ---------------------------------------------------------------------

#: fault -> (scheme, the Linear layer broken in layer LAYER, the edit, what the verdict says of it)
FAULTS = {
    "clipped_calibration": ("w8a8", "mlp.down_proj", lambda p: _scale_activation_range(p, 8.0),
                            "its static activation quantization clips"),
    "wrong_weight_scale": ("w8a16", "self_attn.o_proj", lambda p: _scale_weight(p, 1.6), None),
    "clipped_decode_only": ("w8a8_mix", "mlp.down_proj", lambda p: _scale_activation_range(p, 8.0), "clips"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_broken_quantized_layer_is_named(family, fault, quantized, goldens, float_dirs, tmp_path):
    scheme, linear, edit, says = FAULTS[fault]
    name = f"model.layers.{LAYER}.{linear}"
    target = _edited(quantized(family, scheme), tmp_path / "quant", edit(name + "."))
    dumps = make_dumps(tmp_path, str(float_dirs(family)), target_model=str(target),
                       golden_dir=goldens(family))
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == name, [c["name"] for c in v["candidates"][:3]]
    assert v["headline"].startswith(f"{name} ({SCHEMES_TYPE[scheme]}-quantized) is the fault"), v["headline"]
    assert f"{name} is a {SCHEMES_TYPE[scheme]} Linear layer of the quantized checkpoint" in v["diagnosis"]
    assert f"disable_names (['{name}'])" in v["diagnosis"]
    if says:
        assert says in v["diagnosis"], v["diagnosis"]
    if fault == "clipped_decode_only":  # the prefill quantizes dynamically: only a decode step shows it
        assert v["replay"]["step"] > 0, v["replay"]


SCHEMES_TYPE = {"w8a8": "W8A8", "w8a16": "W8A16", "w8a8_mix": "W8A8_MIX"}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_honest_checkpoint_is_told_as_its_quantization(family, quantized, goldens, float_dirs, tmp_path):
    """Honest quantization errs in every Linear layer; the verdict is about the quantization either
    way: a pass, the drift spread over the layers (inconclusive, with the layers to keep in float),
    or the Linear layers standing out set aside as explained by their quantization. Never a fault."""
    dumps = make_dumps(tmp_path, str(float_dirs(family)), target_model=str(quantized(family, "w8a8")),
                       golden_dir=goldens(family))
    v = bisect_dumps(dumps, estimate_cost=False)
    assert any("msModelSlim checkpoint (28 W8A8 Linear layers)" in n for n in v["notes"])
    assert v["status"] in ("pass", "inconclusive") and v["first_bad_module"] is None, v["headline"]
    assert "is the fault" not in v["headline"] + v["diagnosis"], v["diagnosis"]
    if v["status"] == "inconclusive":
        assert "disable_names=['model.layers." in v["inconclusive"]["next"]


def _negate_channel(prefix: str) -> Callable[[dict[str, torch.Tensor]], None]:
    """One output channel of a W8A8 layer's int8 weight negated: the one of least norm, a fault that
    stands out less than an honest layer's calibration clip on these models."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        weight = t[prefix + "weight"].clone()
        channel = int(weight.float().norm(dim=1).argmin())
        weight[channel] = -weight[channel]
        t[prefix + "weight"] = weight
    return edit


#: the families whose honest W8A8 checkpoints have a Linear layer that stands out from its peers on
#: this prompt through its calibration's clip (2-14 values of its input), and the one that holds it
CLIPPING = {"qwen2": "model.layers.0.self_attn.o_proj", "mistral": "model.layers.1.self_attn.o_proj",
            "phi3": "model.layers.3.mlp.down_proj"}
#: the Linear layer the corrupted checkpoints break
CORRUPTED = f"model.layers.{LAYER}.mlp.down_proj"


@pytest.mark.parametrize("corrupted", [False, True], ids=["honest", "corrupted"])
@pytest.mark.parametrize("family", list(CLIPPING))
def test_a_clip_the_quantization_explains_is_set_aside_and_a_wrong_weight_named(family, corrupted,
                                                                                 quantized, goldens,
                                                                                 float_dirs, tmp_path):
    """The bisect the workflow's stage runs, on an fp32 target: an honest checkpoint's Linear layer
    standing out through its calibration's clip (a few values of this prompt beyond the range it
    calibrated) is its quantization's, said with its figures, never the fault; with one int8 output
    channel of another layer negated, that layer is named, whatever the clipping one scores."""
    folder = quantized(family, "w8a8")
    target = _edited(folder, tmp_path / "quant", _negate_channel(CORRUPTED + ".")) if corrupted else folder
    dumps = make_dumps(tmp_path, str(float_dirs(family)), target_model=str(target),
                       golden_dir=goldens(family), target_dtype="float32")
    v = bisect_dumps(dumps, estimate_cost=False)
    said = v["diagnosis"] + (v["inconclusive"] or {}).get("reason", "")
    clipping = CLIPPING[family]
    assert f"{clipping} (" in said and "the weight against the float one" in said, said
    clip = next(c for c in v["candidates"] if c["name"] == clipping)
    assert clip["weight_ratio"] < 1.5 and not clip["anomalous"], clip
    if not corrupted:
        assert v["status"] in ("pass", "inconclusive") and v["first_bad_module"] is None, v["headline"]
        assert "is the fault" not in v["headline"] + v["diagnosis"], v["diagnosis"]
        assert ("Set aside, their own error explained by their quantization" in v["diagnosis"]
                or v["headline"].startswith("the divergence is explained by the quantization at")), said
        return
    assert v["status"] == "fail" and v["first_bad_module"] == CORRUPTED, v["headline"]
    assert v["headline"].startswith(f"{CORRUPTED} (W8A8-quantized) is the fault"), v["headline"]
    assert "also in" not in v["headline"], v["headline"]
    assert "Its own error is not its quantization's" in v["diagnosis"], v["diagnosis"]
    named = next(c for c in v["candidates"] if c["name"] == CORRUPTED)
    assert named["weight_ratio"] > 5, named
    assert "Set aside, their own error explained by their quantization" in v["diagnosis"], v["diagnosis"]


# -- the user's way ------------------------------------------------------------------------------------

def test_llmflow_run_names_the_clipped_layer_of_a_users_checkpoint(quantized, float_dirs, golden_runs,
                                                                   tmp_path):
    name = f"model.layers.{LAYER}.mlp.down_proj"
    target = _edited(quantized("llama", "w8a8"), tmp_path / "w8a8-clipped",
                     _scale_activation_range(name + ".", 8.0))
    proc = _run_recipe(tmp_path / "run", float_dirs("llama"), golden_runs, f"target_model={target}")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith(f"FAILED: {name} (W8A8-quantized) is the fault"), last
    verdict = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    assert "its static activation quantization clips" in verdict["diagnosis"] and verdict["notes"]
    assert " cover [" in verdict["diagnosis"], verdict["diagnosis"]  # the range it covers, and the input's


@pytest.mark.parametrize("corrupted", [False, True], ids=["honest", "corrupted"])
@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_llmflow_run_names_a_wrong_weight_never_an_honest_clip(family, corrupted, quantized, float_dirs,
                                                                golden_runs, tmp_path):
    """``llmflow run`` on an fp32 target: an honest W8A8 checkpoint, whose Linear layers stand out
    through its calibration's clip, ends PASSED or INCONCLUSIVE (the divergence its quantization's),
    never FAILED; with one int8 output channel negated, FAILED naming that layer, even where the
    texts agree and its error stands out less than a quantization's own is let pass by."""
    folder = quantized(family, "w8a8")
    target = _edited(folder, tmp_path / "quant", _negate_channel(CORRUPTED + ".")) if corrupted else folder
    proc = _run_recipe(tmp_path / "run", float_dirs(family), golden_runs, f"target_model={target}",
                       "target_dtype=float32")
    last = proc.stdout.strip().splitlines()[-1]
    verdict = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    if not corrupted:
        assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "is the fault" not in last + verdict["diagnosis"], verdict["diagnosis"]
        if proc.returncode == 3:
            assert last.startswith("INCONCLUSIVE: the divergence is explained by the quantization at"), last
        return
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith(f"FAILED: {CORRUPTED} (W8A8-quantized) is the fault"), last
    assert "Its own error is not its quantization's" in verdict["diagnosis"], verdict["diagnosis"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llmflow_run_judges_an_honest_checkpoint_at_its_quantization_in_any_dtype(dtype, quantized,
                                                                               float_dirs, golden_runs,
                                                                               tmp_path):
    """The same honest W8A8 checkpoint run in fp32 or bf16 gets one verdict: its rows and logits
    judged at w8a8 (its matmuls ran in int8, whatever its activations' dtype), its most sensitive
    Linear layer (6x its peers on this model) said, not called a fault."""
    proc = _run_recipe(tmp_path / "run", float_dirs("llama"), golden_runs,
                       f"target_model={quantized('llama', 'w8a8')}", f"target_dtype={dtype}")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith("PASSED"), last
    run = tmp_path / "run"
    env = json.loads(next((run / "dump-npu").rglob("env.json")).read_text())
    assert env["torch_settings"]["quantization"] == "w8a8"
    assert env["torch_settings"]["quantized_linears"] == {"W8A8": 28}
    judged = json.loads((run / "compare" / "compare_summary.json").read_text())["judged_as"]
    assert judged["dtype"] == "w8a8" and "quantized checkpoint" in judged["source"], judged
    verdict = json.loads((run / "bisect" / "verdict.json").read_text())
    assert "logits within the w8a8 thresholds" in verdict["diagnosis"], verdict["diagnosis"]
    assert "Its most sensitive quantized Linear layers (own error on the golden inputs): model.layers." \
        in verdict["diagnosis"], verdict["diagnosis"]


# -- a mixture of experts quantized expert by expert ----------------------------------------------------

MOE = "qwen3-moe"


@pytest.mark.parametrize("family", [MOE, "mixtral"])
def test_a_moe_checkpoint_quantized_expert_by_expert_computes_what_msmodelslims_model_computes(family,
                                                                                              quantized):
    """The checkpoint holds every expert's projections as Linear layers of their own; the model
    class fuses them: llmflow splits the fused experts back and runs each quantized. A Mixtral
    checkpoint keeps transformers 4's names, renamed as transformers renames its float twin."""
    folder = quantized(family, "w8a8")
    loaded = load_model(str(folder))
    assert loaded.quantized["model.layers.0.mlp.experts.3.down_proj"] == "W8A8"
    assert sum(".experts." in n for n in loaded.quantized) == 4 * 4 * 3  # layers x experts x projections
    if family == "mixtral":
        assert loaded.quantized_names["model.layers.0.mlp.experts.3.down_proj"] == \
            "model.layers.0.block_sparse_moe.experts.3.w2"
        assert "model.layers.0.self_attn.q_proj" not in loaded.quantized_names  # (stored as it is named)
    else:
        assert loaded.quantized_names == {}
    with torch.no_grad():
        logits = loaded.model(torch.tensor(IDS)).logits
    assert _rel(logits, torch.load(folder.parent / f"{folder.name}.fake_logits.pt")) < 1e-5


def test_llmflow_run_names_the_expert_and_its_linear_layer_whose_quantization_is_wrong(quantized, float_dirs,
                                                                                        tmp_path):
    """A Mixtral checkpoint in transformers 4's layout: the expert (one that 5 of the prompt's 31
    tokens reach, its fault diluted over the others) is named as the model names it; of its
    Linear layers, each replayed alone on the golden expert's input, the one with the wrong
    deq_scale, for disable_names as msModelSlim named it. The golden is stored in the model's own
    (fused) names, so the bisect streams it layer by layer."""
    stored = f"model.layers.{LAYER}.block_sparse_moe.experts.1"
    target = _edited(quantized("mixtral", "w8a8"), tmp_path / "w8a8-deq", _scale_deq(f"{stored}.w2.", 2.5))
    golden = tmp_path / "float-fused"
    golden.mkdir()
    fused = load_model(str(float_dirs("mixtral"))).model.state_dict()
    save_file({k: v.contiguous() for k, v in fused.items()}, str(golden / "model.safetensors"),
              metadata={"format": "pt"})
    for f in float_dirs("mixtral").iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, golden / f.name)
    proc = run_bisect_recipe(tmp_path / "run", f"golden_model={golden}", f"target_model={target}",
                             max_new_tokens=4)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bisect: golden model loaded streamed" in proc.stdout, proc.stdout[-3000:]
    name = f"model.layers.{LAYER}.mlp.experts"
    assert last.startswith(f"FAILED: {name} (expert 1) (W8A8-quantized) is the fault"), last
    assert "of the expert's Linear layers, down_proj stands out" in last, last
    verdict = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    assert verdict["first_bad_expert"] == 1
    said = verdict["diagnosis"]
    assert "Its error is in the tokens routed to expert 1: their outputs are" in said, said
    assert f"down_proj (stored as {stored}.w2): replayed alone on the golden expert's input" in said, said
    assert "its deq_scale is 2.5x input_scale x weight_scale in 64 of 64 channels" in said, said
    assert f"disable_names (['{stored}.w2'])" in said, said
    scores = {r["projection"]: r["score"] for r in verdict["expert_linears"] if r["expert"] == 1}
    assert scores["down_proj"] > 10 > 2 > max(scores["gate_proj"], scores["up_proj"]), scores


def test_llmflow_run_names_a_dynamic_experts_linear_layer_whose_weight_scale_is_wrong(quantized, float_dirs,
                                                                                      tmp_path):
    """DeepSeek-V3 (MLA attention, a shared expert): msModelSlim quantizes its MLPs and experts
    W8A8_DYNAMIC (each token's activations alone); one expert's up_proj with a 1.5x weight_scale
    is named to that Linear layer."""
    name = f"model.layers.{LAYER}.mlp.experts"
    target = _edited(quantized("deepseek-v3", "w8a8"), tmp_path / "ws",
                     _scale_weight(f"{name}.1.up_proj.", 1.5))
    proc = run_bisect_recipe(tmp_path / "run", f"golden_model={float_dirs('deepseek-v3')}",
                             f"target_model={target}", max_new_tokens=4)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith(f"FAILED: {name} (expert 1) (W8A8_DYNAMIC-quantized) is the fault"), last
    assert "of the expert's Linear layers, up_proj stands out" in last, last
    verdict = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    assert f"disable_names (['{name}.1.up_proj'])" in verdict["diagnosis"], verdict["diagnosis"]


def test_a_type_llmflow_cannot_run_is_bad_input_in_one_line(quantized, tmp_path):
    target = tmp_path / "w8a8sc"
    shutil.copytree(quantized("llama", "w8a8"), target)
    description = next(target.glob("quant_model_description*.json"))
    data = json.loads(description.read_text())
    key = f"model.layers.{LAYER}.mlp.up_proj.weight"
    data[key] = "W8A8SC"
    description.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "llmflow", "run", "llama2_bisect", "--run-dir",
                           str(tmp_path / "run"), "--set", f"golden_model={target}", "--set",
                           f"target_model={target}", "--only", "seed", "--only", "dump-npu"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert f"{key} is quantized as W8A8SC, which llmflow cannot run" in last
    assert "Traceback" not in proc.stderr


def test_a_quantized_tensor_with_no_linear_layer_is_bad_input(quantized, tmp_path):
    """A quantized KV cache's scales (or fused experts') have no Linear layer to go to: refused by
    name, never loaded half."""
    name = f"model.layers.{LAYER}.self_attn.k_proj.kv_cache_scale"
    target = _edited(quantized("llama", "w8a8"), tmp_path / "kv",
                     lambda t: t.__setitem__(name, torch.ones(16)))
    with pytest.raises(UserError, match=f"the quantized tensor '{name}'.*belongs to no Linear layer"):
        load_model(str(target))


def test_the_float_models_shard_index_copied_beside_the_weights_is_named(quantized, tmp_path):
    target = tmp_path / "copied"
    shutil.copytree(quantized("llama", "w8a8"), target)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="model.safetensors.index.json in .* is not msModelSlim's"):
        load_model(str(target))


def test_the_weight_check_of_a_smoothed_checkpoint_divides_out_each_norms_scale(quantized, float_dirs,
                                                                                tmp_path):
    """The verdict's next step, `weight_check`, on an anti-outlier checkpoint: each Linear layer is
    compared after dividing out the scale its norm gave it (the norm's own, not one fitted to the
    layer), the norms pass saying where their scale went; a wrong weight scale still fails."""
    from llmflow.checks.weights import compare_sources, open_weights

    folder = quantized("llama", "w8a8_anti_outlier")
    golden = open_weights(float_dirs("llama") / "model.safetensors")
    rows, _ = compare_sources(golden, open_weights(folder))
    assert [(r["name"], r["reason"]) for r in rows if r["verdict"] != "pass"] == []
    norm = next(r for r in rows if r["name"] == f"model.layers.{LAYER}.post_attention_layernorm.weight")
    assert norm["reason"].startswith("anti-outlier smoothed: its scale went into"), norm
    assert next(r for r in rows if r["name"] == f"model.layers.{LAYER}.mlp.up_proj.weight")["smoothing"]
    name = f"model.layers.{LAYER}.mlp.up_proj"
    broken = _edited(folder, tmp_path / "broken", _scale_weight(name + ".", 1.25))
    rows, _ = compare_sources(golden, open_weights(broken))
    assert [r["name"] for r in rows if r["verdict"] == "fail"] == [name + ".weight"]
