"""Where one dump's time goes: cProfile of a dump run beside a plain run of the same generation,
each function's own time summed into the dump's parts.

Run by hand (tens of seconds; on a lent GPU this is the profile docs/benchmarks.md quotes)::

    python benchmarks/profile_dump.py --device cuda --models smollm2-shape --modes "statistics module"
    .venv/bin/python benchmarks/profile_dump.py --models tiny --top 30

Both runs are profiled (the profiler's own cost is in both), after one unprofiled warm-up of
each. Printed per mode: the two runs' profiled seconds, the dump's extra time split into

* capture: the recorder's wrappers, the compiled capture and the session (``dump/recorder.py``,
  ``dump/capture.py``, ``dump/copies.py``, ``llmflow_capture``): the forward thread's own work
  per call and per tensor;
* writer: the step ends' work (``dump/writer.py``, ``dump/stats.py``, ``formats/``): statistics,
  index rows, data files;
* waits for the device: the calls that block until queued kernels finish (``tolist``, ``item``,
  ``cpu``, ``synchronize``), whose time plain generation spends in its own read-backs;
* the rest (torch and the model: where the dump's copies and reductions are launched),

and the ``--top`` functions by own time in the dump run. A wait moved from plain generation's
read-back into the writer's is no cost of the dump: compare the totals, not one column.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dump import MODELS, MODES  # noqa: E402

from llmflow.dump import DumpConfig, dump_run  # noqa: E402
from llmflow.models import LoadedModel, encode_prompt, greedy_generate, load_model  # noqa: E402

PARTS = {  # part -> what a profile entry's file or function name holds
    "capture": ("dump/recorder.py", "dump/capture.py", "dump/copies.py", "llmflow_capture"),
    "writer": ("dump/writer.py", "dump/stats.py", "formats/", "orjson"),
    "waits for the device": ("'tolist'", "'item'", "'cpu'", "synchronize", "'_local_scalar_dense'"),
}


def part_of(func: tuple[str, int, str]) -> str:
    """The part a profile entry (file, line, function) belongs to."""
    where = f"{func[0]}:{func[2]}"
    for part, marks in PARTS.items():
        if any(m in where for m in marks):
            return part
    return "the rest"


def profiled(run: Callable[[], None]) -> pstats.Stats:
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    return pstats.Stats(prof)


def own_times(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own time per part."""
    out = dict.fromkeys([*PARTS, "the rest"], 0.0)
    for func, (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        out[part_of(func)] += tottime
    return out


def profile_mode(lm: LoadedModel, ids: list[int], new_tokens: int, mode: str, out: Path,
                 sync: Callable[[], None]) -> tuple[pstats.Stats, pstats.Stats]:
    """(plain run's profile, dump run's profile) of ``mode``, each after an unprofiled warm-up."""
    runs = [0]

    def plain() -> None:
        greedy_generate(lm.model, ids, new_tokens)
        sync()

    def dumped() -> None:
        runs[0] += 1
        config = DumpConfig(dump_path=str(out / str(runs[0])), token_range="all", **MODES[mode])
        dump_run(lm, ids, new_tokens, config)
        sync()

    plain(), dumped()  # warm-up: caches, kernels, the compiled capture
    return profiled(plain), profiled(dumped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny"], help=f"{', '.join(MODELS)} or a model spec")
    ap.add_argument("--modes", nargs="+", default=["statistics module", "tensor module"], choices=list(MODES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--prompt", default="The capital of France is Paris. The capital of Italy is Rome. The")
    ap.add_argument("--top", type=int, default=25, help="functions listed by own time (default 25)")
    a = ap.parse_args()
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    for key in a.models:
        lm = load_model(MODELS.get(key, key), device=a.device, dtype=a.dtype)
        ids = encode_prompt(lm.tokenizer, a.prompt)
        for mode in a.modes:
            with tempfile.TemporaryDirectory(prefix="llmflow-profile-") as tmp:
                base, ours = profile_mode(lm, ids, a.new_tokens, mode, Path(tmp), sync)
            b, o = own_times(base), own_times(ours)
            plain_s, dump_s = base.total_tt, ours.total_tt  # type: ignore[attr-defined]
            print(f"\n## {key}, {mode}, {a.device} {a.dtype}, {a.new_tokens} new tokens "
                  f"(writer {os.environ.get('LLMFLOW_DUMP_WRITER', 'auto')})\n")
            print(f"profiled: plain {plain_s:.3f} s, dump {dump_s:.3f} s (+{dump_s - plain_s:.3f} s)\n")
            print("| part | plain s | dump s | extra s |\n|---|---|---|---|")
            for part in o:
                print(f"| {part} | {b[part]:.3f} | {o[part]:.3f} | {o[part] - b[part]:+.3f} |")
            print(f"\ntop {a.top} functions of the dump run by own time:\n")
            ours.sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
