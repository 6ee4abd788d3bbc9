"""Two dumps of the same clean run whose ranks differ (a rank-1 process against a one-process
golden, as a user passes them): ``-r`` naming a rank one side lacks is bad input naming what each
side holds, and a compare of the whole dumps says the ranks differ, never that the dumps "name
their tensors differently" when the names are the same."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from llmflow.dump import DumpConfig, dump_run
from llmflow.models import encode_prompt, load_model

lm = load_model("tiny-llama:layers=2,hidden=32,intermediate=64,seed=3")
dump_run(lm, encode_prompt(lm.tokenizer, "hello"), 2, DumpConfig(dump_path=sys.argv[1], token_range="all"))
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    (out / "dump.py").write_text(SCRIPT, encoding="utf-8")
    for name, rank in (("golden", "0"), ("target", "1")):
        env = {**os.environ, "PYTHONPATH": checkout_path(REPO), "RANK": rank}
        proc = subprocess.run([sys.executable, str(out / "dump.py"), str(out / name)], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _compare(dumps: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(dumps / "golden"), "-mp",
                           str(dumps / "target"), "-o", str(out), "--no-xlsx", *extra],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})


def test_a_rank_one_side_lacks_is_bad_input(tmp_path, dumps):
    proc = _compare(dumps, tmp_path / "out", "-r", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "-r 1: the golden dump holds rank 0" in proc.stdout.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr


def test_different_ranks_are_named_as_the_cause(tmp_path, dumps):
    proc = _compare(dumps, tmp_path / "out")
    # (1, or 3 where the rank-1 dump, written without its rank 0, reads as never completed)
    assert proc.returncode in (1, 3), proc.stdout + proc.stderr
    assert "the dumps hold different ranks (golden rank 0, target rank 1)" in proc.stdout, proc.stdout
    assert "name their tensors differently" not in proc.stdout


def test_a_golden_rank_the_target_lacks_is_named_and_never_passes(tmp_path, dumps):
    """A golden of two ranks against a target of one of them: the other rank's rows are said to be
    missing as a rank (not as layers the target "stops short" of, nor as different naming), and the
    compare is incomplete even though every row of the rank both hold paired and passes."""
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
    for rank in ("0", "1"):
        proc = subprocess.run([sys.executable, str(dumps / "dump.py"), str(tmp_path / "golden")],
                              capture_output=True, text=True, timeout=300, env={**env, "RANK": rank})
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(tmp_path / "golden"), "-mp",
                           str(dumps / "target"), "-o", str(tmp_path / "out"), "--no-xlsx"],
                          capture_output=True, text=True, timeout=300, env=env)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode in (1, 3) and last.startswith(("FAILED", "INCONCLUSIVE")), proc.stdout
    assert "the target holds no rank 0 (golden rank 0..1, target rank 1): compare a rank both hold (-r 1)" \
        in proc.stdout, proc.stdout
    assert "name their tensors differently" not in proc.stdout and "layers" not in last, last
