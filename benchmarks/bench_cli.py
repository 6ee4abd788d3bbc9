"""Start-up time of the commands that only read workflows.

    .venv/bin/python benchmarks/bench_cli.py [--repeat 10] [--json out.json]

Runs ``llmflow validate workflows/llama2_bisect.yaml`` (and ``plan``, ``workflows``, ``schema``) in
a fresh interpreter ``repeat`` times each and reports the median and the best wall time, next to
``python -c "import torch"`` (what these commands would pay if they imported torch) and a bare
``python -c pass`` (the interpreter's own start-up). The target: validate under 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BISECT = str(REPO / "workflows" / "llama2_bisect.yaml")
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "llmflow validate llama2_bisect.yaml": [sys.executable, "-m", "llmflow", "validate", BISECT],
    "llmflow plan llama2_bisect.yaml": [sys.executable, "-m", "llmflow", "plan", BISECT],
    "llmflow workflows": [sys.executable, "-m", "llmflow", "workflows"],
    "llmflow schema": [sys.executable, "-m", "llmflow", "schema"],
}


def wall_times(cmd: list[str], repeat: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, env=env)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    wall_times(COMMANDS["python -c pass"], 1)  # warm the page cache
    results = {}
    for label, cmd in COMMANDS.items():
        t = wall_times(cmd, args.repeat)
        results[label] = {"median_s": statistics.median(t), "best_s": min(t), "runs": t}
        print(f"{label:40s} median {statistics.median(t):6.3f} s   best {min(t):6.3f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
