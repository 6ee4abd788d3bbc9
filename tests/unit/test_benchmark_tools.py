"""The benchmark scripts' own logic: the dump profile's split into parts, the goals per device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_dump  # noqa: E402
import profile_dump  # noqa: E402

from llmflow.models import load_model  # noqa: E402


def test_profile_parts_hold_the_dumps_own_work_and_add_up(tmp_path):
    lm = load_model("tiny-llama:layers=2,hidden=32,heads=2,kv_heads=1,intermediate=64,vocab=300")
    base, ours = profile_dump.profile_mode(lm, [5, 6, 7], 2, "statistics module", tmp_path, lambda: None)
    plain, dumped = profile_dump.own_times(base), profile_dump.own_times(ours)
    assert plain["capture"] == plain["writer"] == 0  # plain generation runs none of the dump's code
    assert dumped["capture"] > 0 and dumped["writer"] > 0
    assert sum(dumped.values()) == pytest.approx(ours.total_tt)
    assert profile_dump.part_of(("~", 0, "<method 'tolist' of 'torch._C.TensorBase' objects>")) \
        == "waits for the device"


@pytest.mark.parametrize(("device", "ratio", "said"), [
    ("cpu", 1.2, "statistics module: 1.20x (goal <= 1.1x: missed)"),
    ("cuda", 1.2, "statistics module: 1.20x (goal <= 1.3x: met)"),
])
def test_dump_goals_are_the_devices(capsys, device, ratio, said):
    rows = [{"tool": "llmflow", "mode": "statistics module", "ratio": ratio},
            {"tool": "llmflow", "mode": "tensor api", "ratio": 3.0}]
    bench_dump.print_goals(rows, device)
    lines = capsys.readouterr().out.split("\n")
    assert said in lines
    # API dumps have a goal on the CPU only
    assert ("tensor api: 3.00x (goal <= 2.0x: missed)" in lines) == (device == "cpu")
