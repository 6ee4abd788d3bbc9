"""A damaged tensor-parallel target (a rank folder lost or left empty, one rank's data file cut
short, by llmflow and by msprobe) against its one-device golden is inconclusive, naming what was
lost, never a shape-mismatch fault of a lone shard against the whole tensor; two tensor-parallel
dumps of different world sizes, and ``-r`` on a tensor-parallel target against a one-device
golden, are bad input in one line."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from tp_helpers import TP_SCRIPT, launch_tp  # noqa: E402
from workflow_helpers import REPO, llmflow  # noqa: E402

#: the fixture's tiny Llama with as many key/value heads as heads: four ranks each take one
MODEL = "layers=3,hidden=64,heads=4,kv_heads=4,intermediate=128"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """golden/ (one process), tp2/ (two ranks) and tp4/ (four ranks), clean, in module mode."""
    out = tmp_path_factory.mktemp("tp_damage")
    for name, nproc in (("golden", 1), ("tp2", 2), ("tp4", 4)):
        launch_tp(out, [name], nproc, options=("--model", MODEL))
    return out


def _dump(dumps: Path, name: str) -> Path:
    return dumps / name / "llmflow_dump"


def _copy(dumps: Path, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(_dump(dumps, name), tmp_path / f"{name}_copy"))


def _compare(golden: Path, target: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return llmflow("compare", "-gp", str(golden), "-mp", str(target), "-o", str(out), "--no-xlsx", *extra,
                   timeout=300)


def _inconclusive(proc: subprocess.CompletedProcess, *named: str) -> str:
    """The last line of an inconclusive compare (exit 3, a ``next:`` line, no fault claimed)."""
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1].startswith("INCONCLUSIVE"), lines[-1]
    assert any(line.startswith("next: ") for line in lines), proc.stdout[-3000:]
    assert "shape_mismatch" not in lines[-1] and "FAILED" not in proc.stdout
    for text in named:
        assert text in lines[-1], lines[-1]
    return lines[-1]


def _bad_input(proc: subprocess.CompletedProcess, *named: str) -> str:
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    for text in named:
        assert text in last, last
    return last


def test_the_clean_target_passes(tmp_path: Path, dumps: Path) -> None:
    proc = _compare(_dump(dumps, "golden"), _dump(dumps, "tp2"), tmp_path / "out")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_rank_folder_lost_is_damage_naming_the_rank(tmp_path: Path, dumps: Path) -> None:
    target = _copy(dumps, "tp2", tmp_path)
    shutil.rmtree(target / "rank1")
    assert json.loads((target / "rank0" / "rank.json").read_text())["world_size"] == 2
    _inconclusive(_compare(_dump(dumps, "golden"), target, tmp_path / "out"), "rank1", "rank 1")
    with open(tmp_path / "out" / "compare_module.csv", newline="", encoding="utf-8") as fh:
        codes = {row["code"] for row in csv.DictReader(fh)}
    assert "shape_mismatch" not in codes and "load_error" in codes, codes


def test_a_middle_rank_lost_of_four_is_damage_naming_it(tmp_path: Path, dumps: Path) -> None:
    target = _copy(dumps, "tp4", tmp_path)
    shutil.rmtree(target / "rank2")
    _inconclusive(_compare(_dump(dumps, "golden"), target, tmp_path / "out"), "rank2")


def test_an_empty_rank_folder_is_damage(tmp_path: Path, dumps: Path) -> None:
    target = _copy(dumps, "tp2", tmp_path)
    shutil.rmtree(target / "rank1")
    (target / "rank1").mkdir()
    _inconclusive(_compare(_dump(dumps, "golden"), target, tmp_path / "out"), "rank1")


def test_a_rank_data_file_cut_short_is_damage(tmp_path: Path, dumps: Path) -> None:
    target = _copy(dumps, "tp2", tmp_path)
    data = sorted((target / "rank1" / "data").glob("*.safetensors"))[-1]
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
    _inconclusive(_compare(_dump(dumps, "golden"), target, tmp_path / "out"), "truncated")


def test_different_world_sizes_are_bad_input_naming_both(tmp_path: Path, dumps: Path) -> None:
    for golden, target in (("tp2", "tp4"), ("tp4", "tp2")):
        proc = _compare(_dump(dumps, golden), _dump(dumps, target), tmp_path / f"{golden}_{target}")
        last = _bad_input(proc)
        assert f"world size {golden[2]}" in last and f"world size {target[2]}" in last, last


def test_one_rank_of_a_tensor_parallel_target_is_bad_input_saying_what_to_run(tmp_path: Path,
                                                                              dumps: Path) -> None:
    _bad_input(_compare(_dump(dumps, "golden"), _dump(dumps, "tp2"), tmp_path / "out", "-r", "0"),
               "-r 0", "without -r")


@pytest.fixture(scope="module")
def ms_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """msprobe's golden/ (one process) and tp2/ (two ranks), clean."""
    pytest.importorskip("msprobe.pytorch", reason="mindstudio-probe is not installed")
    out = tmp_path_factory.mktemp("tp_damage_msprobe")
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO), "OMP_NUM_THREADS": "1"}
    for name, nproc in (("golden", 1), ("tp2", 2)):
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd = [sys.executable, *(launcher if nproc > 1 else []), str(TP_SCRIPT), str(out), name, "--tool",
               "msprobe"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=out)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_msprobe_rank_folders_lost_are_damage_naming_the_rank(tmp_path: Path, ms_dumps: Path) -> None:
    """msprobe records no world size: the lone rank's tensors, slices of the golden's, say it."""
    target = Path(shutil.copytree(ms_dumps / "tp2", tmp_path / "tp2"))
    for step in target.glob("step*"):
        shutil.rmtree(step / "rank1")
    _inconclusive(_compare(ms_dumps / "golden", target, tmp_path / "out"), "rank 1")


def test_msprobe_tensor_file_cut_short_is_damage(tmp_path: Path, ms_dumps: Path) -> None:
    target = Path(shutil.copytree(ms_dumps / "tp2", tmp_path / "tp2"))
    pt = sorted((target / "step0" / "rank1" / "dump_tensor_data").glob("*mlp.gate_proj*output.0.pt"))[0]
    pt.write_bytes(pt.read_bytes()[:pt.stat().st_size // 2])
    _inconclusive(_compare(ms_dumps / "golden", target, tmp_path / "out"), "not whole", "cut short")
