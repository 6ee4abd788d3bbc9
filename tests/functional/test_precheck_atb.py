"""`llmflow precheck ATB_DUMP`: the leaf operations of an ATB tensor dump replayed from their
intensors and the model json's params. A clean fp16 Llama layer passes (Linear, RmsNorm, Rope,
Elewise add/cast, Activation swiglu, Softmax), an RmsNormOperation that leaves its epsilon out is
named with its graph operation and its standalone repro reproduces it, an op type without a
reference is listed as not checked, and a dump without its model json is inconclusive.

The dumps are written with llmflow's ATB writer (``formats.atb.write_atb_dump``, the layout and
``.bin`` bytes msit's dump writes): real ATB dumps need an Ascend NPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from format_writers import write_atb_dump  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, INTER, VOCAB, TOKENS = 64, 4, 16, 128, 96, 5
EPS = 1e-5
DT = torch.float16

# the decoder layer's operations in execution order: (folder, opType, param)
LAYER_OPS = [
    ("0_RmsNormOperation", "RmsNormOperation", {"layerType": 1, "normParam": {"epsilon": EPS}}),
    ("1_LinearOperation", "LinearOperation", {"transposeA": False, "transposeB": True, "hasBias": False}),
    ("2_RopeOperation", "RopeOperation", {"rotaryCoeff": 2}),
    ("3_SelfAttentionOperation", "SelfAttentionOperation", {"headNum": HEADS, "kvHeadNum": HEADS}),
    ("4_LinearOperation", "LinearOperation", {"transposeB": True}),
    ("5_ElewiseOperation", "ElewiseOperation", {"elewiseType": 8}),
    ("6_RmsNormOperation", "RmsNormOperation", {"layerType": 1, "normParam": {"epsilon": EPS}}),
    ("7_LinearOperation", "LinearOperation", {"transposeB": True}),
    ("8_ActivationOperation", "ActivationOperation", {"activationType": 6, "dim": -1}),
    ("9_LinearOperation", "LinearOperation", {"transposeB": True}),
    ("10_ElewiseOperation", "ElewiseOperation", {"elewiseType": 8}),
]
TOP_OPS = [("0_GatherOperation", "GatherOperation", {"axis": 0}), ("1_DecoderLayer", "DecoderLayer", None),
           ("2_RmsNormOperation", "RmsNormOperation", {"layerType": 1, "normParam": {"epsilon": EPS}}),
           ("3_LinearOperation", "LinearOperation", {"transposeB": True}),
           ("4_ElewiseOperation", "ElewiseOperation", {"elewiseType": 1, "outTensorType": 0}),
           ("5_SoftmaxOperation", "SoftmaxOperation", {"axes": [-1]})]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().T).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.float().reshape(x.shape[0], -1, HEAD_DIM)
    rotated = torch.cat((-h[..., HEAD_DIM // 2:], h[..., :HEAD_DIM // 2]), dim=-1)
    return (h * cos.float()[:, None] + rotated * sin.float()[:, None]).reshape(x.shape).to(x.dtype)


def layer_round(step: int, *, norm_eps: float) -> dict[str, dict[str, list[torch.Tensor]]]:
    """One token's operations: hidden states of std 0.002 (where an epsilon of 1e-5 matters),
    ``norm_eps`` the epsilon the layer's first RmsNorm kernel really uses."""
    g = torch.Generator().manual_seed(step)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(DT)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=g, dtype=torch.int64)
    table = randn(VOCAB, HIDDEN, std=0.002)
    w_norm, w_norm2, w_final = (randn(HIDDEN, std=0.1) + 1 for _ in range(3))
    w_qk, w_o = randn(2 * HIDDEN, HIDDEN, std=0.1), randn(HIDDEN, HIDDEN, std=0.1)
    w_up, w_down = randn(2 * INTER, HIDDEN, std=0.1), randn(HIDDEN, INTER, std=0.1)
    w_head = randn(VOCAB, HIDDEN, std=0.1)
    angles = torch.arange(TOKENS)[:, None] * (1e-2 ** (torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2)))[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(DT), torch.cat([angles.sin()] * 2, -1).to(DT)
    x = table[ids]
    ops: dict[str, dict[str, list[torch.Tensor]]] = {"0_GatherOperation": {"in": [table, ids], "out": [x]}}
    layer = "1_DecoderLayer/"
    normed = rms_norm(x, w_norm, norm_eps)
    ops[layer + "0_RmsNormOperation"] = {"in": [x, w_norm], "out": [normed]}
    qk = linear(normed, w_qk)
    ops[layer + "1_LinearOperation"] = {"in": [normed, w_qk], "out": [qk]}
    q, k = qk[:, :HIDDEN].contiguous(), qk[:, HIDDEN:].contiguous()
    seqlen = torch.tensor([TOKENS], dtype=torch.int32)
    q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
    ops[layer + "2_RopeOperation"] = {"in": [q, k, cos, sin, seqlen], "out": [q_rot, k_rot]}
    attn = randn(TOKENS, HIDDEN, std=0.5)  # (SelfAttentionOperation has no reference: never judged)
    ops[layer + "3_SelfAttentionOperation"] = {"in": [q_rot, k_rot, normed], "out": [attn]}
    o = linear(attn, w_o)
    ops[layer + "4_LinearOperation"] = {"in": [attn, w_o], "out": [o]}
    h = x + o
    ops[layer + "5_ElewiseOperation"] = {"in": [x, o], "out": [h]}
    normed2 = rms_norm(h, w_norm2, EPS)
    ops[layer + "6_RmsNormOperation"] = {"in": [h, w_norm2], "out": [normed2]}
    up = linear(normed2, w_up)
    ops[layer + "7_LinearOperation"] = {"in": [normed2, w_up], "out": [up]}
    a, b = up.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(a) * b).to(DT)
    ops[layer + "8_ActivationOperation"] = {"in": [up], "out": [act]}
    down = linear(act, w_down)
    ops[layer + "9_LinearOperation"] = {"in": [act, w_down], "out": [down]}
    out = h + down
    ops[layer + "10_ElewiseOperation"] = {"in": [h, down], "out": [out]}
    ops["1_DecoderLayer"] = {"in": [x], "out": [out]}
    final = rms_norm(out, w_final, EPS)
    ops["2_RmsNormOperation"] = {"in": [out, w_final], "out": [final]}
    logits = linear(final, w_head)
    ops["3_LinearOperation"] = {"in": [final, w_head], "out": [logits]}
    logits32 = logits.float()
    ops["4_ElewiseOperation"] = {"in": [logits], "out": [logits32]}
    ops["5_SoftmaxOperation"] = {"in": [logits32], "out": [torch.softmax(logits32, dim=-1)]}
    return ops


def model_json() -> dict:
    def node(folder: str, op_type: str, param: dict | None, number: int | None = None) -> dict:
        found = {"opName": f"{op_type}_{number if number is not None else folder.split('_')[0]}",
                 "opType": op_type, "inTensors": [], "outTensors": []}
        if param is not None:
            found["param"] = param
        return found
    nodes = [node(f, t, p) for f, t, p in TOP_OPS]
    nodes[1]["nodes"] = [node(f, t, p) for f, t, p in LAYER_OPS]
    nodes[1]["nodes"][2]["param"] = json.dumps(LAYER_OPS[2][2])  # (a param may be written as a JSON string)
    return {"modelName": "LlamaModel", "nodes": nodes}


def write_dump(root: Path, *, norm_eps: float = EPS, with_model: bool = True) -> Path:
    rounds = {step: layer_round(step, norm_eps=norm_eps) for step in (0, 1)}
    return write_atb_dump(root, rounds, [model_json()] if with_model else [], timestamp="20250101_000000")


def precheck(dump: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", "precheck", str(dump), "-o", str(out), *extra],
                          capture_output=True, text=True, timeout=300, cwd=out.parent)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("atb")
    return {"clean": write_dump(tmp / "clean"), "no_eps": write_dump(tmp / "no_eps", norm_eps=0.0),
            "no_model": write_dump(tmp / "no_model", with_model=False)}


def test_a_clean_layer_passes_and_ops_without_reference_are_listed(tmp_path, dumps):
    proc = precheck(dumps["clean"], tmp_path / "out")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED")
    report = json.loads((tmp_path / "out" / "precheck.json").read_text())
    counts = report["counts"]
    for op in ("LinearOperation", "RmsNormOperation", "RopeOperation", "ElewiseOperation",
               "ActivationOperation", "SoftmaxOperation"):
        assert set(counts[op]) == {"pass"}, (op, counts[op])
    assert counts["LinearOperation"]["pass"] == 2 * 5 and counts["ElewiseOperation"]["pass"] == 2 * 3
    assert counts["SelfAttentionOperation"] == {"not checked": 2} and "DecoderLayer" not in counts
    csv_text = (tmp_path / "out" / "precheck.csv").read_text()
    assert "no reference for ATB op SelfAttentionOperation" in csv_text
    assert "no reference for ATB op GatherOperation" in csv_text


def test_an_rms_norm_without_epsilon_is_named_and_its_repro_reproduces(tmp_path, dumps):
    proc = precheck(dumps["no_eps"], tmp_path / "out", "--repro")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED: 2 of ") and "first 1_DecoderLayer.0_RmsNormOperation (step 0)" in last
    report = json.loads((tmp_path / "out" / "precheck.json").read_text())
    assert report["first_fail"]["module"] == "1_DecoderLayer"
    assert report["counts"]["RmsNormOperation"] == {"fail": 2, "pass": 4}  # the other norms pass
    assert "in module 1_DecoderLayer" in proc.stdout
    script = tmp_path / "out" / report["repros"][0]["script"]
    fresh = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
    assert fresh.returncode == 1 and "REPRODUCED" in fresh.stdout, fresh.stdout + fresh.stderr
    assert "llmflow" not in script.read_text()


def test_a_dump_without_its_model_json_is_inconclusive(tmp_path, dumps):
    proc = precheck(dumps["no_model"], tmp_path / "out")
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "no operation parameters in the dump" in proc.stdout.strip().splitlines()[-1]


def test_a_reference_for_an_unknown_atb_op_is_used(tmp_path, dumps):
    ref = tmp_path / "gather_ref.py"
    ref.write_text("import torch\n\ndef gather(table, ids, *, param):\n"
                   "    return (table.index_select(param.get('axis', 0), ids),)\n")
    proc = precheck(dumps["clean"], tmp_path / "out", "--reference", f"GatherOperation={ref}:gather")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "precheck.json").read_text())
    assert report["counts"]["GatherOperation"] == {"pass": 2}


def test_a_model_json_that_is_not_json_is_bad_input(tmp_path, dumps):
    dump = shutil.copytree(dumps["clean"], tmp_path / "dump")
    next((dump / "model").rglob("*.json")).write_text("{not json")
    proc = precheck(dump, tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ".json" in (proc.stdout + proc.stderr).strip().splitlines()[-1]
