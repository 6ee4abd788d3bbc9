"""An expert-parallel port, dumped as a user dumps it: tiny Mixtral and Qwen3-MoE checkpoints loaded
with transformers' own tensor and expert parallelism over two gloo ranks (tests/fixtures/ep_moe.py
under torchrun; DTensor parameters, half the experts per rank, their outputs all-reduced), bisected
with workflows/dump_bisect.yaml against a one-process golden dump. Each rank's dump holds its own
shards; a clean port passes; one rank's copy of one expert gone wrong is named to the experts
module, the expert and the rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from workflow_helpers import REPO, llmflow  # noqa: E402

SCRIPT = REPO / "tests" / "fixtures" / "ep_moe.py"
FAMILIES = ["mixtral", "qwen3-moe"]
#: rank 1's first local expert in layer 1 (global expert 2 of 4), its gate/up rows scaled
FAULT = "1:1:0:1.5"


def _has_expert_parallelism() -> bool:
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return "ep_size" in getattr(DistributedConfig, "__dataclass_fields__", {})


pytestmark = pytest.mark.skipif(not _has_expert_parallelism(), reason="this transformers has no expert "
                                "parallelism (DistributedConfig.ep_size)")


def _launch(model_dir: Path, out: Path, runs: list[str], nproc: int) -> None:
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), str(model_dir), str(out), *runs]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module", params=FAMILIES)
def dumps(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """model/ (the checkpoint), golden/ (one process), clean/ and fault/ (two ranks, one launch)."""
    from llmflow.models import build_tiny

    out = tmp_path_factory.mktemp(f"ep-{request.param}")
    build_tiny(request.param, "layers=3").save_pretrained(out / "model")
    _launch(out / "model", out, ["golden"], 1)
    _launch(out / "model", out, ["clean", f"fault={FAULT}"], 2)
    return out


def _bisect(tmp_path: Path, dumps: Path, target: str) -> tuple[int, str, dict]:
    run_dir = tmp_path / "run"
    proc = llmflow("run", "dump_bisect", "--run-dir", str(run_dir), "--progress", "plain",
                   "--set", f"golden_dump={dumps / 'golden'}", "--set", f"target_dump={dumps / target}",
                   "--set", f"golden_model={dumps / 'model'}", timeout=600)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    verdict = json.loads((run_dir / "bisect" / "verdict.json").read_text())
    return proc.returncode, proc.stdout.strip().splitlines()[-1], verdict


def test_each_rank_dumps_its_own_shards_of_the_dtensor_parameters(dumps: Path) -> None:
    import torch

    from llmflow.formats import open_dump
    from llmflow.models import load_model

    golden = dict(load_model(str(dumps / "model")).model.named_parameters())
    target = open_dump(str(dumps / "clean"))
    assert target.ranks() == [0, 1]
    weights = {(e.rank, e.name): e for e in target.entries() if e.kind == "weight"}
    for name, dim in [("model.layers.1.mlp.experts.gate_up_proj", 0),  # half the experts on each rank
                      ("model.layers.1.self_attn.q_proj.weight", 0)]:  # column-parallel: half the heads
        shards = [target.load(weights[(r, name)]) for r in (0, 1)]
        assert shards[0].shape[dim] == golden[name].shape[dim] // 2, (name, shards[0].shape)
        assert torch.equal(torch.cat(shards, dim=dim), golden[name].detach()), name


def test_a_clean_expert_parallel_port_passes(tmp_path: Path, dumps: Path) -> None:
    rc, last, verdict = _bisect(tmp_path, dumps, "clean")
    assert rc == 0 and last.startswith("PASSED"), last
    assert verdict["first_bad_module"] is None


def test_one_ranks_copy_of_an_expert_is_named_to_its_module_expert_and_rank(tmp_path: Path,
                                                                            dumps: Path) -> None:
    rc, last, verdict = _bisect(tmp_path, dumps, "fault")
    assert rc == 1 and last.startswith(
        "FAILED: model.layers.1.mlp.experts (expert 2, rank 1's shard) is the fault"), last
    assert verdict["first_bad_expert"] == 2 and verdict["first_bad_rank"] == 1
    assert "differs from its slice of the golden's weight in expert 2's rows" in verdict["diagnosis"]
