"""overflow.scan on in-memory dumps: origins, NaN traces, near-max, ranks, statistics entries."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from llmflow.checks.overflow import dtype_max, is_collective, overflow_summary, scan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from checks_helpers import FakeDump  # noqa: E402

INF, NAN = float("inf"), float("nan")
h16 = torch.float16


def _t(*vals: float, dtype: torch.dtype = h16) -> torch.Tensor:
    return torch.tensor(vals, dtype=dtype)


def _layer(d: FakeDump, up_out: torch.Tensor, down_out: torch.Tensor, stats: bool = False) -> FakeDump:
    """A decoder layer: q_proj (clean), up_proj, down_proj(up_proj's output), inside the layer."""
    x = _t(1.0, 2.0)
    d.enter("model.layers.0", x, stats=stats)
    d.call("model.layers.0.self_attn.q_proj", [x], [_t(0.5, 0.5)], stats=stats)
    d.call("model.layers.0.mlp.up_proj", [x], [up_out], stats=stats)
    d.call("model.layers.0.mlp.down_proj", [up_out], [down_out], stats=stats)
    return d.exit("model.layers.0", down_out, stats=stats)


@pytest.mark.parametrize("stats", [False, True])
def test_inf_origin_is_the_innermost_module_and_nan_traces_back(stats):
    d = _layer(FakeDump(), _t(INF, 3.0), _t(NAN, 1.0), stats=stats)
    r = scan(d)
    first = r["first_origin"]
    assert (first["name"], first["kind"], first["step"], first["rank"]) == \
        ("model.layers.0.mlp.up_proj", "inf", 0, 0)
    assert first["inputs_clean"] and first["module_type"] is None
    assert [(e["name"], e["kind"]) for e in r["nan_trace"]] == [
        ("model.layers.0.mlp.down_proj", "nan"), ("model.layers.0.mlp.up_proj", "inf")]
    # flagged: up out (inf), down in (inf), down out (nan), layer out (nan)
    assert r["counts"]["inf"] == 2 and r["counts"]["nan"] == 2 and r["anomalies"] == 4
    origin_rows = [row for row in r["rows"] if row["origin"]]
    assert [(row["name"], row["kind"]) for row in origin_rows] == [("model.layers.0.mlp.up_proj", "output")]
    s = overflow_summary(r)
    assert s["first_origin"]["name"] == "model.layers.0.mlp.up_proj" and s["anomalies"] == 4


def test_clean_dump_has_no_origin():
    r = scan(_layer(FakeDump(), _t(3.0, 4.0), _t(1.0, 1.0)))
    assert r["first_origin"] is None and r["anomalies"] == 0 and r["nan_trace"] == []
    assert r["counts"]["entries_scanned"] == 8


def test_near_max_follows_the_fraction_and_the_dtype():
    d = _layer(FakeDump(), _t(40000.0, 1.0), _t(2.0, 1.0))
    first = scan(d)["first_origin"]
    assert (first["name"], first["kind"]) == ("model.layers.0.mlp.up_proj", "near-max")
    assert first["max_abs"] == 40000.0
    assert scan(d, near_max_fraction=0.7)["first_origin"] is None  # 40000 < 0.7 * 65504
    # the same value in bf16 is nowhere near bf16's max
    bf = _layer(FakeDump(), _t(40000.0, 1.0, dtype=torch.bfloat16), _t(2.0, 1.0, dtype=torch.bfloat16))
    assert scan(bf)["first_origin"] is None


def test_dtype_max_values():
    assert dtype_max("float16") == 65504.0
    assert dtype_max("torch.bfloat16") == pytest.approx(3.3895e38, rel=1e-4)
    assert dtype_max("float32") == pytest.approx(3.4028e38, rel=1e-4)
    assert dtype_max("int8") is None and dtype_max(None) is None


def test_nonfinite_origin_wins_over_an_earlier_near_max_warning():
    d = FakeDump()
    d.call("model.a", [_t(1.0)], [_t(50000.0)])
    d.call("model.b", [_t(50000.0)], [_t(INF)])
    d.call("model.c", [_t(INF)], [_t(NAN)])
    r = scan(d)
    assert (r["first_origin"]["name"], r["first_origin"]["kind"]) == ("model.b", "inf")
    # the trace goes back through the near-max warning to the first producer
    assert [e["name"] for e in r["nan_trace"]] == ["model.c", "model.b", "model.a"]
    assert r["counts"]["near-max"] == 2


def test_values_bad_before_the_first_dumped_call_are_said_so():
    d = FakeDump()
    d.call("model.a", [_t(NAN)], [_t(NAN)])
    first = scan(d)["first_origin"]
    assert first["name"] == "model.a" and not first["inputs_clean"]
    assert "before the first dumped call" in first["note"]


def test_earliest_step_first_and_step_rank_filters():
    d = FakeDump()
    d.at(0).call("model.a", [_t(1.0)], [_t(1.0)])
    d.at(1).call("model.a", [_t(1.0)], [_t(1.0)])
    d.at(1).call("model.b", [_t(1.0)], [_t(INF)])
    d.at(2).call("model.a", [_t(1.0)], [_t(NAN)])
    r = scan(d)
    assert (r["first_origin"]["step"], r["first_origin"]["name"]) == (1, "model.b")
    assert r["counts"]["steps"] == [0, 1, 2]
    only2 = scan(d, steps=[2])
    assert (only2["first_origin"]["step"], only2["first_origin"]["kind"]) == (2, "nan")
    assert scan(d, ranks=[3])["counts"]["entries_scanned"] == 0


def test_nan_through_a_collective_is_traced_to_the_sending_rank():
    d = FakeDump()
    # rank 0: clean until the all-reduce hands it a NaN
    d.at(0, rank=0).call("model.layers.0.mlp.down_proj", [_t(1.0)], [_t(1.0)])
    d.at(0, rank=0).call("model.layers.0.mlp/all_reduce.0", [_t(1.0)], [_t(NAN)], level="api")
    d.at(0, rank=0).call("model.layers.1.mlp.up_proj", [_t(NAN)], [_t(NAN)])
    # rank 1: its down_proj makes the NaN, which it sends into the all-reduce
    d.at(0, rank=1).call("model.layers.0.mlp.down_proj", [_t(1.0)], [_t(NAN)])
    d.at(0, rank=1).call("model.layers.0.mlp/all_reduce.0", [_t(NAN)], [_t(NAN)], level="api")
    r = scan(d)
    first = r["first_origin"]
    assert (first["rank"], first["name"], first["kind"]) == (1, "model.layers.0.mlp.down_proj", "nan")
    assert first["propagated_to"] == [{"rank": 0, "name": "model.layers.0.mlp/all_reduce.0"}]
    trace = r["nan_trace"]
    assert [(e["rank"], e["name"]) for e in trace] == [
        (0, "model.layers.0.mlp/all_reduce.0"), (1, "model.layers.0.mlp.down_proj")]
    assert "rank 0" in trace[-1]["note"]


def test_collective_names():
    assert is_collective("model.layers.0.mlp/all_reduce.0")
    assert is_collective("/hccl_allgather.1")
    assert not is_collective("model.layers.0.mlp.down_proj")
    assert not is_collective("model.layers.0.mlp/matmul.0")


def test_integer_tensors_and_weights_are_not_scanned():
    d = FakeDump()
    d.call("model.embed_tokens", [torch.tensor([1, 2])], [_t(1.0, 2.0)])
    d._add("model.w", "weight", [_t(INF)], "weight", False)
    d._entries[-1].step = -1
    r = scan(d)
    assert r["counts"]["entries_scanned"] == 1 and r["first_origin"] is None


def test_stats_of_a_statistics_entry_drive_max_abs():
    d = FakeDump()
    d.call("model.a", [_t(1.0)], [_t(-60000.0, 2.0)], stats=True)
    r = scan(d)
    assert r["first_origin"]["kind"] == "near-max" and math.isclose(r["first_origin"]["max_abs"], 60000.0)
