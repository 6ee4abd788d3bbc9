"""weight-compare on checkpoints msModelSlim itself writes, on the CPU, from a tiny seeded Llama.

Each scheme is quantized by the real tool (its ``Calibrator``, data-free or with three calibration
prompts) and saved in both its save types: ``safe_tensor`` (int4 one value per int8,
``quant_model_description_<type>.json``) and ``ascendV1`` (int4 two per byte,
``quant_model_description.json`` with ``"version"`` and ``"group_size"``). For each, llmflow's
reading must give the same error as the independent numpy dequantization below, which restates
msModelSlim's documented layout; an honest checkpoint passes; a corrupted scale (one channel x4, a
whole layer x1.25) ranks worst and fails.

What msModelSlim 26.1 cannot produce here, and so is not generated: W8A8 with asymmetric weights
(it refuses: "w_sym should be True when a_bit = 8"; W8A8's activations are asymmetric, with an
``input_offset``, in every run); the sparse-compressed W8A8SC (its compressor is a native tool for
Ascend), whose reading as one "sparse-compressed" row per weight is tested on its documented
layout in tests/functional/test_checks_weights_ckpt.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from path_helpers import checkout_path

pytest.importorskip("msmodelslim", reason="msmodelslim (the test extra) is not installed")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from llmflow.checks.weights import compare_sources, open_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# Three layers, so each tensor has two siblings; hidden 64 gives W4A16 per-group two groups of 32.
TINY3 = "tiny-llama:layers=3,hidden=64,heads=4,kv_heads=2,intermediate=128"
CORRUPT = "model.layers.1.mlp.up_proj"

# scheme -> msModelSlim QuantConfig arguments (and whether it calibrates on prompts)
SCHEMES: dict[str, tuple[dict, bool]] = {
    "w8a16_sym": ({"w_bit": 8, "a_bit": 16, "w_sym": True}, False),
    "w8a16_asym": ({"w_bit": 8, "a_bit": 16, "w_sym": False}, False),
    "w4a16_channel_sym": ({"w_bit": 4, "a_bit": 16, "w_sym": True}, False),
    "w4a16_channel_asym": ({"w_bit": 4, "a_bit": 16, "w_sym": False}, False),
    "w4a16_group_sym": ({"w_bit": 4, "a_bit": 16, "w_sym": True, "is_lowbit": True, "open_outlier": False,
                         "group_size": 32}, False),
    "w4a16_group_asym": ({"w_bit": 4, "a_bit": 16, "w_sym": False, "is_lowbit": True, "open_outlier": False,
                          "group_size": 32}, False),
    "w8a8_static": ({"w_bit": 8, "a_bit": 8, "w_sym": True}, True),
    "w8a8_static_per_tensor": ({"w_bit": 8, "a_bit": 8, "w_sym": True, "mm_tensor": True}, True),
    "w8a8_dynamic": ({"w_bit": 8, "a_bit": 8, "w_sym": True, "is_dynamic": True}, True),
}
SAVE_TYPES = ("safe_tensor", "ascendV1")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("msmodelslim")


@pytest.fixture(scope="module")
def golden(workdir: Path) -> Path:
    from llmflow.models import load_model

    path = workdir / "float" / "model.safetensors"
    path.parent.mkdir()
    save_file({k: v.contiguous() for k, v in load_model(TINY3).model.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def quantized(workdir: Path):
    """scheme, save type -> the folder msModelSlim wrote (each made once, on first use)."""
    made: dict[tuple[str, str], Path] = {}

    def get(scheme: str, save_type: str) -> Path:
        if (scheme, save_type) not in made:
            made[scheme, save_type] = _quantize(scheme, save_type, workdir / f"{scheme}-{save_type}")
        return made[scheme, save_type]

    return get


def _quantize(scheme: str, save_type: str, out: Path, model: str = TINY3) -> Path:
    from msmodelslim import logger as mslogger
    from msmodelslim.pytorch.llm_ptq.llm_ptq_tools import Calibrator, QuantConfig

    from llmflow.models import load_model

    mslogger.setLevel(logging.ERROR)
    kwargs, calibrates = SCHEMES[scheme]
    cfg = QuantConfig(disable_names=[], dev_type="cpu", **{"mm_tensor": False, **kwargs})
    prompts = [[torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(i))] for i in range(3)]
    out.mkdir()
    cwd = os.getcwd()
    os.chdir(out)  # the calibrator leaves a features.npy in the working directory
    try:
        calibrator = Calibrator(load_model(model).model, cfg, calib_data=prompts if calibrates else None,
                                disable_level="L0")
        calibrator.run()
        calibrator.save(str(out), save_type=[save_type])
    finally:
        os.chdir(cwd)
    (out / "features.npy").unlink(missing_ok=True)
    return out


# -- an independent reading of msModelSlim's layout, in numpy ---------------------------------------
def _np_tensors(folder: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="np") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors


def _np_int4(stored: np.ndarray, axis: int) -> np.ndarray:
    """Byte j holds elements 2j (low nibble) and 2j + 1 (high nibble) along ``axis``, signed."""
    u = stored.view(np.uint8).astype(np.int16)
    lo, hi = u & 0xF, u >> 4
    lo, hi = np.where(lo >= 8, lo - 16, lo), np.where(hi >= 8, hi - 16, hi)
    shape = list(stored.shape)
    shape[axis] *= 2
    full = np.empty(shape, dtype=np.int16)
    index = [slice(None)] * stored.ndim
    index[axis] = slice(0, None, 2)
    full[tuple(index)] = lo
    index[axis] = slice(1, None, 2)
    full[tuple(index)] = hi
    return full


def _np_dequantize(t: dict[str, np.ndarray], base: str, version: str | None) -> np.ndarray:
    q, scale = t[base + ".weight"], t[base + ".weight_scale"].astype(np.float64)
    offset = t.get(base + ".weight_offset", np.zeros_like(scale)).astype(np.float64)
    if scale.ndim == 2 and version:  # ascendV1 packs int4: along in for [out, 1] scales, along out else
        rows, cols = q.shape
        if scale.shape[1] == 1 and cols * 2 == t["_in"]:
            q = _np_int4(q, axis=1)
        elif rows * 2 == scale.shape[0]:
            q = _np_int4(q, axis=0)
    q = q.astype(np.float64)
    out_f, in_f = q.shape
    if scale.size == 1:
        return (q - offset.reshape(())) * scale.reshape(())
    groups = scale.shape[1]
    w = q.reshape(out_f, groups, in_f // groups)
    return ((w - offset[:, :, None]) * scale[:, :, None]).reshape(out_f, in_f)


def _np_relative_distance(folder: Path, golden: Path, base: str) -> float:
    t = _np_tensors(folder)
    description = json.loads(next(folder.glob("quant_model_description*.json")).read_text())
    with safe_open(str(golden), framework="np") as h:
        g = h.get_tensor(base + ".weight").astype(np.float64)
    t["_in"] = g.shape[1]  # type: ignore[assignment]
    deq = _np_dequantize(t, base, description.get("version"))
    return float(np.linalg.norm(deq - g) / np.linalg.norm(g))


# -- the tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("save_type", SAVE_TYPES)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_real_checkpoint_reads_like_numpy_and_passes(scheme, save_type, quantized, golden):
    folder = quantized(scheme, save_type)
    description = json.loads(next(folder.glob("quant_model_description*.json")).read_text())
    assert ("version" in description) == (save_type == "ascendV1")
    rows, companions = compare_sources(open_weights(golden), open_weights(folder))
    assert [r for r in rows if r["status"] != "compared"] == []  # every tensor read, none left over
    assert [(r["name"], r["reason"]) for r in rows if r["verdict"] != "pass"] == []
    quantized_rows = [r for r in rows if r.get("quant_type") not in (None, "FLOAT")]
    assert len(quantized_rows) == 3 * 7 and companions >= 2 * 3 * 7  # every linear of every layer
    for r in quantized_rows:
        base = r["name"].removesuffix(".weight")
        assert r["relative_euclidean_distance"] == pytest.approx(
            _np_relative_distance(folder, golden, base), rel=1e-5, abs=1e-7), r["name"]
    schemes = {r["scheme"] for r in quantized_rows}
    if scheme.startswith("w4a16_group"):
        expect = " int4-packed along the output dim" if save_type == "ascendV1" else ""
        assert schemes == {f"W4A16 per-group g=32{expect}"}, schemes
        assert save_type != "ascendV1" or description["group_size"] == 32
    elif scheme.startswith("w4a16_channel"):
        assert schemes == {"W4A16 per-channel" + (" int4-packed" if save_type == "ascendV1" else "")}
    elif scheme == "w8a8_static_per_tensor":
        assert schemes == {"W8A8 per-tensor"}
    else:
        assert schemes == {f"{description['model_quant_type']} per-channel"}
    worst_honest = max(r["relative_euclidean_distance"] for r in quantized_rows)
    assert worst_honest < (0.15 if "w4" in scheme else 0.02)  # honest rounding, read the right way


def _corrupt(folder: Path, dest: Path, channel: int | None, factor: float) -> Path:
    """A copy of ``folder`` with CORRUPT's weight_scale times ``factor`` (one channel, or all)."""
    shutil.copytree(folder, dest)
    shard = next(dest.glob("*.safetensors"))
    tensors = load_file(str(shard))
    scale = tensors[CORRUPT + ".weight_scale"].clone()
    if channel is None:
        scale *= factor
    else:
        scale[channel] *= factor
    tensors[CORRUPT + ".weight_scale"] = scale
    shard.unlink()
    save_file(tensors, str(shard))
    return dest


@pytest.mark.parametrize(("scheme", "save_type"), [
    ("w8a16_sym", "ascendV1"), ("w8a16_asym", "safe_tensor"), ("w4a16_channel_sym", "ascendV1"),
    ("w4a16_channel_asym", "safe_tensor"), ("w4a16_group_asym", "ascendV1"),
    ("w4a16_group_sym", "safe_tensor"),
    ("w8a8_static", "ascendV1"), ("w8a8_dynamic", "safe_tensor"),
])
@pytest.mark.parametrize(("channel", "factor"), [(5, 4.0), (None, 1.25)], ids=["channel-x4", "layer-x1.25"])
def test_corrupted_scale_ranks_worst_and_fails(scheme, save_type, channel, factor, quantized, golden,
                                               tmp_path):
    bad = _corrupt(quantized(scheme, save_type), tmp_path / "bad", channel, factor)
    rows, _ = compare_sources(open_weights(golden), open_weights(bad))
    worst = rows[0]
    assert worst["name"] == CORRUPT + ".weight" and worst["verdict"] == "fail", worst
    assert [r["name"] for r in rows if r["verdict"] == "fail"] == [CORRUPT + ".weight"]
    assert worst["relative_euclidean_distance"] == pytest.approx(
        _np_relative_distance(bad, golden, CORRUPT), rel=1e-5)
    if scheme == "w8a8_static":  # deq_scale still holds the scale the tool computed
        assert worst["code"] == "scale_mismatch" and "deq_scale disagrees" in worst["reason"]
    if channel is None and scheme != "w8a8_static":  # under the int limits: the siblings tell
        assert worst["code"] == "sibling_outlier", worst
        assert "x the median" in worst["reason"] and "model.layers.*.mlp.up_proj.weight" in worst["reason"]


def _edit(folder: Path, dest: Path, key: str, change) -> Path:
    """A copy of ``folder`` with tensor ``key`` replaced by ``change(tensor)``."""
    shutil.copytree(folder, dest)
    for shard in dest.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if key in tensors:
            tensors[key] = change(tensors[key].clone())
            shard.unlink()
            save_file(tensors, str(shard))
    return dest


@pytest.mark.parametrize(("scheme", "save_type"), [
    ("w8a8_static", "safe_tensor"), ("w8a8_static", "ascendV1"), ("w8a8_static_per_tensor", "safe_tensor")])
@pytest.mark.parametrize("how", ["one-channel", "every-channel"])
def test_a_corrupted_quant_bias_fails_though_the_weight_dequantizes_right(scheme, save_type, how, quantized,
                                                                          golden, tmp_path):
    """The int8 matmul adds quant_bias; a wrong one changes every output of the layer while the
    weight itself still dequantizes to the float one."""
    def change(bias: torch.Tensor) -> torch.Tensor:
        if how == "one-channel":
            bias[7] += 500
        else:
            bias += 40
        return bias

    bad = _edit(quantized(scheme, save_type), tmp_path / "bad", CORRUPT + ".quant_bias", change)
    rows, _ = compare_sources(open_weights(golden), open_weights(bad))
    failed = [r for r in rows if r["verdict"] == "fail"]
    assert [r["name"] for r in failed] == [CORRUPT + ".weight"], failed
    assert failed[0]["code"] == "scale_mismatch" and "quant_bias disagrees" in failed[0]["reason"]
    assert f"in {1 if how == 'one-channel' else 128} of 128 channels" in failed[0]["reason"]


@pytest.mark.parametrize("scheme", ["w4a16_group_sym", "w4a16_channel_asym"])
def test_an_ascendv1_int4_checkpoint_without_its_description_reads_from_the_shapes(scheme, quantized, golden,
                                                                                    tmp_path):
    """A user copied the shards and not quant_model_description.json: the int4 weights, two per
    byte, are told by a dimension half their float twin's, not reported as corrupted int8."""
    bare = tmp_path / "bare"
    shutil.copytree(quantized(scheme, "ascendV1"), bare)
    (bare / "quant_model_description.json").unlink()
    rows, _ = compare_sources(open_weights(golden), open_weights(bare))
    assert [r for r in rows if r["verdict"] == "fail"] == []
    proj = next(r for r in rows if r["name"] == CORRUPT + ".weight")
    assert proj["quant_type"] == "W4A16" and "int4-packed" in proj["scheme"], proj
    bad = _corrupt(bare, tmp_path / "bad", None, 1.25)
    rows, _ = compare_sources(open_weights(golden), open_weights(bad))
    assert [r["name"] for r in rows if r["verdict"] == "fail"] == [CORRUPT + ".weight"]


def test_quant_bias_of_a_family_with_biases_holds_and_its_corruption_fails(tmp_path):
    """Qwen2's q/k/v projections carry a float bias, which msModelSlim keeps beside quant_bias."""
    qwen2 = "tiny-qwen2:layers=2,hidden=64,heads=4,kv_heads=2,intermediate=128"
    from llmflow.models import load_model

    golden = tmp_path / "float" / "model.safetensors"
    golden.parent.mkdir()
    save_file({k: v.contiguous() for k, v in load_model(qwen2).model.state_dict().items()}, str(golden))
    honest = _quantize("w8a8_static", "safe_tensor", tmp_path / "q", model=qwen2)
    assert "model.layers.1.self_attn.k_proj.bias" in open_weights(honest)
    rows, _ = compare_sources(open_weights(golden), open_weights(honest))
    assert [r for r in rows if r["verdict"] == "fail"] == []
    bad = _edit(honest, tmp_path / "bad", "model.layers.1.self_attn.k_proj.quant_bias", lambda b: b - 300)
    rows, _ = compare_sources(open_weights(golden), open_weights(bad))
    assert [r["name"] for r in rows if r["verdict"] == "fail"] == ["model.layers.1.self_attn.k_proj.weight"]


def test_weight_check_cli_fails_a_mis_scaled_layer_and_passes_the_honest_one(quantized, golden, tmp_path):
    honest = quantized("w4a16_group_sym", "ascendV1")
    bad = _corrupt(honest, tmp_path / "bad", None, 1.25)
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(target: Path, run_dir: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "llmflow", "run", "weight_check",
                               "--set", f"golden={golden}", "--set", f"target={target}",
                               "--run-dir", str(run_dir)],
                              capture_output=True, text=True, env=env, timeout=120)

    ok = run(honest, tmp_path / "ok")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip().splitlines()[-1].startswith("PASSED")
    failed = run(bad, tmp_path / "bad-run")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    last = failed.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED") and CORRUPT + ".weight" in last and "Traceback" not in failed.stderr
    summary = json.loads((tmp_path / "bad-run" / "summary.json").read_text())
    assert summary["weight_compare"]["worst"]["name"] == CORRUPT + ".weight"
    assert "x the median" in summary["weight_compare"]["worst"]["reason"]
