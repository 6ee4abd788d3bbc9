"""What a dump costs in instructions and cache misses, counted rather than timed, for two source
trees (say, a ``git worktree`` of main and this checkout).

On a small shared machine a change worth 1% of a dump moves less than the noise of any timing
(``bench_dump.py`` ratios move by 0.05-0.1 from run to run there). Counts do not: each tree runs,
under valgrind's callgrind with its cache simulation, one greedy generation without a dump and one
with it (after a warm-up of both), and the counts of each are read from the profile callgrind
writes at the markers between them. Printed: instructions (Ir), first-level instruction and data
cache misses (I1mr, D1mr + D1mw) and last-level data misses (DLmr + DLmw) of the dump's run minus
the plain run's, for each tree, and new / old.

Run by hand (valgrind needed; ~15 minutes, the two trees in parallel)::

    git worktree add /tmp/old main
    .venv/bin/python benchmarks/count_dump.py /tmp/old . --mode module
    .venv/bin/python benchmarks/count_dump.py /tmp/old . --mode api --tokens 4
    .venv/bin/python benchmarks/count_dump.py /tmp/old . --mode api --data-mode tensor --writer inline

valgrind does not run AVX-512 code, so torch, MKL and llmflow's kernels are held to AVX2
(``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``LLMFLOW_KERNEL_TARGET``); the model is a
seeded tiny Llama (nothing to download). The counts are the dump's own work: the cold-cache cost
a forward pass adds to it shows in the miss counts only as far as callgrind's two-level cache
model goes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "tiny-llama:layers=8,hidden=256,heads=4,kv_heads=2,intermediate=512,vocab=2048"
MARKER = "os_getppid*"  # CPython's C function behind os.getppid (libc's own has no symbol here)
EVENTS = {"Ir": ("Ir",), "I1 misses": ("I1mr",), "D1 misses": ("D1mr", "D1mw"),
          "LL data misses": ("DLmr", "DLmw")}


def drive(mode: str, model: str, tokens: int, data_mode: str = "statistics") -> None:
    """The measured process: warm up, then a plain run and a dump between markers (``os.getppid``,
    a call nothing else here makes, before whose C function callgrind writes its counts)."""
    import torch

    torch.set_num_threads(1)
    from llmflow.dump import DumpConfig, dump_run
    from llmflow.models import greedy_generate, load_model

    loaded = load_model(model)
    ids = list(range(1, 9))
    out = Path(tempfile.mkdtemp(prefix="llmflow-count-"))

    def dump() -> None:
        shutil.rmtree(out / "d", ignore_errors=True)
        dump_run(loaded, ids, tokens, DumpConfig(dump_path=str(out / "d"), token_range="all",
                                                 data_mode=data_mode, mode=mode))

    marker = os.getppid
    dump()
    greedy_generate(loaded.model, ids, tokens)
    marker()  # profile 1: start-up and warm-up
    greedy_generate(loaded.model, ids, tokens)
    marker()  # profile 2: the plain run
    dump()
    marker()  # profile 3: the dump
    shutil.rmtree(out, ignore_errors=True)


def read_counts(path: Path) -> dict[str, int]:
    """The event totals of one callgrind profile."""
    events: list[str] = []
    totals: list[int] = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            totals = [int(v) for v in line.split()[1:]]
    return dict(zip(events, totals, strict=False))


def count(tree: Path, mode: str, model: str, tokens: int, work: Path, data_mode: str,
          writer: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", "ATEN_CPU_CAPABILITY": "avx2",
           "MKL_ENABLE_INSTRUCTIONS": "AVX2", "LLMFLOW_KERNEL_TARGET": "x86-64-v3",
           "LLMFLOW_DUMP_WRITER": writer}
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", f"--dump-before={MARKER}",
           f"--callgrind-out-file={work}/callgrind.out", sys.executable, str(Path(__file__).resolve()),
           "--drive", mode, model, str(tokens), data_mode]
    return subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, nargs="?")
    ap.add_argument("new", type=Path, nargs="?")
    ap.add_argument("--mode", default="module", choices=["module", "api"])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--data-mode", default="statistics", choices=["statistics", "tensor"])
    ap.add_argument("--writer", default="auto", choices=["auto", "inline", "thread"],
                    help="LLMFLOW_DUMP_WRITER for both trees (auto: one torch thread here, so the thread; "
                         "inline: as on a CPU whose cores torch's threads all take)")
    ap.add_argument("--drive", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.drive:
        drive(a.drive[0], a.drive[1], int(a.drive[2]), a.drive[3])
        return
    if a.old is None or a.new is None:
        ap.error("give the two source trees: OLD NEW")
    if shutil.which("valgrind") is None:
        ap.error("valgrind is not installed here")
    results: dict[str, dict[str, dict[str, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="llmflow-count-") as tmp:
        runs = {}
        for label, tree in (("old", a.old), ("new", a.new)):
            work = Path(tmp) / label
            work.mkdir()
            runs[label] = (work, count(tree.resolve(), a.mode, a.model, a.tokens, work, a.data_mode,
                                       a.writer))
        for label, (work, proc) in runs.items():
            _, err = proc.communicate()
            profiles = sorted(work.glob("callgrind.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
            if proc.returncode != 0 or len(profiles) < 3:
                sys.exit(f"count_dump: the {label} tree's run failed (exit {proc.returncode}):\n"
                         f"{err[-2000:]}")
            plain, dumped = read_counts(profiles[1]), read_counts(profiles[2])
            results[label] = {"plain": plain, "dump": dumped}
    print(f"{a.model}, {a.tokens} new tokens, {a.data_mode} {a.mode} dump ({a.writer} writer): "
          "the dump's run minus the plain run")
    print(f"{'':16s} {'old':>15s} {'new':>15s} {'new / old':>10s}   (plain run, old)")
    for name, keys in EVENTS.items():
        extra = {t: sum(results[t]["dump"].get(k, 0) - results[t]["plain"].get(k, 0) for k in keys)
                 for t in ("old", "new")}
        base = sum(results["old"]["plain"].get(k, 0) for k in keys)
        ratio = extra["new"] / extra["old"] if extra["old"] else float("nan")
        print(f"{name:16s} {extra['old']:15,d} {extra['new']:15,d} {ratio:10.3f}   ({base:,d})")


if __name__ == "__main__":
    main()
