"""``executor: dask`` against a real cluster: a ``dask scheduler`` and two ``dask worker`` processes
over TCP on the loopback, driven by ``llmflow compare`` and the shipped ``compare_dumps`` workflow.

The rows must be those of the local executor, a worker killed in the middle of a task must cost a
retry and nothing else, and a chunk whose workers keep dying ends the compare FAILED naming it,
never with a silent gap in the rows.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from path_helpers import checkout_path

pytest.importorskip("distributed")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import as_dump  # noqa: E402
from workflow_helpers import REPO, llmflow  # noqa: E402

DASK = shutil.which("dask", path=str(Path(sys.executable).parent)) or shutil.which("dask")

# A compare algorithm that kills the worker process it runs in when the test asks it to:
# ``once`` in $LLMFLOW_TEST_DIE_DIR is taken (removed) by the first call, which then dies;
# ``always`` makes every call die. Without the variable (the local executor) it is harmless.
KILLER = '''
import os

def die_on_request(golden, target):
    where = os.environ.get("LLMFLOW_TEST_DIE_DIR")
    if where:
        if os.path.exists(os.path.join(where, "always")):
            os._exit(1)
        try:
            os.remove(os.path.join(where, "once"))
        except FileNotFoundError:
            pass
        else:
            os._exit(1)
    return float(golden.numel()), ""
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_workers(address: str, n: int, procs: tuple[subprocess.Popen, ...] = (),
                      logs: Path | None = None, timeout: float = 240) -> None:
    """Wait until the scheduler answers and ``n`` workers have joined it. On a loaded CI host the
    scheduler may take longer than one client's connect timeout to start answering, so the client
    is retried until the deadline; a process that exits meanwhile fails at once with its log."""
    from dask.distributed import Client

    deadline = time.monotonic() + timeout
    while True:
        for p, log in zip(procs, ["scheduler.log", "worker0.log", "worker1.log"], strict=False):
            if p.poll() is not None:
                tail = (logs / log).read_text(errors="replace")[-2000:] if logs else ""
                pytest.fail(f"dask {log.removesuffix('.log')} exited with {p.returncode}:\n{tail}")
        left = deadline - time.monotonic()
        try:
            with Client(address, timeout=f"{max(int(min(left, 60)), 5)}s") as client:
                client.wait_for_workers(n, timeout=max(left, 5))
            return
        except (OSError, TimeoutError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``tcp://127.0.0.1:PORT`` of a scheduler with two single-threaded workers (each under a nanny,
    which restarts it when it dies), and the folder the killer algorithm watches."""
    if DASK is None:
        pytest.skip("the dask command is not installed (pip install 'llmflow[dask]')")
    die_dir = tmp_path_factory.mktemp("die")
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO), "LLMFLOW_TEST_DIE_DIR": str(die_dir),
           # a chunk whose worker died twice is given up (the default, 3, only makes the test slower)
           "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "1"}
    logs = tmp_path_factory.mktemp("dask-logs")
    procs = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--no-dashboard"], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(logs / "scheduler.log", "wb"), start_new_session=True)]
    for i in range(2):
        procs.append(subprocess.Popen([DASK, "worker", address, "--nthreads", "1", "--no-dashboard",
                                       "--name", f"w{i}"], env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(logs / f"worker{i}.log", "wb"), start_new_session=True))
    try:
        _wait_for_workers(address, 2, tuple(procs), logs)
        yield address, die_dir
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def _rows(folder: Path) -> dict[str, list[dict[str, str]]]:
    out = {}
    for f in sorted(folder.glob("compare_*.csv")):
        with open(f, newline="", encoding="utf-8") as fh:
            out[f.name] = list(csv.DictReader(fh))
    return out


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("dumps")
    killer = tmp / "killer.py"
    killer.write_text(KILLER, encoding="utf-8")
    return as_dump(tmp, "golden"), as_dump(tmp, "target", noise=1e-3), killer


def _compare(tmp: Path, name: str, golden: Path, target: Path, *extra: str) -> tuple[object, Path]:
    out = tmp / name
    proc = llmflow("compare", "-gp", str(golden), "-mp", str(target), "-o", str(out), "--no-xlsx", *extra,
                   timeout=300)
    return proc, out


def test_cluster_rows_equal_the_local_executor(tmp_path: Path, cluster: tuple[str, Path],
                                                dumps: tuple[Path, Path, Path]) -> None:
    address, _ = cluster
    golden, target, _ = dumps
    local, local_out = _compare(tmp_path, "local", golden, target)
    remote, remote_out = _compare(tmp_path, "dask", golden, target, "--executor", "dask",
                                  "--scheduler-address", address)
    assert remote.returncode == local.returncode, remote.stdout + remote.stderr
    assert remote.stdout.strip().splitlines()[-1] == local.stdout.strip().splitlines()[-1]
    local_rows, remote_rows = _rows(local_out), _rows(remote_out)
    assert local_rows and sum(len(r) for r in local_rows.values()) > 10
    assert remote_rows == local_rows


def test_shipped_workflow_runs_on_the_cluster(tmp_path: Path, cluster: tuple[str, Path],
                                              dumps: tuple[Path, Path, Path]) -> None:
    address, _ = cluster
    golden, target, _ = dumps
    proc = llmflow("run", "compare_dumps", "--run-dir", str(tmp_path / "run"),
                   "--set", f"golden_dump={golden}", "--set", f"target_dump={target}",
                   "--set", "executor=dask", "--set", f"scheduler_address={address}", timeout=300)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    compare = json.loads((tmp_path / "run" / "compare" / "compare_summary.json").read_text())
    local, local_out = _compare(tmp_path, "local", golden, target)
    assert compare["pairs"] == json.loads((local_out / "compare_summary.json").read_text())["pairs"]
    assert _rows(tmp_path / "run" / "compare") == _rows(local_out)


def test_a_worker_killed_mid_task_costs_a_retry_not_a_row(tmp_path: Path, cluster: tuple[str, Path],
                                                          dumps: tuple[Path, Path, Path]) -> None:
    address, die_dir = cluster
    golden, target, killer = dumps
    alg = f"{killer}:die_on_request"
    local, local_out = _compare(tmp_path, "local", golden, target, "-alg", alg)
    (die_dir / "once").write_text("")
    remote, remote_out = _compare(tmp_path, "dask", golden, target, "-alg", alg, "--executor", "dask",
                                  "--scheduler-address", address)
    assert not (die_dir / "once").exists(), "no worker ran the killer"
    assert remote.returncode == local.returncode, remote.stdout + remote.stderr
    assert _rows(remote_out) == _rows(local_out)
    _wait_for_workers(address, 2)  # the nanny has restarted the killed worker


def test_a_chunk_whose_workers_keep_dying_fails_by_name(tmp_path: Path, cluster: tuple[str, Path],
                                                        dumps: tuple[Path, Path, Path]) -> None:
    address, die_dir = cluster
    golden, target, killer = dumps
    (die_dir / "always").write_text("")
    try:
        proc, out = _compare(tmp_path, "dask", golden, target, "-alg", f"{killer}:die_on_request",
                             "--executor", "dask", "--scheduler-address", address)
    finally:
        (die_dir / "always").unlink()
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert last.startswith("FAILED: compare: the dask workers running chunk 1 of"), last
    assert "died each time it ran" in last and "Traceback" not in proc.stdout + proc.stderr
    assert not (out / "compare_summary.json").exists()  # no table set that reads as complete
    _wait_for_workers(address, 2)
