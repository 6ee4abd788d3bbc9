"""The last line of ``llmflow compare`` counts tensor pairs, run the user's way (a subprocess): a
decoder layer's output is both a layer row and a module row, so the level CSVs' verdict columns
add up to more fails than there are failing pairs; the line says what it counts, and its numbers
are the distinct pairs of the CSVs."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_helpers import as_dump  # noqa: E402
from workflow_helpers import llmflow  # noqa: E402

PAIR_KEY = ("step", "target_step", "rank", "name", "target_name", "kind", "index")


def _csv_rows(out: Path) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for path in sorted(out.glob("compare_*.csv")):
        with open(path, newline="", encoding="utf-8") as fh:
            rows += list(csv.DictReader(fh))
    return rows


def test_the_failed_line_counts_tensor_pairs_not_csv_rows(tmp_path):
    as_dump(tmp_path, "gpu_dump")
    as_dump(tmp_path, "npu_dump", fault=lambda layer, x: x * 3 if layer == 1 else x)
    proc = llmflow("compare", "-gp", "gpu_dump", "-mp", "npu_dump", "-o", "out", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    fails, pairs = summary["counts"]["fail"], summary["pairs"]
    first = "first: model.layers.1 (step 0,"
    assert last.startswith(f"FAILED: {fails} of {pairs} tensor pairs fail; {first}"), last

    rows = _csv_rows(tmp_path / "out")
    failing_rows = [r for r in rows if r["verdict"] == "fail"]
    assert len(failing_rows) > fails  # the layer rows are module rows too: written twice
    assert len({tuple(r[k] for k in PAIR_KEY) for r in failing_rows}) == fails
    assert len({tuple(r[k] for k in PAIR_KEY) for r in rows}) == pairs


def test_the_passed_line_counts_tensor_pairs(tmp_path):
    as_dump(tmp_path, "gpu_dump", steps=[0])
    as_dump(tmp_path, "npu_dump", steps=[0])
    proc = llmflow("compare", "-gp", "gpu_dump", "-mp", "npu_dump", "-o", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pairs = json.loads((tmp_path / "out" / "compare_summary.json").read_text())["pairs"]
    assert proc.stdout.strip().splitlines()[-1] == f"PASSED ({pairs} tensor pairs, 0 warn, 0 unmatched)"
