"""``llmflow compare`` on real msprobe dumps (mindstudio-probe from PyPI, on CPU) of a tiny seeded
Llama: tasks tensor and statistics at levels L0, L1 and mix, in two layouts (one step folder per
token in a ``proc{pid}`` folder; two ranks, all tokens in one step folder split by the reader).
A golden against a bit-identical rerun passes; a target with one weight scaled fails first at
that module; a ``generate()`` dump reads as one step per new token at every level."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

pytest.importorskip("msprobe.pytorch", reason="mindstudio-probe is not installed (optional: "
                                              "pip install mindstudio-probe)")

from llmflow.compare.run import CompareOptions, compare_dumps  # noqa: E402
from llmflow.formats import open_dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LEVELS, TASKS, LAYOUTS = ("L0", "L1", "mix"), ("tensor", "statistics"), ("steps", "ranks")
BAD_MODULE = "model.layers.1.mlp.down_proj"
# the down_proj linear of layer 1 at L1: q k v o gate up down per layer, so the 14th linear call
BAD_API = "/linear.13"
SCRIPT = """
import json, os, sys, torch
import torch.distributed as dist
from llmflow.models import load_model
from msprobe.pytorch import PrecisionDebugger

LEVELS, TASKS, TOKENS = ("mix", "L0", "L1"), ("tensor", "statistics"), 2


def debugger(path, level, task):
    cfg = {"task": task, "dump_path": path, "rank": [], "step": [], "level": level, "seed": 1234,
           task: {"scope": [], "list": [], "data_mode": ["all"]}}
    config = f"config{os.getpid()}.json"  # one per process: the ranks write theirs side by side
    with open(config, "w") as f:
        json.dump(cfg, f)
    PrecisionDebugger._instance = None  # one debugger per configuration
    return PrecisionDebugger(config_path=config)


def model(bad=False):
    # a fresh model each time: msprobe's module hooks stay on a model it has seen
    m = load_model("tiny-llama:layers=2,hidden=64,seed=0").model.eval()
    if bad:
        with torch.no_grad():
            m.get_parameter(sys.argv[1] + ".weight").mul_(1.25)
    return m


def greedy(path, level, task, bad, per_step):
    m, dbg = model(bad), debugger(path, level, task)
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        if not per_step:
            dbg.start(model=m)
        for _ in range(TOKENS):
            if per_step:
                dbg.start(model=m)
            logits = m(ids, use_cache=False).logits
            if per_step:
                dbg.stop()
                dbg.step()
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
        if not per_step:
            dbg.stop()


def runs(layout, per_step):
    for level in LEVELS:
        for task in TASKS:
            for run in ("golden", "rerun", "bad"):
                greedy(f"{layout}/{level}_{task}_{run}", level, task, run == "bad", per_step)


def one_rank(rank, world):
    dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rendezvous"), rank=rank,
                            world_size=world)
    runs("ranks", per_step=False)
    dist.destroy_process_group()


def steps_layout(_):
    runs("steps", per_step=True)


if __name__ == "__main__":
    # msprobe keeps API and module hook state across the debuggers of one process (an L1
    # debugger records a later debugger's API calls too): the generate() dumps come first, L1
    # last among them, the layouts in fresh processes, mix first among them
    for level in ("L0", "mix", "L1"):
        m, dbg = model(), debugger(f"generate/{level}", level, "statistics")
        with torch.no_grad():
            dbg.start(model=m)
            m.generate(torch.tensor([[1, 5, 7, 9]]), max_new_tokens=4, do_sample=False)
            dbg.stop()
    torch.multiprocessing.spawn(steps_layout, nprocs=1)
    torch.multiprocessing.spawn(one_rank, args=(2,), nprocs=2)
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("msprobe_runs")
    (d / "run.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "run.py", BAD_MODULE], cwd=d, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


def _cli_compare(golden: Path, target: Path, out: Path) -> subprocess.CompletedProcess:
    args = ["compare", "-gp", str(golden), "-mp", str(target), "-o", str(out)]
    return subprocess.run([sys.executable, "-m", "llmflow.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": checkout_path(REPO)})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("task", TASKS)
def test_golden_passes_and_a_scaled_weight_fails_first_at_its_module(
        dumps: Path, tmp_path: Path, layout: str, level: str, task: str) -> None:
    golden = dumps / layout / f"{level}_{task}_golden"
    reader = open_dump(golden)
    assert reader.steps() == [0, 1] and reader.ranks() == ([0, 1] if layout == "ranks" else [0])
    if task == "statistics":  # integer (null mean and norm) and bool (JSON true/false) values are rows
        dtypes = {e.dtype for e in reader.entries() if e.step >= 0 and e.stats}
        assert "int64" in dtypes and (level == "L0" or "bool" in dtypes)

    proc = _cli_compare(golden, dumps / layout / f"{level}_{task}_rerun", tmp_path / "same")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED")
    summary = json.loads((tmp_path / "same" / "compare_summary.json").read_text())
    assert summary["counts"]["fail"] == summary["counts"]["unmatched"] == summary["counts"]["warn"] == 0

    res = compare_dumps(golden, dumps / layout / f"{level}_{task}_bad", tmp_path / "bad",
                        CompareOptions(workers=1, xlsx=False))
    levels = res["summary"].levels
    assert res["summary"].verdict == "fail"
    first = {lv: (s.first_fail.name, s.first_fail.step) if s.first_fail else None for lv, s in levels.items()}
    if level in ("L0", "mix"):
        assert first["module"] == (BAD_MODULE, 0)
    if level == "L1":
        assert first["api"] == (BAD_API, 0)
    if level == "mix":
        assert first["api"][0] == f"{BAD_MODULE}/linear.0"


@pytest.mark.parametrize("level", LEVELS)
def test_generate_dump_reads_as_one_step_per_new_token(dumps: Path, level: str) -> None:
    reader = open_dump(dumps / "generate" / level)
    assert reader.steps() == [0, 1, 2, 3]
    # each step holds one forward pass: the embedding once, the head once
    for step in reader.steps():
        names = {e.name for e in reader.entries() if e.step == step}
        if level == "L0":
            assert {"model.embed_tokens", "lm_head"} <= names
        else:
            embeddings = [n for n in names if n.endswith("/embedding.0")]
            assert len(embeddings) == 1 and not any(n.endswith("/embedding.1") for n in names)
            # the prompt's 4 tokens at step 0, then one new token per step
            e = next(e for e in reader.entries() if e.step == step and e.name == embeddings[0]
                     and e.kind == "output")
            assert e.shape[1] == (4 if step == 0 else 1)
