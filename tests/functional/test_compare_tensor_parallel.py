"""A tensor-parallel target (a Megatron-style TP=2 tiny Llama over gloo, run under torchrun as a
user runs it) against its TP=1 golden: the ranks' shards join into the golden's tensors, a clean
port passes with every tensor paired, and a fault in one rank's shard is named with its module
and, where the shard has an error of its own, its rank."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from llmflow.results.codec import to_json
from llmflow.results.compare import read_compare_summary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from tp_helpers import TP_FAULTS, launch_tp  # noqa: E402
from workflow_helpers import llmflow  # noqa: E402


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """golden/ (one process), clean/ and each fault of TP_FAULTS (two ranks, one launch), in
    module+api mode."""
    out = tmp_path_factory.mktemp("tp")
    launch_tp(out, ["golden"], 1, "module,api")
    launch_tp(out, ["clean", *(f"{name}={spec}" for name, spec in TP_FAULTS.items())], 2, "module,api")
    return out


def _dump(dumps: Path, name: str) -> str:
    return str(dumps / name / "llmflow_dump")


def _rows(out: Path, level: str) -> list[dict[str, str]]:
    with open(out / f"compare_{level}.csv", newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _first_fail(out: Path, level: str) -> dict:
    return json.loads((out / "compare_summary.json").read_text())["levels"][level]["first_fail"]


def test_the_dump_records_each_rank_and_its_world(dumps: Path) -> None:
    for r in (0, 1):
        meta = json.loads((dumps / "clean" / "llmflow_dump" / f"rank{r}" / "rank.json").read_text())
        assert meta["rank"] == r and meta["world_size"] == 2 and meta["complete"] is True


def test_a_clean_tp_port_passes_with_every_tensor_paired(tmp_path: Path, dumps: Path) -> None:
    proc = llmflow("compare", "-gp", _dump(dumps, "golden"), "-mp", _dump(dumps, "clean"), "-o",
                   str(tmp_path / "out"), "-cl", "logits", "layer", "module", "--no-xlsx")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED"), proc.stdout
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    joined = summary["matching"]["tensor_parallel"]
    assert joined["ranks"] == 2 and joined["joined"]["concat"] > 0 and joined["joined"]["replicated"] > 0
    assert to_json(read_compare_summary(tmp_path / "out" / "compare_summary.json")) == summary
    rows = _rows(tmp_path / "out", "module")
    assert rows and all(r["verdict"] != "unmatched" for r in rows)
    # q_proj's output is split over the ranks' heads: joined back to the golden's shape
    q = next(r for r in rows if r["name"] == "model.layers.0.self_attn.q_proj" and r["kind"] == "output")
    assert q["golden_shape"] == q["target_shape"] == "[1,6,64]" and q["shards"] == "2 ranks, concat:2"


@pytest.mark.parametrize("fault,module,rank", [
    ("mlp_rank1", "model.layers.1.mlp.up_proj", 1),
    ("attn_rank0", "model.layers.2.self_attn.k_proj", 0),
])
def test_a_faulty_shard_names_its_module_and_rank(tmp_path: Path, dumps: Path, fault: str, module: str,
                                                   rank: int) -> None:
    proc = llmflow("compare", "-gp", _dump(dumps, "golden"), "-mp", _dump(dumps, fault), "-o",
                   str(tmp_path / "out"), "-cl", "layer", "module", "--no-xlsx")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("FAILED") and module in last, proc.stdout
    first = _first_fail(tmp_path / "out", "module")
    assert first["name"] == module and first["step"] == 0
    assert f"rank {rank}'s shard stands out" in first["reason"]


def test_a_row_parallel_fault_names_the_module_without_guessing_a_rank(tmp_path: Path, dumps: Path) -> None:
    """The all-reduce sums the ranks' partial products: the module is found, no rank can be."""
    proc = llmflow("compare", "-gp", _dump(dumps, "golden"), "-mp", _dump(dumps, "row_rank1"), "-o",
                   str(tmp_path / "out"), "-cl", "module", "--no-xlsx")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    first = _first_fail(tmp_path / "out", "module")
    assert first["name"] == "model.layers.0.mlp.down_proj" and first["kind"] == "output"
    assert "stands out" not in first["reason"]


def test_a_missing_all_reduce_is_said_in_the_first_failing_rows_reason(tmp_path: Path, dumps: Path) -> None:
    """layer 1's o_proj keeps each rank's partial product: its copies differ and sum to the golden's,
    which the first failing row says, in the compare the user runs on the two dumps."""
    proc = llmflow("compare", "-gp", _dump(dumps, "golden"), "-mp", _dump(dumps, "no_reduce"), "-o",
                   str(tmp_path / "out"), "-cl", "module", "--no-xlsx")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("FAILED"), proc.stdout
    first = _first_fail(tmp_path / "out", "module")
    assert first["name"] == "model.layers.1.self_attn.o_proj" and first["step"] == 0, first
    assert "the ranks' copies differ and their sum is the golden's" in first["reason"], first["reason"]
    assert "partial products not all-reduced" in first["reason"]
    # a fault in one rank's shard of a replicated tensor is not partial products
    proc = llmflow("compare", "-gp", _dump(dumps, "golden"), "-mp", _dump(dumps, "mlp_rank1"), "-o",
                   str(tmp_path / "other"), "-cl", "module", "--no-xlsx")
    rows = _rows(tmp_path / "other", "module")
    assert not any("their sum is the golden's" in r["reason"] for r in rows)


def test_partial_products_join_by_sum_through_a_mapping_file(tmp_path: Path, dumps: Path) -> None:
    """Inside a row-parallel linear, before its all-reduce, each rank holds a partial product of
    the golden's shape: shapes say "replicated" and those rows fail; a mapping file's ``shards``
    says they are summed, and the API level then passes (the all-reduced tensors that follow hold
    the reduced values: a distributed dump never reuses a capture the collective rewrote)."""
    golden, clean = _dump(dumps, "golden"), _dump(dumps, "clean")
    plain = llmflow("compare", "-gp", golden, "-mp", clean, "-o", str(tmp_path / "plain"), "-cl", "api",
                    "--no-xlsx")
    assert plain.returncode == 1
    failing = [r for r in _rows(tmp_path / "plain", "api") if r["verdict"] == "fail"]
    fails = {r["name"] for r in failing}
    assert fails and all(n.endswith(("o_proj/linear.0", "down_proj/linear.0")) for n in fails), fails
    assert all("their sum is the golden's" in r["reason"] and "merge: sum" in r["reason"] for r in failing)
    mapping = tmp_path / "tp.yaml"
    mapping.write_text('rules: []\nshards:\n'
                       '  - {target: "model.layers.*.self_attn.o_proj/linear.*", merge: sum}\n'
                       '  - {target: "model.layers.*.mlp.down_proj/linear.*", merge: sum}\n')
    summed = llmflow("compare", "-gp", golden, "-mp", clean, "-o", str(tmp_path / "summed"), "-cl", "api",
                     "-mf", str(mapping), "--no-xlsx")
    assert summed.returncode == 0, summed.stdout
    rows = _rows(tmp_path / "summed", "api")
    assert any(r["shards"] == "2 ranks, sum" and r["verdict"] == "pass" for r in rows)
    # the residual add after o_proj sees the all-reduced output, not the partial product
    add = [r for r in rows if r["name"] == "model.layers.0/add.0" and r["index"] == "1"]
    assert add and all(r["verdict"] == "pass" for r in add)
