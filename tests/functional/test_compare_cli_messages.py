"""What ``llmflow compare`` says, run the user's way (a subprocess): msit's ``--log-level`` values,
a prefill offset or warm-up that cannot be right, a statistics-only pass, a pickled ``.pt``, the
help of ``--no-xlsx`` and ``-w``, and a pass that left golden tensors uncompared."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import as_dump, model_items, write_dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def llmflow(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", *args], capture_output=True, text=True,
                          timeout=180, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO), "NO_COLOR": "1"})


def last(done: subprocess.CompletedProcess) -> str:
    return done.stdout.strip().splitlines()[-1]


def refused(done: subprocess.CompletedProcess) -> str:
    """The one line of a compare refused as bad input (exit 2): the last line, and stderr's only."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr
    line = last(done)
    (err,) = done.stderr.strip().splitlines()
    assert line.startswith("FAILED: ") and err == "error: " + line.removeprefix("FAILED: ")
    return line


@pytest.mark.parametrize("flag", ["--log-level", "-l"])
@pytest.mark.parametrize("level", ["fatal", "critical"])
def test_msit_log_levels_take_the_long_and_the_short_flag(tmp_path, flag, level):
    g, t = as_dump(tmp_path, "g", steps=[0], n_layers=1), as_dump(tmp_path, "t", steps=[0], n_layers=1)
    done = llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "out", flag, level, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "" and "golden: " not in done.stdout  # quieter than error: tables and verdict
    assert last(done).startswith("PASSED")


def test_a_prefill_offset_or_warmup_that_cannot_be_right_is_bad_input(tmp_path):
    steps = range(6)
    g, t = as_dump(tmp_path, "g", steps=steps, n_layers=1), as_dump(tmp_path, "t", steps=steps, n_layers=1)
    held = "the golden dump holds steps 0..5, the target dump steps 0..5"
    for offset in ("7", "5", "2"):  # every golden step on target step 0; three on it with a step each
        line = refused(llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "out", "--prefill-offset",
                               offset, cwd=tmp_path))
        assert line.startswith(f"FAILED: --prefill-offset {offset} (prefill_offset): ") and held in line
        assert not (tmp_path / "out").exists()
    line = refused(llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "out", "--warmup", "6",
                           cwd=tmp_path))
    assert line.startswith("FAILED: --warmup 6 (warmup): golden steps 0..5 would pair with target steps "
                           "6..11") and held in line
    # ATB's offset: its first folder holds the prefill and the first decode step, one folder fewer
    atb = as_dump(tmp_path, "atb", steps=range(5), n_layers=1)
    done = llmflow("compare", "-gp", str(g), "-mp", str(atb), "-o", "out", "--prefill-offset", "1",
                   cwd=tmp_path)
    assert done.returncode in (0, 1, 3) and "--prefill-offset" not in done.stdout, done.stdout + done.stderr


def test_a_statistics_only_pass_says_statistics_can_hide_a_fault(tmp_path):
    # the last layer's output reversed along the hidden size: its statistics stay, its values do not
    def fault(layer: int, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1) if layer == 1 else x

    g = as_dump(tmp_path, "g", steps=[0], n_layers=2, logits=False)
    t = as_dump(tmp_path, "t", steps=[0], n_layers=2, logits=False, fault=fault)
    tensors = llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "a", cwd=tmp_path)
    assert tensors.returncode == 1 and last(tensors).startswith("FAILED: "), tensors.stdout + tensors.stderr
    stats = llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "b", "-st", cwd=tmp_path)
    assert stats.returncode == 0, stats.stdout + stats.stderr
    assert re.fullmatch(r"PASSED \(statistics only: 7 tensor pairs, \d+ warn, 0 unmatched; statistics can "
                        r"hide a fault the tensors show: compare without -st\)", last(stats)), last(stats)


class _Marker:
    """Unpickled, it would create the file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_pt_is_one_line_and_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    torch.save({"w": torch.ones(4, 4), "b": torch.zeros(4)}, tmp_path / "a.pt")
    torch.save({"w": torch.ones(4, 4), "x": _Marker(str(marker))}, tmp_path / "objects.pt")
    (tmp_path / "plain.pt").write_bytes(pickle.dumps(_Marker(str(marker)), protocol=4))
    for name in ("objects.pt", "plain.pt"):
        done = llmflow("compare", "-gp", "a.pt", "-mp", name, cwd=tmp_path)
        line = refused(done)
        assert done.stdout.strip() == line  # nothing else: no table, no torch warning
        assert line.startswith(f"FAILED: {name}: ") and "weights_only set to False" not in line
        assert line.endswith("llmflow never unpickles a file (torch.load weights_only=True): save tensors "
                             "with safetensors, or torch.save of tensors alone")
    assert refused(llmflow("compare", "-gp", "objects.pt", "-mp", "a.pt", cwd=tmp_path)).startswith(
        "FAILED: objects.pt: holds pickled Python objects besides tensors (")
    assert not marker.exists()


def test_help_says_what_no_xlsx_and_w_do(tmp_path):
    done = llmflow("compare", "--help", cwd=tmp_path)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "--no-xlsx compare.xlsx (a sheet per level) beside the CSVs, written unless this is false: " \
           "--no-xlsx skips it (CSVs only)." in text
    assert "--weight [WEIGHTS] msit's weight compare: not done here; prints the weight_check workflow " \
           "command that compares two checkpoints and exits 2" in text
    assert "runs it as the weight_check workflow" not in text


def test_a_pass_that_left_golden_inputs_out_says_how_many_were_compared(tmp_path):
    outputs = model_items(n_layers=2, logits=False)
    # the golden dumps each module's input before its output; the target its outputs only
    with_inputs = [item for n, k, i, lv, mt, x in outputs for item in
                   ((n, "input", "0", lv, mt, x * 0.5), (n, k, i, lv, mt, x))]
    g = write_dump(tmp_path / "g", {0: with_inputs})
    t = write_dump(tmp_path / "t", {0: outputs})
    done = llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert last(done) == "PASSED (7 of 14 golden tensors compared, 0 warn; 7 golden inputs the target did " \
                         "not dump)"
    # the other way round: the target's inputs have no golden partner
    done = llmflow("compare", "-gp", str(t), "-mp", str(g), "-o", "back", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert last(done) == "PASSED (7 tensor pairs, 0 warn; 7 target tensors with no golden partner)"
