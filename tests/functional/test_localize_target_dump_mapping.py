"""The bisect from a target dump reads the compare's mapping file (``mapping``): its ``shards``
rules decide how a tensor-parallel target's module outputs join, over what their shapes say, and
its name rules which golden module a target module of a port that renamed its modules is. The
verdict names the golden's modules.

The tensor-parallel target is tests/fixtures/tp_llama.py under torchrun (TP=2) with
``--reduce after-mlp``: ``down_proj`` dumps its partial products (the MLP around it all-reduces),
which have the golden's shape, so the shapes take them for replicated copies; they differ, so they
are summed, and each rank's is measured against the golden module on that rank's input slice
alone. The renamed port is tests/fixtures/renamed_llama.py (``transformer.h.1.attn`` for
``model.layers.1.self_attn``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llmflow.compare.mappings import load_mapping
from llmflow.errors import UserError
from llmflow.formats import open_dump
from llmflow.localize.bisect import run_bisect
from llmflow.localize.options import BisectInputs
from llmflow.localize.target_dump import raw_errors_joined

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from tp_helpers import TP_FAULTS, TP_GOLDEN_MODEL, launch_tp  # noqa: E402
from workflow_helpers import REPO, llmflow  # noqa: E402

WORKFLOW = REPO / "workflows" / "dump_bisect.yaml"
RENAMED = REPO / "tests" / "fixtures" / "renamed_llama.py"
DOWN_PROJ_SUM = "rules: []\nshards: [{target: 'model.layers.*.mlp.down_proj', merge: sum}]\n"
O_PROJ_SUM = "rules: []\nshards: [{target: 'model.layers.*.self_attn.o_proj', merge: sum}]\n"


def _run(tmp_path: Path, golden: str | Path, target: str | Path, model: str, *extra: str):
    """``llmflow run dump_bisect`` in a subprocess: the process and the verdict (None: none written)."""
    run_dir = tmp_path / "run"
    proc = llmflow("run", str(WORKFLOW), "--run-dir", str(run_dir), "--set", f"golden_dump={golden}",
                   "--set", f"target_dump={target}", "--set", f"golden_model={model}", *extra, timeout=300)
    verdict_file = run_dir / "bisect" / "verdict.json"
    return proc, json.loads(verdict_file.read_text()) if verdict_file.is_file() else None


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def tp_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """golden/ (one process); clean/ and row_rank1/ (two ranks, one launch, down_proj's partial
    products dumped before the MLP's all-reduce)."""
    out = tmp_path_factory.mktemp("tp-partial")
    launch_tp(out, ["golden"], 1)
    launch_tp(out, ["clean", f"row_rank1={TP_FAULTS['row_rank1']}"], 2, options=("--reduce", "after-mlp"))
    return out


def _tp(dumps: Path, name: str) -> str:
    return str(dumps / name / "llmflow_dump")


def _bisect_tp(dumps: Path, name: str, mapping: str | None) -> dict:
    inp = BisectInputs(golden_dump=_tp(dumps, "golden"), target_dump=_tp(dumps, name),
                       golden_spec={"model": TP_GOLDEN_MODEL}, mapping=mapping, top_k=100)
    verdict = run_bisect(inp, log=lambda _m: None)
    return verdict, {c.name: c for c in verdict.candidates}


def test_a_sum_rule_joins_partial_products_the_shapes_take_for_copies(tmp_path: Path, tp_dumps: Path) -> None:
    mapping = _write(tmp_path / "tp.yaml", DOWN_PROJ_SUM)
    golden, target = open_dump(_tp(tp_dumps, "golden")), open_dump(_tp(tp_dumps, "clean"))
    name = "model.layers.0.mlp.down_proj"
    by_shape = raw_errors_joined(golden, target, 0, 0)[name]["rel_l2"]
    by_rule = raw_errors_joined(golden, target, 0, 0, load_mapping(mapping))[name]["rel_l2"]
    assert by_shape > 0.1 and by_rule < 1e-5, (by_shape, by_rule)  # rank 0's partial product is not the whole

    verdict, rows = _bisect_tp(tp_dumps, "clean", mapping)
    assert verdict.status == "pass", verdict.headline
    for layer in range(3):
        row = rows[f"model.layers.{layer}.mlp.down_proj"]
        assert row.sharding == "inputs concat:2, output sum (shards rule)" and row.error < 1e-5
        assert row.raw_rel_l2 < 1e-5 and len(row.rank_errors) == 2 and max(row.rank_errors) < 1e-5
        assert row.shard_rank is None and row.rank_note is None


def test_partial_products_the_shapes_sum_name_the_rank_whose_shard_is_wrong(tp_dumps: Path) -> None:
    """Without a rule the ranks' differing outputs of the golden's shape are summed; each is
    measured against the golden down_proj on that rank's slice of its input alone."""
    verdict, rows = _bisect_tp(tp_dumps, "row_rank1", None)
    row = rows["model.layers.0.mlp.down_proj"]
    assert verdict.status == "fail" and verdict.first_bad_module == row.name and verdict.first_bad_rank == 1
    assert row.sharding == "inputs concat:2, output sum" and row.shard_rank == 1
    assert abs(row.rank_errors[1] - 0.5) < 1e-3 and row.rank_errors[0] < 1e-5, row.rank_errors


def test_a_sum_rule_sums_outputs_that_are_equal_on_every_rank(tmp_path: Path, tp_dumps: Path) -> None:
    """o_proj all-reduces inside itself: its outputs are equal on both ranks. Without a rule they
    are copies; a sum rule sums them all the same (twice the golden: an own error of about 1)."""
    _verdict, copies = _bisect_tp(tp_dumps, "clean", None)
    _verdict, summed = _bisect_tp(tp_dumps, "clean", _write(tmp_path / "o.yaml", O_PROJ_SUM))
    name = "model.layers.1.self_attn.o_proj"
    assert copies[name].sharding == "inputs concat:2, output replicated" and copies[name].error < 1e-5
    assert summed[name].sharding == "inputs concat:2, output sum (shards rule)"
    assert 0.99 < summed[name].error < 1.01 and 0.99 < summed[name].raw_rel_l2 < 1.01


def test_the_workflow_names_a_row_parallel_fault_through_the_sum_rule(tmp_path: Path, tp_dumps: Path) -> None:
    mapping = _write(tmp_path / "tp.yaml", DOWN_PROJ_SUM)
    proc, verdict = _run(tmp_path, _tp(tp_dumps, "golden"), _tp(tp_dumps, "row_rank1"), TP_GOLDEN_MODEL,
                         "--set", f"mapping={mapping}")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert verdict["first_bad_module"] == "model.layers.0.mlp.down_proj" and verdict["first_bad_rank"] == 1
    assert "rank 1's shard" in verdict["diagnosis"], verdict["diagnosis"]
    top = verdict["candidates"][0]
    assert top["name"] == "model.layers.0.mlp.down_proj"
    assert top["sharding"] == "inputs concat:2, output sum (shards rule)"


@pytest.fixture(scope="module")
def renamed_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """golden/ (the tiny Llama) and port/ (the same weights under renamed modules, layer 1's
    up_proj scaled), both in module mode with every module's inputs and outputs."""
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.models import load_model

    out = tmp_path_factory.mktemp("renamed")
    ids = [256, 104, 101, 108, 108, 111]
    for name, spec in (("golden", "golden_model"), ("port", "faulty_port")):
        config = DumpConfig(dump_path=str(out / name), token_range="all")
        dump_run(load_model(f"{RENAMED}:{spec}"), ids, 3, config)
    sys.path.insert(0, str(RENAMED.parent))
    from renamed_llama import MAPPING

    (out / "ported.yaml").write_text(MAPPING, encoding="utf-8")
    return out


def _run_renamed(tmp_path: Path, dumps: Path, *extra: str):
    return _run(tmp_path, dumps / "golden", dumps / "port", f"{RENAMED}:golden_model", *extra)


def test_renamed_modules_without_a_mapping_are_inconclusive(tmp_path: Path, renamed_dumps: Path) -> None:
    """No target module name is a golden module: nothing to replay, said so, with the mapping to give."""
    proc, verdict = _run_renamed(tmp_path, renamed_dumps)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1].startswith("INCONCLUSIVE") and "no module of the golden model" in lines[-1], lines[-1]
    assert "transformer" in lines[-1]
    assert any(line.startswith("next:") and "mapping" in line for line in lines), lines[-4:]
    assert verdict["status"] == "inconclusive" and verdict["first_bad_module"] is None


def test_renamed_modules_with_the_mapping_name_the_faulty_golden_module(tmp_path: Path,
                                                                        renamed_dumps: Path) -> None:
    proc, verdict = _run_renamed(tmp_path, renamed_dumps, "--set", f"mapping={renamed_dumps / 'ported.yaml'}")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("FAILED")
    assert verdict["first_bad_module"] == "model.layers.1.mlp.up_proj", verdict["headline"]
    names = {c["name"] for c in verdict["candidates"]}
    assert any(".self_attn." in n for n in names) and not any(n.startswith("transformer") for n in names)
    assert verdict["replay"]["replayed"] > 30 and verdict["replay"]["not_replayable"] == 0


def test_a_bad_mapping_file_is_refused_in_one_line(tmp_path: Path, renamed_dumps: Path) -> None:
    bad = _write(tmp_path / "bad.yaml", "rules:\n  - {target: 'transformer.h.{n}'}\n")  # no golden
    proc, verdict = _run_renamed(tmp_path, renamed_dumps, "--set", f"mapping={bad}")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert last.startswith("FAILED") and "bad.yaml" in last and "rules/0" in last, last
    assert verdict is None
    # the bisect reads it with the compare's loader: the same one-line error, naming the file
    inp = BisectInputs(golden_dump=renamed_dumps / "golden", target_dump=renamed_dumps / "port",
                       golden_spec={"model": f"{RENAMED}:golden_model"}, mapping=bad)
    with pytest.raises(UserError, match=r"bad\.yaml: rules/0"):
        run_bisect(inp, log=lambda _m: None)
    with pytest.raises(UserError, match="mapping: no such file"):
        run_bisect(BisectInputs(golden_dump=inp.golden_dump, target_dump=inp.target_dump,
                                golden_spec=inp.golden_spec, mapping=str(tmp_path / "none.yaml")),
                   log=lambda _m: None)
