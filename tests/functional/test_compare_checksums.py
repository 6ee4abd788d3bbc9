"""Dumps taken with checksums ask for bitwise identity: msprobe's ``summary_mode: md5`` (a CRC-32 of
each tensor's bytes beside its statistics) and llmflow's own ``crc32``. A weight nudged by 1e-6 keeps
every statistic within tolerance, yet its CRC-32 differs from the layer it touches on: the compare
fails there (``checksum_differs``), two identical runs pass, and a pair where only one side has a
checksum is judged by its statistics. Each dump is made by the real tool from a user's script."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

REPO = Path(__file__).resolve().parents[2]
NUDGED = "model.layers.1.mlp.down_proj"
MSPROBE = """
import json, sys, torch
from llmflow.models import load_model
from msprobe.pytorch import PrecisionDebugger

for run, mode, nudge in (("same", "md5", False), ("again", "md5", False), ("nudged", "md5", True),
                         ("plain", "statistics", True)):
    model = load_model("tiny-llama:layers=2,hidden=64,seed=0").model.eval()
    if nudge:
        with torch.no_grad():
            model.get_parameter(sys.argv[1] + ".weight")[0, 0] += 1e-6
    cfg = {"task": "statistics", "dump_path": run, "rank": [], "step": [], "level": "mix", "seed": 1234,
           "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": mode}}
    json.dump(cfg, open("cfg.json", "w"))
    PrecisionDebugger._instance = None  # one debugger per configuration
    dbg = PrecisionDebugger(config_path="cfg.json")
    with torch.no_grad():
        dbg.start(model=model)
        model(torch.tensor([[1, 5, 7, 9]]), use_cache=False)
        dbg.stop()
        dbg.step()
"""
LLMFLOW = """
import sys, torch
from llmflow import DumpConfig, register_hook
from llmflow.models import build_tiny

model = build_tiny("qwen2", "layers=2,hidden=64")
if sys.argv[2] == "nudged":
    with torch.no_grad():
        model.get_parameter(sys.argv[3] + ".weight")[0, 0] += 1e-6
register_hook(model, DumpConfig(dump_path=sys.argv[1], data_mode="statistics", crc32=True))
model.generate(torch.tensor([[256, 104, 101, 108]]), max_new_tokens=2, do_sample=False, pad_token_id=258)
"""


def _script(folder: Path, text: str, *args: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.py").write_text(text, encoding="utf-8")
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=folder, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]


def _compare(golden: Path, target: Path, out: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    proc = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(golden), "-mp", str(target),
                           "-o", str(out), "--no-xlsx"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = json.loads((out / "compare_summary.json").read_text())
    return proc, rows


@pytest.fixture(scope="module")
def msprobe_dumps(tmp_path_factory) -> Path:
    pytest.importorskip("msprobe.pytorch", reason="mindstudio-probe is not installed")
    d = tmp_path_factory.mktemp("md5")
    _script(d, MSPROBE, NUDGED)
    return d


def test_msprobe_md5_dumps_of_the_same_run_pass(msprobe_dumps, tmp_path):
    proc, summary = _compare(msprobe_dumps / "same", msprobe_dumps / "again", tmp_path / "out")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("PASSED"), proc.stdout
    assert summary["codes"].get("checksum_differs", 0) == 0 and summary["counts"]["pass"] > 100, summary


def test_msprobe_md5_names_the_first_tensor_whose_bytes_differ(msprobe_dumps, tmp_path):
    proc, summary = _compare(msprobe_dumps / "same", msprobe_dumps / "nudged", tmp_path / "out")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("FAILED"), proc.stdout[-2000:]
    assert f"first: {NUDGED}" in last and "checksum_differs" in last, last
    assert summary["codes"]["checksum_differs"] == summary["counts"]["fail"], summary["codes"]
    rows = [r for table in sorted((tmp_path / "out").glob("*.csv"))
            for r in csv.DictReader(table.open(encoding="utf-8"))]
    failing = [r for r in rows if r["code"] == "checksum_differs"]
    # nothing before the nudged layer differs (layer 0, the embedding), and its statistics pass
    before = ("model.layers.0.", "model.embed_tokens")
    assert failing and all(not r["name"].startswith(before) for r in failing)
    assert all("CRC-32 differs (golden " in r["reason"] for r in failing), failing[0]


def test_a_checksum_on_one_side_only_is_judged_by_statistics(msprobe_dumps, tmp_path):
    proc, summary = _compare(msprobe_dumps / "same", msprobe_dumps / "plain", tmp_path / "out")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("PASSED"), proc.stdout


@pytest.mark.parametrize("target", ["again", "nudged"])
def test_llmflow_crc32_dumps_are_compared_bitwise(tmp_path, target):
    _script(tmp_path / "golden", LLMFLOW, "dump", "same", NUDGED)
    _script(tmp_path / "target", LLMFLOW, "dump", target, NUDGED)
    proc, summary = _compare(tmp_path / "golden" / "dump", tmp_path / "target" / "dump", tmp_path / "out")
    last = proc.stdout.strip().splitlines()[-1]
    if target == "again":
        assert proc.returncode == 0 and last.startswith("PASSED"), proc.stdout[-2000:]
    else:
        assert proc.returncode == 1 and f"first: {NUDGED}" in last and "checksum_differs" in last, last
