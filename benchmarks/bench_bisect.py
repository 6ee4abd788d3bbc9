"""Benchmark: the bisect recipe against the brute-force way (full API-level dumps + compare).

    .venv/bin/python benchmarks/bench_bisect.py                 # SmolLM2, 20 tokens, as shipped
    .venv/bin/python benchmarks/bench_bisect.py --full-tokens 2 --json out.json

1. recipe: ``workflows/llama2_bisect.yaml`` with its defaults (fp32 golden, bf16 target with the
   demo's planted decode-attention bug, 20 tokens), or ``--target-model smollm2 --patch ...`` (a
   fault of your choosing). Wall time, bytes of both dumps, the verdict.
2. prefill only: the same recipe restricted to what a prefill-only bisect records and replays
   (both dumps at step 0, ``replay_step: 0``): what replaying decode steps costs in time and bytes,
   and what it buys (a decode-path fault is out of its reach).
3. brute force: an API-level dump (every op's inputs and outputs, every step) of both sides, then
   a compare of the two. Writing 20 tokens of that for SmolLM2 is ~20 GB (every linear's weight
   is an op input, every step), so it runs ``--full-tokens`` steps for real and extrapolates:
   prefill + (N-1) x the measured decode step. The bisect's own analytic estimate
   (``cost.full_api_dump_bytes_estimate`` in the verdict) is printed beside it.

Prints one table and, with ``--json``, writes the figures. Target: the recipe writes at most 10%
of the brute-force bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


PREFILL_ONLY = """name: bisect-prefill-only
extends: {recipe}
stages:
  dump-golden: {{with: {{token_range: [0]}}}}
  dump-npu: {{with: {{token_range: [0]}}}}
  bisect: {{with: {{replay_step: 0}}}}
"""


def run_recipe(tmp: Path, sets: list[str], prefill_only: bool = False) -> dict:
    from llmflow.localize.cost import dir_bytes
    from llmflow.workflow.runner import run_workflow

    workflow = REPO / "workflows" / "llama2_bisect.yaml"
    name = "prefill-only" if prefill_only else "recipe"
    if prefill_only:
        workflow = tmp / "prefill_only.yaml"
        workflow.write_text(PREFILL_ONLY.format(recipe=REPO / "workflows" / "llama2_bisect.yaml"))
    t0 = time.time()
    result = run_workflow(workflow, set_params=sets, run_dir=tmp / name)
    wall = time.time() - t0
    summary = json.loads((Path(result.run_dir) / "summary.json").read_text())
    dumps = [Path(result.run_dir) / sid for sid in ("dump-golden", "dump-npu")]
    verdict = summary.get("verdict", {})
    cost = verdict.get("cost") or {}
    return {"status": verdict.get("status"), "seconds": round(wall, 1),
            "bisect_seconds": cost.get("bisect_seconds"),
            "bytes": sum(dir_bytes(d) for d in dumps), "verdict": {k: verdict.get(k) for k in (
                "first_mismatch_token", "first_bad_token", "first_bad_layer", "first_bad_module",
                "first_bad_op")}, "replay": verdict.get("replay"), "headline": verdict.get("headline"),
            "estimate": cost.get("full_api_dump_bytes_estimate"),
            "report": (summary.get("report") or {}).get("html")}


def run_brute_force(tmp: Path, tokens: int, full_tokens: int, prompt: str) -> dict:
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.formats import open_dump
    from llmflow.localize.cost import dir_bytes
    from llmflow.models import encode_prompt, load_model

    out: dict = {"steps_run": full_tokens}
    dirs = {}
    t0 = time.time()
    for side, dtype in (("golden", "float32"), ("target", "bfloat16")):
        loaded = load_model("smollm2", dtype=dtype)
        ids = encode_prompt(loaded.tokenizer, prompt)
        d = tmp / f"api-{side}"
        dump_run(loaded, ids, full_tokens, DumpConfig(dump_path=str(d), mode="api", token_range="all"))
        dirs[side] = d
        per_step: dict[int, int] = {}
        keys: set[str] = set()
        for e in open_dump(d).entries():
            # a tensor handed to several ops is stored once and referenced by several entries
            if e.has_data and e.shape is not None and e.dtype is not None and e.key not in keys:
                keys.add(e.key)
                size = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}.get(e.dtype, 4)
                n = 1
                for s in e.shape:
                    n *= s
                per_step[e.step] = per_step.get(e.step, 0) + n * size
        decode = per_step.get(1, 0)
        out[f"{side}_bytes_measured"] = dir_bytes(d)
        out[f"{side}_bytes_extrapolated"] = int(per_step.get(0, 0) + decode * max(tokens - 1, 0))
    out["dump_seconds"] = round(time.time() - t0, 1)
    t1 = time.time()
    from llmflow.compare.metrics import compare_tensors

    g, t = open_dump(dirs["golden"]), open_dump(dirs["target"])
    t_index = {(e.step, e.name, e.kind, e.index): e for e in t.entries() if e.has_data}
    rows = 0
    for e in g.entries():
        other = t_index.get((e.step, e.name, e.kind, e.index))
        if e.has_data and other is not None and e.shape == other.shape and e.shape and all(e.shape):
            compare_tensors(g.load(e).float(), t.load(other).float())
            rows += 1
    out["compare_seconds"] = round(time.time() - t1, 1)
    out["compare_rows"] = rows
    out["bytes_extrapolated"] = out["golden_bytes_extrapolated"] + out["target_bytes_extrapolated"]
    steps = max(full_tokens, 1)
    out["seconds_extrapolated"] = round((out["dump_seconds"] + out["compare_seconds"]) * tokens / steps, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patch", default=None, help="target_patch for the recipe (a fault to find)")
    ap.add_argument("--target-model", default=None, help="target_model (default: the recipe's, with the "
                    "demo's planted bug)")
    ap.add_argument("--tokens", type=int, default=20, help="new tokens of the recipe (its default: 20)")
    ap.add_argument("--full-tokens", type=int, default=2, help="steps of the brute-force dump run for real")
    ap.add_argument("--prompt", default="Tell me a story about a dragon.")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="llmflow-bench-bisect-"))
    sets = [f"max_new_tokens={args.tokens}", f"prompt={args.prompt}"]
    sets += [f"target_patch={args.patch}"] if args.patch else []
    sets += [f"target_model={args.target_model}"] if args.target_model else []
    try:
        recipe = run_recipe(tmp, sets)
        prefill = run_recipe(tmp, sets, prefill_only=True)
        brute = run_brute_force(tmp, args.tokens, args.full_tokens, args.prompt)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    frac = recipe["bytes"] / max(brute["bytes_extrapolated"], 1)
    figures = {"recipe": recipe, "prefill_only": prefill, "brute_force": brute,
               "bytes_fraction": round(frac, 4)}
    for label, r in (("recipe", recipe), ("prefill only", prefill)):
        steps = (r.get("replay") or {}).get("steps_tried")
        print(f"{label:13s} {r['seconds']:8.1f} s  {r['bytes'] / 1e6:10.1f} MB  bisect "
              f"{r['bisect_seconds']} s, replayed steps {steps}: {r['status']}: {r['headline']}")
    print(f"decode-step replay costs {recipe['seconds'] - prefill['seconds']:+.1f} s "
          f"({recipe['seconds'] / max(prefill['seconds'], 1e-9):.2f}x) and "
          f"{(recipe['bytes'] - prefill['bytes']) / 1e6:+.2f} MB "
          f"({recipe['bytes'] / max(prefill['bytes'], 1):.2f}x) against the prefill-only bisect")
    print(f"full API dump {brute['seconds_extrapolated']:8.1f} s  "
          f"{brute['bytes_extrapolated'] / 1e6:10.1f} MB  "
          f"(extrapolated from {brute['steps_run']} steps run: {brute['dump_seconds']} s dump, "
          f"{brute['compare_seconds']} s compare of {brute['compare_rows']} tensors)")
    if recipe.get("estimate"):
        print(f"bisect's own estimate of the full API dump: {recipe['estimate'] / 1e6:.1f} MB")
    print(f"recipe bytes / full API dump bytes = {frac:.2%} (target <= 10%)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0 if frac <= 0.10 and recipe["status"] in ("pass", "fail") else 1


if __name__ == "__main__":
    sys.exit(main())
