"""weights: int4 unpacking, dequantization schemes, checkpoint sources and quant descriptions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmflow.checks.weights import (
    Checkpoint,
    compare_sources,
    judge_siblings,
    map_name,
    open_weights,
    plan_source,
)
from llmflow.errors import UserError
from llmflow.quantized import (
    QuantConfig,
    deq_scale_as_float,
    dequantize,
    find_quant_config,
    int4_packed_dim,
    unpack_int4,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from checks_helpers import pack_int4, quant_int4_groups, quant_per_channel, write_sharded  # noqa: E402


def test_unpack_int4_low_nibble_first_signed():
    packed = torch.tensor([[0x21, 0xF8, 0x7F]], dtype=torch.uint8).view(torch.int8)
    assert unpack_int4(packed).tolist() == [[1, 2, -8, -1, -1, 7]]
    q = torch.randint(-8, 8, (5, 12), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_dequantize_per_tensor_channel_and_group():
    w = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
    out, scheme = dequantize(w, torch.tensor([0.5]), None)
    assert scheme == "per-tensor" and out.tolist() == [[0.5, -1.0], [1.5, 2.0]]
    out, scheme = dequantize(w, torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [0.0]]))
    assert scheme == "per-channel" and out.tolist() == [[0.0, -3.0], [6.0, 8.0]]
    w4 = torch.tensor([[1, 1, 2, 2]], dtype=torch.int8)
    out, scheme = dequantize(w4, torch.tensor([[1.0, 10.0]]), None)
    assert scheme == "per-group g=2" and out.tolist() == [[1.0, 1.0, 20.0, 20.0]]
    out_t, _ = dequantize(w4, torch.tensor([[1.0], [10.0]]), None)  # stored [n_groups, out]
    assert out_t.tolist() == out.tolist()


def test_dequantize_rejects_scales_that_do_not_fit():
    w = torch.zeros(4, 6, dtype=torch.int8)
    with pytest.raises(ValueError, match="weight_scale shape"):
        dequantize(w, torch.ones(3), None)
    with pytest.raises(ValueError, match="group_size 4"):
        dequantize(w, torch.ones(4, 2), None, group_size=4)


def test_dequantize_round_trips_known_quantization():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    q, s, o = quant_per_channel(w, offset=3)
    deq, _ = dequantize(q, s, o)
    assert (deq - w).abs().max() <= s.max() / 2 + 1e-6
    q4, s4 = quant_int4_groups(w, 4)
    deq4, scheme = dequantize(q4, s4, None, group_size=4)
    assert scheme == "per-group g=4" and (deq4 - w).abs().max() <= s4.max() / 2 + 1e-6


def test_sharded_checkpoint_reads_every_shard_through_the_index(tmp_path):
    tensors = {f"t{i}": torch.full((2,), float(i)) for i in range(5)}
    ck = Checkpoint(write_sharded(tmp_path / "ck", tensors, shards=3))
    assert sorted(ck.keys()) == sorted(tensors) and len(set(ck.files.values())) == 3
    assert ck.get("t4").tolist() == [4.0, 4.0] and ck.meta("t3") == ((2,), "float32")
    # the index itself and a single shard file are sources too
    assert len(Checkpoint(tmp_path / "ck" / "model.safetensors.index.json").keys()) == 5
    one = next((tmp_path / "ck").glob("*00001-of*"))
    assert len(Checkpoint(one).keys()) == 2


def test_checkpoint_errors_name_the_file(tmp_path):
    write_sharded(tmp_path / "ck", {"a": torch.ones(1), "b": torch.ones(1)})
    (tmp_path / "ck" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match="shard model-00002-of-00002.safetensors is missing"):
        Checkpoint(tmp_path / "ck")
    (tmp_path / "dup").mkdir()
    save_file({"a": torch.ones(1)}, str(tmp_path / "dup" / "x.safetensors"))
    save_file({"a": torch.ones(1)}, str(tmp_path / "dup" / "y.safetensors"))
    with pytest.raises(UserError, match="'a' is in two shards"):
        Checkpoint(tmp_path / "dup")
    (tmp_path / "m.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="never unpickles"):
        Checkpoint(tmp_path / "m.bin")
    with pytest.raises(UserError, match="no such checkpoint"):
        open_weights(tmp_path / "nope")


def test_quant_description_found_and_parsed(tmp_path):
    folder = tmp_path / "q"
    folder.mkdir()
    (folder / "quant_model_description_w8a8.json").write_text(json.dumps({
        "model_quant_type": "w8a8", "a.weight": "W8A8", "norm.weight": "FLOAT", "group_size": 64}))
    found = find_quant_config(folder)
    assert found is not None and found.name == "quant_model_description_w8a8.json"
    cfg = QuantConfig.load(found)
    assert cfg.type_of("a.weight") == "W8A8" and cfg.type_of("norm.weight") == "FLOAT"
    assert cfg.type_of("other.weight") == "W8A8" and cfg.group_size == 64 and cfg.int4_packed is None


def test_plan_consumes_companions_and_flags_unsupported(tmp_path):
    folder = tmp_path / "q"
    save_file({"a.weight": torch.zeros(2, 2, dtype=torch.int8), "a.weight_scale": torch.ones(2, 1),
               "a.input_scale": torch.ones(1), "a.deq_scale": torch.ones(2),
               "b.weight": torch.zeros(2, 2, dtype=torch.int8), "b.weight_scale": torch.ones(1),
               "n.weight": torch.ones(2), "i.weight": torch.zeros(2, dtype=torch.int8),
               "b.index": torch.zeros(3, dtype=torch.int8), "b.info": torch.zeros(3, dtype=torch.int8),
               "c.weight": torch.zeros(2, 2, dtype=torch.int8), "c.weight_scale": torch.ones(2, 1),
               "c.weight_scale_second": torch.ones(2, 1)},
              str(write_sharded(folder, {"x": torch.ones(1)}, shards=1) / "extra.safetensors"))
    (folder / "model.safetensors.index.json").unlink()
    (folder / "quant_model_description.json").write_text(json.dumps(
        {"a.weight": "W8A8", "b.weight": "W8A8SC", "b.index": "W8A8SC", "b.info": "W8A8SC",
         "c.weight": "W4A8_DYNAMIC", "n.weight": "FLOAT"}))
    src = open_weights(folder)
    plans, companions = plan_source(src)
    assert companions == 4 + 2 + 2  # a's three, b's scale, b's index and info, c's two scales
    assert plans["a.weight"].qtype == "W8A8" and plans["a.weight"].problem is None
    assert plans["b.weight"].problem is not None and plans["b.weight"].problem.startswith(
        "sparse-compressed W8A8SC: msModelSlim's compressed layout cannot be decoded")
    assert plans["c.weight"].problem == "unsupported quantization scheme W4A8_DYNAMIC"
    assert plans["n.weight"].qtype is None and plans["i.weight"].qtype is None  # compared as stored
    assert set(plans) == {"a.weight", "b.weight", "c.weight", "n.weight", "i.weight", "x"}


def test_map_name_uses_the_longest_prefix():
    m = {"transformer.": "model.", "transformer.h.": "model.layers."}
    assert map_name("transformer.h.0.w", m) == "model.layers.0.w"
    assert map_name("transformer.wte", m) == "model.wte"
    assert map_name("lm_head.weight", m) == "lm_head.weight" and map_name("x", None) == "x"


def test_unpack_int4_along_the_output_dim_and_the_packing_rules():
    q = torch.randint(-8, 8, (6, 4), generator=torch.Generator().manual_seed(2)).to(torch.int8)
    by_rows = pack_int4(q.t().contiguous()).t().contiguous()  # [3, 4]: rows 2j, 2j+1 share byte row j
    assert torch.equal(unpack_int4(by_rows, dim=0), q)
    v1 = QuantConfig(version="1.0.0")
    assert int4_packed_dim((6, 2), (6, 1), v1, None) == 1  # per-channel: along the input dim
    assert int4_packed_dim((3, 4), (6, 2), v1, None) == 0  # per-group: along the output dim
    assert int4_packed_dim((6, 4), (6, 1), QuantConfig(), (6, 4)) is None  # safe_tensor: unpacked
    assert int4_packed_dim((3, 4), (6, 2), None, (6, 4)) == 0  # no description: the twin's shape tells


def test_w8a8s_scale_comes_from_deq_scale_bits(tmp_path):
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    q, s, _ = quant_per_channel(w)
    input_scale = torch.tensor([0.02])
    deq_bits = (s.flatten() * input_scale).view(torch.int32).to(torch.int64)  # as msModelSlim stores it
    assert torch.equal(deq_scale_as_float(deq_bits), s.flatten() * input_scale)
    folder = tmp_path / "q"
    folder.mkdir()
    save_file({"l.weight": q, "l.deq_scale": deq_bits, "l.input_scale": input_scale,
               "l.input_offset": torch.zeros(1), "l.quant_bias": torch.zeros(4, dtype=torch.int32)},
              str(folder / "m.safetensors"))
    (folder / "quant_model_description_w8a8s.json").write_text(json.dumps({"model_quant_type": "W8A8S"}))
    save_file({"l.weight": w}, str(tmp_path / "g.safetensors"))
    rows, companions = compare_sources(open_weights(tmp_path / "g.safetensors"), open_weights(folder))
    assert companions == 4 and len(rows) == 1 and rows[0]["scheme"] == "W8A8S per-channel"
    assert rows[0]["verdict"] == "pass" and rows[0]["relative_euclidean_distance"] < 0.01


def test_siblings_fail_the_tensor_that_stands_out():
    def row(layer: int, dist: float, gain: float) -> dict:
        return {"name": f"model.layers.{layer}.mlp.up_proj.weight", "status": "compared", "verdict": "pass",
                "code": "ok", "reason": "", "relative_euclidean_distance": dist, "scale_error": gain}

    rows = [row(0, 0.10, 0.03), row(1, 0.28, 0.29), row(2, 0.11, 0.02), row(3, 0.12, 0.03),
            {"name": "lm_head.weight", "status": "compared", "verdict": "pass",
             "relative_euclidean_distance": 9}]
    judge_siblings(rows, 3.0)
    assert [r["verdict"] for r in rows] == ["pass", "fail", "pass", "pass", "pass"]  # lm_head has no siblings
    assert rows[1]["code"] == "sibling_outlier" and rows[1]["sibling_score"] == pytest.approx(0.29 / 0.03)
    assert rows[1]["reason"].startswith("scale_error 0.29 is 9.7x the median 0.03 of "
                                        "model.layers.*.mlp.up_proj.weight in the other 3 layers")
    exact = [row(i, 0.0, 0.0) for i in range(3)] + [row(3, 2e-6, 2e-6)]  # exact siblings: a floor
    judge_siblings(exact, 3.0)
    assert all(r["verdict"] == "pass" for r in exact)
