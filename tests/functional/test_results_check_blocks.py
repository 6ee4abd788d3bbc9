"""The check stages' blocks of summary.json as typed results: ``llmflow run`` (a subprocess, the
user's way) of a precheck on a tiny Qwen2 with one wrong kernel, a weight compare of two
checkpoints, an env-check of two env.json files and a badcase ranking on a tiny Llama writes a
summary.json that validates against the committed schema, reads back as ``RunSummary`` with each
block as its type (the dump stage's under its id as ``DumpStageBlock``) and writes the same JSON
again."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from path_helpers import checkout_path

from llmflow.errors import UserError
from llmflow.results.checks import (
    BadcaseBlock,
    BadcaseRank,
    DumpStageBlock,
    EnvDiffBlock,
    EnvDifference,
    MissingRepro,
    PrecheckBlock,
    PrecheckCall,
    PrecheckRepro,
    WeightCompareBlock,
    WeightProblem,
    WorstWeight,
)
from llmflow.results.codec import from_json, to_json
from llmflow.results.summary import RunSummary, read_run_summary, run_summary_from_json

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
ENV = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
SMALL = "layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64"

sys.path.insert(0, str(TESTS))  # tests/ holds the area's helpers
from checks_helpers import write_sharded  # noqa: E402


def run(workflow: str | Path, run_dir: Path, *sets: str, expect: int) -> tuple[RunSummary, dict[str, Any],
                                                                                  dict[str, Any]]:
    """``llmflow run`` in a subprocess; summary.json validated against the committed schema and
    read back: (typed, the other stages' blocks, the file's JSON)."""
    args = [sys.executable, "-m", "llmflow", "run", str(workflow), "--run-dir", str(run_dir),
            "--progress", "plain"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=run_dir.parent, env=ENV)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = json.loads((run_dir / "summary.json").read_text())
    jsonschema.validate(data, json.loads((REPO / "schemas" / "summary.schema.json").read_text()))
    summary, others = read_run_summary(run_dir / "summary.json")
    return summary, others, data


def fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_a_precheck_runs_blocks_read_back_as_their_types(tmp_path: Path) -> None:
    """The dump stage's block (under its id) and the precheck's: the lossy silu is the first
    failing call, with its repro folder; a requested call absent from the dump is listed."""
    faults = TESTS / "precheck_faults.py"
    summary, others, data = run("api_precheck", tmp_path / "run", f"model=tiny-qwen2:{SMALL}",
                                f"patch={faults}:lossy_silu", "repro_calls=[no_such_call]", expect=1)
    dump = from_json(DumpStageBlock, others["dump"], where="summary.json.dump")
    assert dump.dump.steps == 1 and dump.dump.entries > 0 and dump.dump.bytes > 0
    assert dump.dump.truncated is False and to_json(dump) == data["dump"]

    block = summary.precheck
    assert isinstance(block, PrecheckBlock) and to_json(block) == data["precheck"]
    assert block.status == "fail" and block.totals["fail"] == 1
    assert block.totals["calls"] == sum(sum(c.values()) for c in block.counts.values())
    assert isinstance(block.first_fail, PrecheckCall)
    assert (block.first_fail.name, block.first_fail.module) == ("model.layers.1.mlp.act_fn/silu.0",
                                                                "model.layers.1.mlp.act_fn")
    assert block.first_fail.ratio is not None and block.first_fail.ratio > 1
    assert [type(r) for r in block.repros] == [PrecheckRepro]
    assert (tmp_path / "run" / "precheck" / block.repros[0].script).is_file()
    assert block.repros_missing == [MissingRepro(name="no_such_call",
                                                 why="no call of this name or record in the dump")]
    assert set(data["precheck"]["first_fail"]) == fields(PrecheckCall)


def test_a_weight_compares_block_reads_back_as_its_type(tmp_path: Path) -> None:
    """One scaled tensor is the worst, a tensor missing in the target is a problem with its reason."""
    gen = torch.Generator().manual_seed(0)
    golden = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(16, 32, generator=gen) * 0.05
              for i in range(4)}
    golden["lm_head.weight"] = torch.randn(10, 16, generator=gen)
    target = {k: v.clone() for k, v in golden.items() if k != "lm_head.weight"}
    target["model.layers.2.mlp.down_proj.weight"] *= 1.5
    g = write_sharded(tmp_path / "golden", golden)
    t = write_sharded(tmp_path / "target", target)
    summary, _, data = run(REPO / "workflows" / "weight_check.yaml", tmp_path / "run", f"golden={g}",
                           f"target={t}", expect=1)
    block = summary.weight_compare
    assert isinstance(block, WeightCompareBlock) and to_json(block) == data["weight_compare"]
    assert isinstance(block.worst, WorstWeight)
    assert (block.worst.name, block.worst.verdict) == ("model.layers.2.mlp.down_proj.weight", "fail")
    assert block.worst.quant_type is None and block.worst.scheme == "float"  # plain float tensors
    assert block.worst.cosine_similarity == pytest.approx(1.0)
    assert block.problems == [WeightProblem(name="lm_head.weight", status="missing_in_target",
                                            reason="missing in target")]
    assert block.counts["tensors"] == 5 and block.counts["compared"] == 4
    assert set(data["weight_compare"]["worst"]) == fields(WorstWeight)  # missing values are null
    # a block that does not fit its type is one line naming the field
    data["weight_compare"]["worst"]["cosine_similarity"] = "high"
    with pytest.raises(UserError, match=r"^summary\.json\.weight_compare\.worst\.cosine_similarity: [^\n]*$"):
        run_summary_from_json(data)


def _env(**env_vars: str) -> dict[str, Any]:
    return {"versions": {"torch": "2.5.0"}, "env_vars": env_vars,
            "torch_settings": {"deterministic_algorithms": True, "allowed": [1, 2]}}


def test_an_env_checks_block_reads_back_as_its_type(tmp_path: Path) -> None:
    """60 differences: the block keeps the first 50, numerics-relevant first, with free JSON values
    and the side that lacks a key."""
    golden = _env(HCCL_DETERMINISTIC="true", **{f"MY_VAR_{i}": "a" for i in range(58)})
    target = _env(HCCL_DETERMINISTIC="false", ONLY_TARGET="1", **{f"MY_VAR_{i}": "b" for i in range(58)})
    target["torch_settings"]["allowed"] = [1, 3]
    (tmp_path / "golden.json").write_text(json.dumps(golden))
    (tmp_path / "target.json").write_text(json.dumps(target))
    (tmp_path / "env.yaml").write_text(
        "name: env\nstages:\n  env:\n    uses: env-check\n"
        "    with: {golden: golden.json, target: target.json}\n")
    summary, _, data = run(tmp_path / "env.yaml", tmp_path / "run", expect=0)
    block = summary.env_diff
    assert isinstance(block, EnvDiffBlock) and to_json(block) == data["env_diff"]
    assert (block.differences, len(block.items), block.truncated) == (61, 50, True)
    assert all(isinstance(it, EnvDifference) for it in block.items)
    assert block.items[0] == EnvDifference(key="env_vars.HCCL_DETERMINISTIC", section="env_vars",
                                           golden="true", target="false", missing=None,
                                           numerics_relevant=True, reason=block.items[0].reason)
    full = json.loads((tmp_path / "run" / "env" / "env_diff.json").read_text())
    assert len(full["items"]) == 61 and full["differences"] == 61  # the file holds them all
    by_key = {it["key"]: it for it in full["items"]}
    assert by_key["env_vars.ONLY_TARGET"]["missing"] == "golden"
    assert by_key["torch_settings.allowed"]["target"] == [1, 3]


def test_a_badcase_block_reads_back_as_its_type(tmp_path: Path) -> None:
    """Two prompts on a tiny Llama against itself with a wrong activation: ranked worst first."""
    (tmp_path / "badcase.yaml").write_text(
        "name: rank\nstages:\n  badcase:\n    uses: badcase\n    with:\n"
        f"      golden_model: 'tiny-llama:{SMALL}'\n      target_model: 'tiny-llama:{SMALL}'\n"
        f"      target_patch: '{REPO / 'plugins' / 'example_faults.py'}:wrong_act_layer_1'\n"
        "      max_new_tokens: 3\n      prompts: [a short one, a somewhat longer prompt with more words]\n")
    summary, _, data = run(tmp_path / "badcase.yaml", tmp_path / "run", expect=0)
    block = summary.badcase
    assert isinstance(block, BadcaseBlock) and to_json(block) == data["badcase"]
    assert block.prompts == 2 and [r.rank for r in block.ranking] == [1, 2]
    assert all(isinstance(r, BadcaseRank) for r in block.ranking)
    assert block.worst_prompt == block.ranking[0].prompt
    assert block.ranking[0].max_kl >= block.ranking[1].max_kl > 0
