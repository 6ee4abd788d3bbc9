"""Python operators in a user's model as `llmflow run api_precheck` meets them: ``1 - x`` calls
``x.__rsub__(1)``, whose recorded arguments are those of ``x - 1``; the dump names it ``rsub`` (and
``2 / x`` ``rdiv``, ``2 ** x`` ``rpow``...) so that the precheck replays what was computed. Correct
operators pass whichever side the number is on; a port that subtracts the wrong way round fails
on that call. Factories given empty sequences (``torch.tensor([])``, ``torch.zeros(())``) are
replayed too: the dump records an empty sequence as a value of its own."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmflow.operators import operator_name, tensor_method

TESTS = Path(__file__).resolve().parents[1]
FAULTS = TESTS / "precheck_faults.py"


def run_precheck(tmp: Path, patch: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", "run", "api_precheck", "--run-dir",
                           str(tmp / "run"), "--progress", "plain", "--set", f"model={FAULTS}:operator_model",
                           "--set", f"patch={patch}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp)


def rows(tmp: Path) -> dict[str, dict[str, str]]:
    with open(tmp / "run" / "precheck" / "precheck.csv", newline="", encoding="utf-8") as f:
        return {r["name"]: r for r in csv.DictReader(f) if r["step"] == "0"}


def test_operators_with_a_number_on_either_side_and_empty_factories_pass(tmp_path):
    proc = run_precheck(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    got = rows(tmp_path)
    expected = {"/rsub.0": "torch.rsub", "/rdiv.0": "Tensor.__rtruediv__", "/rpow.0": "Tensor.__rpow__",
                "/rfloordiv.0": "Tensor.__rfloordiv__", "/rmod.0": "Tensor.__rmod__",
                "/floordiv.0": "Tensor.__floordiv__", "/remainder.0": "torch.remainder",
                "/and.0": "Tensor.__and__", "/zeros.0": "torch.zeros", "/tensor.0": "torch.tensor"}
    for name, implementation in expected.items():
        assert got[name]["status"] == "pass", (name, got[name])
        assert got[name]["implementation"] == implementation, (name, got[name])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["precheck"]
    assert summary["totals"]["calls"] == summary["totals"]["pass"], summary["totals"]


def test_a_port_that_subtracts_the_wrong_way_round_fails_on_that_call(tmp_path):
    proc = run_precheck(tmp_path, f"{FAULTS}:reversed_rsub")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED") and "first /rsub.1 (step 0)" in last, last
    got = rows(tmp_path)
    assert got["/rsub.1"]["status"] == "fail" and got["/rsub.0"]["status"] == "pass"


@pytest.mark.parametrize(("dunder", "name", "method"), [
    ("__add__", "add", None), ("__radd__", "add", None), ("__iadd__", "add_", "__iadd__"),
    ("__rsub__", "rsub", "__rsub__"), ("__rtruediv__", "rdiv", "__rtruediv__"),
    ("__truediv__", "div", "__truediv__"), ("__rpow__", "rpow", "__rpow__"),
    ("__rmatmul__", "rmatmul", "__rmatmul__"), ("__rand__", "and", "__and__"),
    ("__rshift__", "rshift", "__rshift__"), ("__rrshift__", "rrshift", "__rrshift__"),
    ("__invert__", "bitwise_not", None), ("__lt__", "lt", None), ("__getitem__", None, None),
    ("__reduce__", None, None), ("matmul", None, None)])
def test_operator_names_and_the_methods_that_replay_them(dunder, name, method):
    assert operator_name(dunder) == name
    if name is not None and method is not None:
        assert tensor_method(name) == method
