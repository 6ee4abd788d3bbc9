"""Compare throughput on a real dask cluster: 1, 2, 4 workers against the local executor.

    .venv/bin/python benchmarks/bench_compare_dask.py [--size-gb 2] [--workers 1 2 4] [--repeat 1]
        [--json out.json]

Writes a synthetic golden and target dump of ``size/2`` GB each (bench_compare.py's writer: fp32,
4 MiB tensors) under /tmp, then measures in one run:
  * local: ``compare_dumps`` with the local executor and one worker (its second run: the first
    loads the kernel and warms the page cache), the rows every cluster run must reproduce;
  * dask N: a ``dask scheduler`` and N ``dask worker`` processes (one thread each) started as
    subprocesses on the loopback over TCP, then ``compare_dumps(executor="dask")`` against it:
    wall time, GB/s of tensor data, and whether its CSV rows equal the local executor's byte for
    byte. Each cluster compares twice: the first run ("cold") includes each worker's import of
    torch and llmflow and its kernel load; the second is the figure (a cluster is long-lived).
    The cluster is stopped before the next N starts.
The workers read the dump files themselves (a shared filesystem, as on a cluster); only rows
travel back. Each figure is GB/s of both sides' tensor bytes; the ratio is to the local run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_compare import cpu_model, write_side  # noqa: E402

from llmflow.compare.run import CompareOptions, compare_dumps  # noqa: E402

DASK = shutil.which("dask", path=str(Path(sys.executable).parent)) or shutil.which("dask")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cluster(workers: int, logs: Path) -> Iterator[str]:
    """A scheduler and ``workers`` single-threaded workers; yields the scheduler's address."""
    from dask.distributed import Client

    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    scheduler = [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"]
    procs = [subprocess.Popen(scheduler, env=env, stdout=subprocess.DEVNULL,
                              stderr=open(logs / "scheduler.log", "wb"), start_new_session=True)]
    for i in range(workers):
        procs.append(subprocess.Popen([DASK, "worker", address, "--nthreads", "1", "--no-dashboard",
                                       "--name", f"w{i}"], env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(logs / f"worker{i}.log", "wb"), start_new_session=True))
    try:
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(workers, timeout=120)
        yield address
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def rows(out: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(out.glob("compare_*.csv"))}


def timed_compare(g: Path, t: Path, out: Path, opts: CompareOptions) -> dict:
    t0 = time.perf_counter()
    res = compare_dumps(g, t, out, opts)
    seconds = time.perf_counter() - t0
    s = res["summary"]
    return {"seconds": round(seconds, 2), "pairs": s.pairs, "bytes": s.bytes,
            "gb_per_s": round(s.bytes / seconds / 1e9, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="total dump size (both sides)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=1, help="turns (local, then each cluster size)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if DASK is None:
        print("the dask command is not installed (pip install 'llmflow[dask]')", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="llmflow-bench-dask-", dir="/tmp"))
    report: dict = {"cpus": os.cpu_count(), "cpu": cpu_model(), "size_gb": args.size_gb, "turns": []}
    try:
        g, t = tmp / "golden", tmp / "target"
        report["tensors_per_side"] = write_side(g, args.size_gb / 2, 0, 0.0)
        write_side(t, args.size_gb / 2, 1, 1e-3)
        os.sync()
        for turn in range(args.repeat):
            timed_compare(g, t, tmp / "local", CompareOptions(workers=1, xlsx=False))  # warm, as below
            local = timed_compare(g, t, tmp / "local", CompareOptions(workers=1, xlsx=False))
            expected = rows(tmp / "local")
            row: dict = {"local": local, "dask": []}
            print(json.dumps({"turn": turn, "local": local}), flush=True)
            for n in args.workers:
                out = tmp / f"dask{n}"
                with cluster(n, tmp) as address:
                    opts = CompareOptions(xlsx=False, executor="dask", scheduler_address=address)
                    cold = timed_compare(g, t, out, opts)
                    cold_equal = rows(out) == expected
                    ours = timed_compare(g, t, out, opts)
                ours.update(workers=n, rows_equal_local=cold_equal and rows(out) == expected,
                            vs_local=round(ours["gb_per_s"] / local["gb_per_s"], 2),
                            cold_seconds=cold["seconds"])
                shutil.rmtree(out)
                row["dask"].append(ours)
                print(json.dumps({"turn": turn, "dask": ours}), flush=True)
            shutil.rmtree(tmp / "local")
            report["turns"].append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = all(d["rows_equal_local"] for r in report["turns"] for d in r["dask"])
    print("PASSED: every cluster's rows equal the local executor's" if ok
          else "FAILED: a cluster's rows differ from the local executor's")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
