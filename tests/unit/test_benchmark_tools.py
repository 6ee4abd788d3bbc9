"""The benchmark scripts' own logic: the dump profile's split into parts, the goals per device,
the compare kernel timed against another source tree's, the dump's counts split at markers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_compare  # noqa: E402
import bench_dump  # noqa: E402
import count_dump  # noqa: E402
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


def test_the_api_floor_runs_generation_inside_api_mode_and_records_nothing(tmp_path, capsys):
    """``--api-floor``: a row timed inside the mode an API dump enters, without a dump (no files,
    no entries, no goal line), beside the dump it is the floor of."""
    lm = load_model("tiny-llama:layers=2,hidden=32,heads=2,kv_heads=1,intermediate=64,vocab=300")
    rows = bench_dump.bench_llmflow(lm, [5, 6, 7], 2, 1, tmp_path, modes=("statistics api",), api_floor=True)
    floor = next(r for r in rows if r["mode"] == bench_dump.FLOOR)
    assert floor["ratio"] > 0 and "entries" not in floor
    assert sorted(p.name for p in tmp_path.iterdir()) == ["statistics_api"]
    bench_dump.print_goals(rows)
    assert bench_dump.FLOOR not in capsys.readouterr().out
    calls = []
    with_mode = bench_dump._NothingRecorded()
    from llmflow.dump.api import ApiMode

    with ApiMode(with_mode):
        calls.append(torch.ones(2) + 1)  # passed on: computed, nothing counted
    assert calls[0].tolist() == [2.0, 2.0] and with_mode.op_counts == {} and with_mode.stack == []


def test_kernel_against_an_old_tree_times_both_builds_and_checks_the_bits(tmp_path):
    from llmflow import native
    from llmflow.compare import kernels

    if native.disabled() or kernels.fused() is None:
        pytest.skip("no compiled compare kernel here")
    old = tmp_path / "old"
    (old / "llmflow" / "compare").mkdir(parents=True)
    source = (REPO / "llmflow" / "compare" / "pass1.cpp").read_text()
    (old / "llmflow" / "compare" / "pass1.cpp").write_text(source + "\n// another tree\n")
    target = native.supported_targets()[0]
    report = bench_compare.kernel_ab(old, [target], repeat=2, elements=(1 << 17) + 5)
    for case in ("fp32", "bf16", "fp32_vs_bf16"):
        row = report[target.name][case]
        assert row["same_bits"] and row["old_ms"] > 0 and row["new_ms"] > 0
    swapped = bench_compare.kernels_of(old, target)
    assert [k.label for k in swapped] == ["new", "old"]
    before = kernels._fused
    with swapped[1]:
        assert kernels._fused is not before
    assert kernels._fused is before
    with pytest.raises(SystemExit, match="does not exist"):
        bench_compare.kernel_entry(tmp_path / "nowhere", target)


def test_capture_replay_under_eviction_times_the_calls_and_not_the_sweeps():
    """``bench_capture.py --evict``: every replayed call follows a read of that much memory, and a
    step's time holds the calls and the step's ends only. With 64 MB read before each of a step's
    dozens of calls (milliseconds each), a step that counted the reads would take seconds."""
    import json
    import subprocess
    import time

    import torch

    sweep = torch.ones(64 * 2**20 // 4)

    def read_time() -> float:
        t0 = time.perf_counter()
        sweep.sum()
        return time.perf_counter() - t0

    before = read_time()
    model = "tiny-llama:layers=2,hidden=32,heads=2,kv_heads=1,intermediate=64,vocab=300"
    worker = [sys.executable, str(REPO / "benchmarks" / "bench_capture.py"), "--worker", model, "1",
              "statistics", "64"]
    proc = subprocess.run(worker, capture_output=True, text=True, check=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("CAPTURE_RESULT "))
    steps = json.loads(line.split(" ", 1)[1])
    # (a read timed before and after the worker: a machine busy with other work slows both alike)
    one_read = max(before, read_time())
    assert set(steps) == {"module", "api"}
    for times in steps.values():
        assert len(times) == 3 and all(t > 0 for t in times)
        assert sorted(times)[1] < 10 * one_read, (times, one_read)  # a step has far more than 10 calls


@pytest.mark.skipif(__import__("shutil").which("valgrind") is None, reason="valgrind is not installed here")
def test_callgrind_writes_a_profile_at_each_marker_and_the_counts_are_read(tmp_path):
    """``count_dump.py`` counts the plain run and the dump between calls of ``os.getppid``: under
    callgrind with the script's ``--dump-before`` pattern each call closes a profile, and the
    profile between two calls holds what ran between them (a loop of a million steps here)."""
    import subprocess

    snippet = "import os\nos.getppid()\nfor _ in range({n}): pass\nos.getppid()\n"
    counted = {}
    for n in (10, 1_000_000):
        out = tmp_path / f"run{n}"
        out.mkdir()
        subprocess.run(["valgrind", "--tool=callgrind", f"--dump-before={count_dump.MARKER}",
                        f"--callgrind-out-file={out}/callgrind.out", sys.executable, "-c",
                        snippet.format(n=n)], capture_output=True, text=True, check=True, timeout=300)
        assert (out / "callgrind.out.1").is_file() and (out / "callgrind.out.2").is_file()
        counted[n] = count_dump.read_counts(out / "callgrind.out.2")["Ir"]
    assert counted[1_000_000] > 1_000_000 > 100 * counted[10] > 0, counted


@pytest.mark.parametrize("data_mode", ["statistics", "tensor"])
def test_the_counted_driver_runs_a_plain_generation_and_a_dump(tmp_path, data_mode):
    """The process ``count_dump.py`` runs under callgrind works without it: both runs, markers
    between them, nothing left behind in the working directory."""
    import subprocess

    model = "tiny-llama:layers=2,hidden=32,heads=2,kv_heads=1,intermediate=64,vocab=300"
    driver = [sys.executable, str(REPO / "benchmarks" / "count_dump.py"), "--drive", "api", model, "2",
              data_mode]
    proc = subprocess.run(driver, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
