"""A compare of many chunks runs them in threads: ``llmflow compare --workers N``, run the user's
way, writes the same CSV bytes and verdict at every N, a dump reader is never called from two
threads at once, and SIGTERM ends the compare after the pairs in progress, not their chunks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from path_helpers import checkout_path

from llmflow.compare.run import CompareOptions, compare_dumps
from llmflow.formats.base import Entry
from llmflow.formats.llmflow_dump import DumpDirWriter, LlmflowDumpReader

REPO = Path(__file__).resolve().parents[2]
# 150 small pairs (more than one chunk of CHUNK_PAIRS), tensors of two kernel rows and a tail,
# bf16 and integer pairs; one layer of the target is off
SIZES = [576] * 150 + [2 * (1 << 16) + 13] * 3 + [1001]


def layer_entry(step: int, i: int, x: torch.Tensor) -> Entry:
    """The index entry of tensor ``x`` as decoder layer ``i``'s output, stored under key ``i``."""
    return Entry(step=step, rank=0, name=f"model.layers.{i}", kind="output", index="0", level="module",
                 order=i, dtype=str(x.dtype).removeprefix("torch."), shape=tuple(x.shape),
                 module_type="LlamaDecoderLayer", key=str(i))


def write_dump(path: Path, noise: float, fault_at: int | None = None) -> None:
    writer = DumpDirWriter(path, meta={"data_mode": "tensor"})
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        tensors, entries = {}, []
        for i, n in enumerate(SIZES):
            x = torch.randn(n, generator=torch.Generator().manual_seed(step * 1000 + i))
            x = x * (1 + noise * torch.randn(n, generator=gen))
            if i == fault_at:
                x = x * 2
            x = x.to(torch.bfloat16) if i % 7 == 3 else torch.arange(n) if i % 11 == 5 else x
            tensors[str(i)] = x
            entries.append(layer_entry(step, i, x))
        writer.write_batch(tensors, entries)
    writer.close()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("threads")
    write_dump(tmp / "g", 0.0)
    write_dump(tmp / "t", 1e-3, fault_at=40)
    return tmp


def compare_cli(tmp: Path, out: str, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, bytes]]:
    done = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(tmp / "g"), "-mp",
                           str(tmp / "t"), "-o", str(tmp / out), "--no-xlsx", *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO), "NO_COLOR": "1"})
    return done, {p.name: p.read_bytes() for p in sorted((tmp / out).glob("*.csv"))}


def test_every_worker_count_writes_the_same_csv(dumps: Path) -> None:
    one, one_csv = compare_cli(dumps, "w1", "--workers", "1")
    assert one.returncode == 1, one.stderr  # the faulty layer fails its rows
    assert one.stdout.strip().splitlines()[-1].startswith("FAILED")
    assert one_csv and b"model.layers.40," in one_csv["compare_module.csv"]
    for workers in ("2", "4"):
        many, many_csv = compare_cli(dumps, f"w{workers}", "--workers", workers)
        assert many.returncode == one.returncode, many.stderr
        assert many.stdout.strip().splitlines()[-1] == one.stdout.strip().splitlines()[-1]
        assert many_csv == one_csv


def write_eager_dump(path: Path, noise: float) -> None:
    """Pairs whose rows eager torch computes: NaN and Inf among float32 elements, float64
    tensors, integer tensors equal element for element; each longer than torch's grain size
    (32,768 elements), where torch's own sums split the work among its threads."""
    writer = DumpDirWriter(path, meta={"data_mode": "tensor"})
    gen = torch.Generator().manual_seed(5)
    tensors, entries = {}, []
    for i, n in enumerate([(1 << 16) + 3, 200_003, 100_000, 300_001]):
        x = torch.randn(n, generator=torch.Generator().manual_seed(i)) * 3
        x = x * (1 + noise * torch.randn(n, generator=gen))
        if i == 0:
            x[11], x[n - 2] = float("nan"), float("inf")
        x = x.double() if i == 1 else torch.arange(n) % 977 if i == 2 else x
        tensors[str(i)] = x
        entries.append(layer_entry(0, i, x))
    writer.write_batch(tensors, entries)
    writer.close()


def test_rows_eager_torch_computes_do_not_depend_on_the_thread_count(tmp_path: Path) -> None:
    """The same dumps compared with torch on 1 thread and on 4, at 1, 2 and 4 workers: the same
    CSV bytes, NaN and Inf rows, float64 and integer rows included."""
    write_eager_dump(tmp_path / "g", 0.0)
    write_eager_dump(tmp_path / "t", 1e-4)
    runs = {}
    for threads, workers in (("1", "1"), ("4", "1"), ("4", "2"), ("4", "4")):
        out = tmp_path / f"t{threads}w{workers}"
        done = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(tmp_path / "g"), "-mp",
                               str(tmp_path / "t"), "-o", str(out), "--no-xlsx", "--workers", workers],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": checkout_path(REPO), "NO_COLOR": "1",
                                   "OMP_NUM_THREADS": threads})
        assert done.returncode in (0, 1), done.stderr
        runs[threads, workers] = {p.name: p.read_bytes() for p in sorted(out.glob("*.csv"))}
    first = runs["1", "1"]
    assert first and b"model.layers.3," in first["compare_module.csv"]
    for key, csv in runs.items():
        assert csv == first, key


class OneAtATime(LlmflowDumpReader):
    """An llmflow dump reader that records how many threads were inside ``load`` at once."""

    inside = 0
    most = 0
    threads: set[str] = set()
    lock = threading.Lock()

    def load(self, entry: Entry) -> torch.Tensor:
        cls = OneAtATime
        with cls.lock:
            cls.inside += 1
            cls.most = max(cls.most, cls.inside)
            cls.threads.add(threading.current_thread().name)
        try:
            time.sleep(0.0005)  # long enough for a second thread to come in, were it let
            return super().load(entry)
        finally:
            with cls.lock:
                cls.inside -= 1


def test_a_reader_is_never_called_from_two_threads_at_once(dumps: Path, tmp_path: Path) -> None:
    base = compare_dumps(LlmflowDumpReader(dumps / "g"), LlmflowDumpReader(dumps / "t"), tmp_path / "one",
                         CompareOptions(workers=1, xlsx=False))
    res = compare_dumps(OneAtATime(dumps / "g"), OneAtATime(dumps / "t"), tmp_path / "four",
                        CompareOptions(workers=4, xlsx=False))
    assert OneAtATime.most == 1
    assert len({n for n in OneAtATime.threads if n.startswith("llmflow-compare")}) > 1  # it did run threads
    assert res["summary"].pairs == base["summary"].pairs == 2 * len(SIZES)
    for level, path in base["csv"].items():
        assert Path(res["csv"][level]).read_bytes() == Path(path).read_bytes()


# a custom algorithm that takes 0.3 s a pair, and says when it first ran
SLOW_ALG = """import os, time
def slow(golden, target):
    open(os.environ["SLOW_STARTED"], "a").close()
    time.sleep(0.3)
    return 0.0, ""
"""


def test_sigterm_ends_a_threaded_compare_after_the_pairs_in_progress(dumps: Path, tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text(SLOW_ALG)
    started = tmp_path / "started"
    args = ["compare", "-gp", str(dumps / "g"), "-mp", str(dumps / "t"), "-o", str(tmp_path / "out"),
            "--no-xlsx", "-alg", "slow.py:slow", "--workers", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "llmflow", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": checkout_path(REPO), "NO_COLOR": "1",
                                 "SLOW_STARTED": str(started)})
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the compare never reached its pairs"
            time.sleep(0.05)
        time.sleep(0.5)  # both threads inside their first chunk (64 pairs: 19 s of the slow algorithm)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 10  # a pair or so, not the rest of a chunk (18 s)
    assert proc.returncode == 143, (stdout, stderr)
    assert stdout.strip().splitlines()[-1] == "FAILED: terminated (SIGTERM)" and "Traceback" not in stderr
