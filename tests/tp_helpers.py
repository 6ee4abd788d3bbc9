"""A tensor-parallel target dumped as a user dumps it: tests/fixtures/tp_llama.py under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from path_helpers import checkout_path

REPO = Path(__file__).resolve().parents[1]
TP_SCRIPT = REPO / "tests" / "fixtures" / "tp_llama.py"
#: the unsharded model of the fixture, as a model spec the bisect loads as its golden
TP_GOLDEN_MODEL = f"{TP_SCRIPT}:golden_model"
#: one faulty shard per kind of parallel linear (NAME=RANK:PARAM:FACTOR, as tp_llama.py takes them),
#: and a row-parallel linear whose all-reduce is left out (NAME=noreduce[-decode]:MODULE)
TP_FAULTS = {
    "mlp_rank1": "1:model.layers.1.mlp.up_proj.weight:1.5",  # column-parallel, MLP, rank 1
    "attn_rank0": "0:model.layers.2.self_attn.k_proj.weight:1.5",  # column-parallel, attention, rank 0
    "row_rank1": "1:model.layers.0.mlp.down_proj.weight:1.5",  # row-parallel: summed by the all-reduce
    "no_reduce": "noreduce:model.layers.1.self_attn.o_proj",  # every rank keeps its partial product
    "no_reduce_decode": "noreduce-decode:model.layers.1.self_attn.o_proj",  # at the decode steps only
}


def launch_tp(out: Path, runs: list[str], nproc: int, mode: str = "module", options: tuple[str, ...] = ()
              ) -> None:
    """One launch of tp_llama.py (``nproc`` > 1: under torchrun, gloo), each of ``runs`` dumped to
    ``out/NAME``; ``options``: more of its flags (``--reduce after-mlp``)."""
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(TP_SCRIPT), str(out), *runs, "--mode", mode, *options]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
