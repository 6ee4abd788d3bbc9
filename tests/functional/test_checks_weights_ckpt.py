"""weight-compare end to end: a sharded msModelSlim-style checkpoint with known scales (one of them
wrong), missing keys, a shape mismatch, an unsupported scheme; float vs float; dump vs checkpoint."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmflow.checks.weights import compare_sources, open_weights, weight_summary
from llmflow.stages.weight_compare import WeightCompareStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from checks_helpers import (  # noqa: E402
    TINY,
    ctx,
    pack_int4,
    quant_int4_groups,
    quant_per_channel,
    quant_per_tensor,
    real_dump,
    write_sharded,
)

WRONG = "model.layers.1.mlp.down_proj.weight"


def _quant_pair(tmp: Path) -> tuple[Path, Path]:
    """A float checkpoint (2 shards) and its quantized twin (3 shards) with a description."""
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    golden = {
        "model.embed_tokens.weight": rnd(10, 8),
        "model.layers.0.self_attn.q_proj.weight": rnd(16, 16),
        "model.layers.0.mlp.down_proj.weight": rnd(16, 32),
        "model.layers.0.mlp.up_proj.weight": rnd(32, 16),
        "model.layers.1.mlp.gate_proj.weight": rnd(32, 16),
        WRONG: rnd(16, 32),
        "model.layers.1.self_attn.k_proj.weight": rnd(16, 16),
        "model.norm.weight": 1 + rnd(16),
        "lm_head.weight": rnd(10, 8),
    }
    target: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(12, 8),
                                       "model.norm.weight": golden["model.norm.weight"].half(),
                                       "model.layers.1.extra.weight": rnd(4)}
    desc = {"model_quant_type": "W8A8", "model.embed_tokens.weight": "FLOAT", "model.norm.weight": "FLOAT",
            "model.layers.1.extra.weight": "FLOAT"}
    q_name = "model.layers.0.self_attn.q_proj"  # W8A8 per-tensor, with activation companions
    q, s = quant_per_tensor(golden[q_name + ".weight"])
    target.update({f"{q_name}.weight": q, f"{q_name}.weight_scale": s, f"{q_name}.input_scale": torch.ones(1),
                   f"{q_name}.input_offset": torch.zeros(1), f"{q_name}.deq_scale": s * 0.1,
                   f"{q_name}.quant_bias": torch.zeros(16, dtype=torch.int32)})
    desc[f"{q_name}.weight"] = "W8A8"
    for name, offset in (("model.layers.0.mlp.down_proj", 3), (WRONG.removesuffix(".weight"), 0)):
        q, s, o = quant_per_channel(golden[name + ".weight"], offset=offset)  # W8A16 per-channel
        if name + ".weight" == WRONG:
            s = s.clone()
            s[5] *= 3  # the bug: one channel's scale is wrong
        target.update({f"{name}.weight": q, f"{name}.weight_scale": s, f"{name}.weight_offset": o})
        desc[f"{name}.weight"] = "W8A16"
    for name, packed in (("model.layers.0.mlp.up_proj", True), ("model.layers.1.mlp.gate_proj", False)):
        q, s = quant_int4_groups(golden[name + ".weight"], 8)  # W4A16 per-group
        target.update({f"{name}.weight": pack_int4(q) if packed else q, f"{name}.weight_scale": s})
        desc[f"{name}.weight"] = "W4A16"
    k = "model.layers.1.self_attn.k_proj"
    target.update({f"{k}.weight": torch.zeros(16, 8, dtype=torch.int8), f"{k}.weight_scale": torch.ones(16),
                   f"{k}.index": torch.zeros(4, dtype=torch.int8)})
    desc[f"{k}.weight"] = "W8A8SC"
    desc[f"{k}.index"] = "W8A8SC"
    g_dir = write_sharded(tmp / "float", golden, shards=2)
    t_dir = write_sharded(tmp / "quant", target, shards=3, stem="quant_model_weight_w8a8")
    (t_dir / "quant_model_description_w8a8.json").write_text(json.dumps(desc))
    return g_dir, t_dir


@pytest.fixture
def pair(tmp_path):
    return _quant_pair(tmp_path)


def test_wrong_scale_ranks_first_and_every_problem_is_named(pair):
    g, t = pair
    rows, companions = compare_sources(open_weights(g), open_weights(t))
    by = {r["name"]: r for r in rows}
    assert rows[0]["name"] == WRONG and rows[0]["verdict"] == "fail"
    assert rows[0]["scheme"] == "W8A16 per-channel"
    schemes = {n: by[n]["scheme"] for n in by if by[n]["status"] == "compared"}
    assert schemes["model.layers.0.self_attn.q_proj.weight"] == "W8A8 per-tensor"
    assert schemes["model.layers.0.mlp.down_proj.weight"] == "W8A16 per-channel"
    assert schemes["model.layers.0.mlp.up_proj.weight"] == "W4A16 per-group g=8 int4-packed"
    assert schemes["model.layers.1.mlp.gate_proj.weight"] == "W4A16 per-group g=8"
    assert schemes["model.norm.weight"] == "float"
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.gate_proj.weight"):
        assert by[name]["cosine_similarity"] > 0.99, (name, by[name])
        assert by[name]["relative_euclidean_distance"] < by[WRONG]["relative_euclidean_distance"] / 5
    assert by["model.layers.0.mlp.up_proj.weight"]["numel"] == 32 * 16
    assert by["lm_head.weight"]["status"] == "missing_in_target"
    assert by["model.layers.1.extra.weight"]["status"] == "missing_in_golden"
    assert by["model.embed_tokens.weight"]["status"] == "shape_mismatch"
    assert "golden [10, 8], target [12, 8]" in by["model.embed_tokens.weight"]["reason"]
    assert by["model.layers.1.self_attn.k_proj.weight"]["status"] == "compressed"
    assert by["model.layers.1.self_attn.k_proj.weight"]["reason"].startswith("sparse-compressed W8A8SC")
    assert "model.layers.1.self_attn.k_proj.index" not in by  # the compressed weight's own index
    # q_proj's 5 companions, 2 down_projs' scale + offset, 2 int4 scales, k_proj's scale and index
    assert companions == 5 + 4 + 2 + 2
    assert [r["status"] for r in rows[:6]] == ["compared"] * 6
    s = weight_summary(rows, companions)
    assert s.worst is not None and s.worst.name == WRONG
    assert s.counts["compared"] == 6 and s.counts["missing_in_target"] == 1
    assert s.counts["missing_in_golden"] == 1 and s.counts["shape_mismatch"] == 1
    assert s.counts["compressed"] == 1 and s.counts["companion_tensors"] == 13


def test_stage_writes_csv_xlsx_and_summary(pair, tmp_path):
    g, t = pair
    c = ctx(tmp_path, {"golden": str(g), "target": str(t)}, "weights")
    out = WeightCompareStage().run(c)
    with open(out["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["name"] == WRONG and len(rows) == 10
    assert Path(out["xlsx"]).stat().st_size > 0
    from openpyxl import load_workbook

    ws = load_workbook(out["xlsx"]).worksheets[0]
    header = [c.value for c in ws[1]]
    assert ws.cell(2, header.index("name") + 1).value == WRONG
    summary = c.summary["weight_compare"]
    assert summary["worst"]["name"] == WRONG and summary["counts"]["fail"] >= 1
    assert {p["name"] for p in summary["problems"]} >= {"lm_head.weight", "model.embed_tokens.weight"}
    assert c.outcome is not None and c.outcome.status == "fail" and f"first: {WRONG}" in c.outcome.headline
    # the reason names the metric that tripped
    assert "relative_euclidean_distance" in rows[0]["reason"] and rows[0]["code"] == "threshold_fail"


def test_stage_passes_equal_checkpoints(tmp_path):
    tensors = {f"layer.{i}.weight": torch.randn(8, 8) for i in range(3)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file(tensors, str(tmp_path / "b.safetensors"))
    c = ctx(tmp_path, {"golden": str(tmp_path / "a.safetensors"), "target": str(tmp_path / "b.safetensors")},
            "weights")
    WeightCompareStage().run(c)
    assert c.outcome is not None and c.outcome.status == "pass" and "3 tensors" in c.outcome.headline


def test_explicit_quant_config_and_name_map(pair, tmp_path):
    g, t = pair
    moved = tmp_path / "desc.json"
    (t / "quant_model_description_w8a8.json").rename(moved)
    c = ctx(tmp_path, {"golden": str(g), "target": str(t), "quant_config": str(moved),
                       "name_map": {"model.layers.1.extra.": "model.layers.9.extra."}}, "weights")
    WeightCompareStage().run(c)
    problems = {p["name"]: p["status"] for p in c.summary["weight_compare"]["problems"]}
    assert problems["model.layers.9.extra.weight"] == "missing_in_golden"
    assert problems["model.layers.1.self_attn.k_proj.weight"] == "compressed"


def test_float_checkpoint_against_float_checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(3)
    tensors = {f"layer.{i}.weight": torch.randn(8, 8, generator=gen) for i in range(4)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    changed = dict(tensors)
    changed["layer.2.weight"] = tensors["layer.2.weight"] * 1.5
    write_sharded(tmp_path / "b", changed, shards=2)
    rows, _ = compare_sources(open_weights(tmp_path / "a.safetensors"), open_weights(tmp_path / "b"))
    assert rows[0]["name"] == "layer.2.weight" and rows[0]["verdict"] == "fail"
    assert rows[0]["l2_distance"] == pytest.approx(float((tensors["layer.2.weight"] * 0.5).norm()), rel=1e-5)
    for r in rows[1:]:
        assert r["l2_distance"] == 0 and r["verdict"] == "pass" and r["cosine_similarity"] == pytest.approx(1)
        assert r["numel"] == 64 and r["golden_shape"] == [8, 8]


def test_dump_weights_against_a_checkpoint(tmp_path):
    from llmflow.models import load_model

    dump = real_dump(tmp_path, dump_weight=True, mode="none", new_tokens=1)
    state = {k: v.clone() for k, v in load_model(TINY).model.state_dict().items()}
    state["model.layers.1.self_attn.v_proj.weight"] += 0.01
    save_file(state, str(tmp_path / "ck.safetensors"))
    rows, _ = compare_sources(open_weights(dump), open_weights(tmp_path / "ck.safetensors"))
    assert rows[0]["name"] == "model.layers.1.self_attn.v_proj.weight" and rows[0]["verdict"] != "pass"
    assert all(r["status"] == "compared" for r in rows) and len(rows) == len(state)
    assert all(r["l2_distance"] == 0 for r in rows[1:])


def test_weight_check_workflow(pair, tmp_path):
    from llmflow.workflow import run_workflow

    g, t = pair
    repo = Path(__file__).resolve().parents[2]
    run_workflow(repo / "workflows" / "weight_check.yaml", set_params=[f"golden={g}", f"target={t}"],
                 run_dir=tmp_path / "run")
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert all(v["status"] == "done" for v in s["stages"].values()), s["stages"]
    assert s["status"] == "failed" and s["outcome"]["status"] == "fail"  # the fault found
    assert s["weight_compare"]["worst"]["name"] == WRONG
    assert s["weight_compare"]["counts"]["missing_in_target"] == 1
    assert Path(s["stages"]["weights"]["outputs"]["xlsx"]).is_file()
