"""msit's flags of ``llmflow compare``, run the user's way (a subprocess): ``-w`` points to the
weight_check workflow, a level the dumps have no rows of says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import as_dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def llmflow(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"})


def test_w_points_to_the_weight_check_workflow(tmp_path):
    for args in (["-w"], ["-gp", "a", "-mp", "b", "-w", "weights.safetensors"]):
        done = llmflow("compare", *args, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        (err,) = done.stderr.strip().splitlines()
        assert err.startswith("error: -w: weights are compared by the weight_check workflow: llmflow run "
                              "weight_check --set golden=")
        assert done.stdout.strip().splitlines()[-1] == "FAILED: -w: run the weight_check workflow"


def test_a_level_without_rows_says_so(tmp_path):
    g, t = as_dump(tmp_path, "g", steps=[0]), as_dump(tmp_path, "t", steps=[0])
    done = llmflow("compare", "-gp", str(g), "-mp", str(t), "-cl", "api", "-o", "out", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("error: compare: level api: the golden dump and the target dump have no "
                                   "api rows (only logits, layer, module)")
    assert not (tmp_path / "out").exists()
    # with a level that has rows, the compare runs and the empty one gets its line
    done = llmflow("compare", "-gp", str(g), "-mp", str(t), "-cl", "layer", "api", "-o", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "level api: the golden dump and the target dump have no api rows (only logits, layer, module)" \
        in done.stdout.splitlines()
