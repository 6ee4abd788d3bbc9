"""Compare throughput: llmflow's compare vs reading the files raw (cat) vs msprobe's compare.

    .venv/bin/python benchmarks/bench_compare.py --sizes-gb 1 8 [--repeat 3] [--workers 1 2 4 8]
        [--targets x86-64-v4 x86-64-v3 ...] [--kl all logits] [--json out.json]

For each size S it writes a synthetic golden and target dump of S/2 GB each with llmflow's own
writer (fp32 activations, 4 MiB tensors, 64 per step folder) under /tmp, then measures, ``repeat``
times in turn (so that both see the same moments of a noisy machine; each ratio is of one turn,
and the median ratio is reported with all of them)
  * raw:     ``cat`` of every data file to /dev/null (warm page cache, the ceiling), with its CPU
             seconds and the load average when it ran,
  * llmflow: ``compare_dumps`` (CSV, no XLSX) with each build of the compare kernel this CPU runs
             (``--targets``, default all: x86-64-v4, -v3, -v2, baseline) and each worker count
             (``--workers``, default 1 2 4 8) and ``--kl`` (default all; logits: the compare's
             ``--kl logits``, no KL on any row of these dumps), GB/s of tensor data, CPU seconds
             (of all its threads and worker processes) over cat's, and the peak anonymous memory of the
             compare's process tree (sampled every 5 ms),
  * msprobe: msprobe's ``pt_compare`` on the same tensors written in msprobe's layout
             (dump.json + one .pt per tensor), when mindstudio-probe imports (PYTHONPATH may
             point at a ``pip install --target`` directory); skipped otherwise. Only for the
             smallest size: msprobe keeps every row in memory.
Everything is deleted afterwards unless --keep.

    .venv/bin/python benchmarks/bench_compare.py --kernel [--workers 1 2 4 8] [--targets ...] [--repeat 5]

times ``compare_tensors`` alone on in-memory fp32 and bf16 pairs, with each build of the kernel
and each thread count, in turns (every build and thread count once a turn, ``repeat`` turns):
64 pairs of 2^18 elements (1 MiB per side in fp32) and one pair of 2^24, GB/s of both sides,
median and range over the turns, and each build's median ratio to the first build's GB/s in the
same turn (with one thread also GB per second of the thread's CPU time, "1 cpu": on a machine
shared with other work the steadier figure); then microseconds per pair of 576 and 4096 elements
through the best build and eager torch.

    .venv/bin/python benchmarks/bench_compare.py [--kernel] --old TREE [--targets ...] [--repeat 15]

times this checkout's compare kernel against the one in source tree TREE (``git archive REF |
tar -x -C TREE``), each build of both side by side in turns in one process: for changes meant to
make the kernel faster. With --kernel, its C entry point on in-memory pairs and the bits each
gives; without, the whole compare of the synthetic dumps with each kernel swapped in (rows
marked "kernel": "new" / "old").

    .venv/bin/python benchmarks/bench_compare.py --smollm2 [--tokens 20]

dumps SmolLM2 in float32 and in bfloat16 (module mode, every step) and times ``compare_dumps`` of
the two in one process, with the compiled kernel and on eager torch: real dumps are many small
tensors, where per-pair costs, not bytes, decide.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmflow.compare.run import CompareOptions, compare_dumps  # noqa: E402
from llmflow.formats.base import Entry  # noqa: E402
from llmflow.formats.llmflow_dump import DumpDirWriter, LlmflowDumpReader  # noqa: E402

TENSOR_NUMEL = 1 << 20  # 4 MiB of fp32 per tensor
PER_STEP = 64


def write_side(path: Path, gb: float, seed: int, noise: float) -> int:
    """A dump of about ``gb`` GB; returns the number of tensors."""
    n = max(1, int(gb * 1e9 / (TENSOR_NUMEL * 4)))
    w = DumpDirWriter(path, meta={"data_mode": "tensor"})
    gen = torch.Generator().manual_seed(seed)
    for step in range((n + PER_STEP - 1) // PER_STEP):
        tensors, entries = {}, []
        for i in range(min(PER_STEP, n - step * PER_STEP)):
            base = torch.Generator().manual_seed(step * 1000 + i)
            x = torch.randn(TENSOR_NUMEL, generator=base)
            if noise:
                x = x * (1 + noise * torch.randn(TENSOR_NUMEL, generator=gen))
            tensors[str(i)] = x
            entries.append(
                Entry(
                    step=step,
                    rank=0,
                    name=f"model.layers.{i}",
                    kind="output",
                    index="0",
                    level="module",
                    order=i,
                    dtype="float32",
                    shape=(TENSOR_NUMEL,),
                    module_type="LlamaDecoderLayer",
                    key=str(i),
                )
            )
        w.write_batch(tensors, entries)
    w.close()
    return n


def data_files(*dumps: Path) -> list[Path]:
    return sorted(p for d in dumps for p in d.rglob("*.safetensors"))


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def raw_read(files: list[Path]) -> tuple[float, int, float]:
    """Seconds of ``cat`` of ``files``, their bytes, and the CPU seconds cat took."""
    nbytes = sum(f.stat().st_size for f in files)
    cpu0, t0 = children_cpu_seconds(), time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0, nbytes, children_cpu_seconds() - cpu0


class AnonPeak:
    """Peak RssAnon (MiB) of this process and its children, sampled in a thread."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _anon(pid: int) -> float:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def _tree(self) -> list[int]:
        import psutil

        me = psutil.Process()
        return [me.pid] + [c.pid for c in me.children(recursive=True)]

    def _run(self) -> None:
        # the process tree is refreshed every 20th sample only: scanning /proc for children takes
        # ~1 ms of Python (holding the GIL), which on a small machine slowed the measured compare
        tick, pids = 0, self._tree()
        while not self._stop:
            if tick % 20 == 0:
                pids = self._tree()
            tick += 1
            self.peak = max(self.peak, sum(self._anon(p) for p in pids))
            time.sleep(0.005)

    def __enter__(self) -> AnonPeak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._t.join()


def llmflow_compare(g: Path, t: Path, out: Path, workers: int, kl: str = "all") -> dict:
    torch.set_num_threads(workers)  # in-process compares run the kernel on torch's threads
    base = AnonPeak._anon(os.getpid())
    with AnonPeak() as peak:
        cpu0 = time.process_time() + children_cpu_seconds()
        t0 = time.perf_counter()
        res = compare_dumps(
            LlmflowDumpReader(g), LlmflowDumpReader(t), out,
            CompareOptions(workers=workers, xlsx=False, kl=kl),
        )
        dt = time.perf_counter() - t0
        cpu = time.process_time() + children_cpu_seconds() - cpu0  # (the sampling thread's too: ~1%)
    s = res["summary"]
    return {
        "seconds": round(dt, 2),
        "cpu_seconds": round(cpu, 3),
        "pairs": s.pairs,
        "bytes": s.bytes,
        "gb_per_s": round(s.bytes / dt / 1e9, 3),
        "peak_anon_mib_over_start": round(peak.peak - base, 1),
        "verdict": s.verdict,
    }


def write_msprobe(dump: Path, out: Path) -> None:
    """The same tensors in msprobe's layout: dump.json + dump_tensor_data/<name>.pt."""
    reader = LlmflowDumpReader(dump)
    data_dir = out / "dump_tensor_data"
    data_dir.mkdir(parents=True)
    data = {}
    for e in reader.entries():
        op = f"Module.model.layers.{e.order}.LlamaDecoderLayer.forward.{e.step}"
        x = reader.load(e)
        name = f"{op}.output.0.pt"
        torch.save(x, data_dir / name)
        data[op] = {
            "input_args": [],
            "input_kwargs": {},
            "output": [
                {
                    "type": "torch.Tensor",
                    "dtype": "torch.float32",
                    "shape": list(x.shape),
                    "Max": float(x.max()),
                    "Min": float(x.min()),
                    "Mean": float(x.mean()),
                    "Norm": float(x.norm()),
                    "requires_grad": False,
                    "data_name": name,
                }
            ],
        }
    (out / "dump.json").write_text(
        json.dumps(
            {
                "task": "tensor",
                "level": "L0",
                "framework": "pytorch",
                "dump_data_dir": str(data_dir),
                "data": data,
            }
        )
    )


def msprobe_compare(g: Path, t: Path, tmp: Path) -> dict:
    try:
        from msprobe.pytorch.compare.pt_compare import pt_compare
    except Exception as exc:  # not installed, or its own dependencies missing
        return {"skipped": f"msprobe not importable: {type(exc).__name__}: {exc}"}
    mg, mt, out = tmp / "ms_golden", tmp / "ms_target", tmp / "ms_out"
    write_msprobe(g, mg)
    write_msprobe(t, mt)
    out.mkdir()
    nbytes = sum(f.stat().st_size for d in (mg, mt) for f in (d / "dump_tensor_data").iterdir())
    os.sync()  # as for llmflow: no writeback of the files just written during the measurement
    subprocess.run(
        [
            "cat",
            *map(
                str, sorted((mg / "dump_tensor_data").iterdir()) + sorted((mt / "dump_tensor_data").iterdir())
            ),
        ],
        stdout=subprocess.DEVNULL,
    )
    t0 = time.perf_counter()
    try:
        pt_compare(
            {
                "npu_path": str(mt / "dump.json"),
                "bench_path": str(mg / "dump.json"),
                "is_print_compare_log": False,
            },
            str(out),
        )
    except BaseException as exc:  # msprobe calls sys.exit on its own errors  # noqa: BLE001
        return {"skipped": f"msprobe compare failed: {type(exc).__name__}: {exc}"}
    dt = time.perf_counter() - t0
    results = list(out.glob("*.xlsx")) + list(out.glob("*.csv"))
    return {
        "seconds": round(dt, 2),
        "bytes": nbytes,
        "gb_per_s": round(nbytes / dt / 1e9, 3),
        "output": [p.name for p in results],
    }


def kernel_bench(workers: list[int], targets: list, repeat: int, kl: tuple[str, ...] = ("all",)) -> dict:
    """GB/s (both sides) of compare_tensors on in-memory pairs: the arithmetic without the I/O,
    per build of the kernel and per thread count (and without the KL where ``kl`` holds
    "logits": those builds named "<target> no-kl"); and the time per pair of small tensors (a
    decode step's hidden state), best build vs eager."""
    from llmflow import native
    from llmflow.compare import kernels
    from llmflow.compare.metrics import compare_tensors

    gen = torch.Generator().manual_seed(0)
    g = torch.randn(1 << 24, generator=gen)
    t = g * (1 + 1e-3 * torch.randn(g.shape, generator=gen))
    builds = {(f"{target.name} no-kl" if mode == "logits" else target.name, mode == "all"):
              kernels.for_target(target) for target in targets for mode in kl}
    out: dict = {"cpu": cpu_model(), "targets": [name for name, _ in builds],
                 "best": native.supported_targets()[0].name,
                 "repeat": repeat, "threads": workers}
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        gd, td = g.to(dtype), t.to(dtype)
        pieces = [(gd[i:i + (1 << 18)], td[i:i + (1 << 18)]) for i in range(0, 64 << 18, 1 << 18)]
        cases += [(f"{str(dtype).removeprefix('torch.')}_{name}", pairs)
                  for name, pairs in (("1MiB", pieces), ("64MiB", [(gd, td)]))]
    turns: dict = {}  # (case, threads, target) -> GB/s of each turn
    compiled = kernels.fused()
    try:
        for _ in range(repeat + 1):  # the first turn warms up (loads, page faults) and is dropped
            for case, pairs in cases:
                nbytes = sum(a.nbytes + b.nbytes for a, b in pairs)
                for threads in workers:
                    torch.set_num_threads(threads)
                    for (name, with_kl), kernel in builds.items():
                        kernels._fused = kernel if kernel is not None else False
                        t0, cpu0 = time.perf_counter(), time.thread_time()
                        for a, b in pairs:
                            compare_tensors(a, b, kl=with_kl)
                        gb_per_s = nbytes / (time.perf_counter() - t0) / 1e9
                        turns.setdefault((case, threads, name), []).append(gb_per_s)
                        if threads == 1:  # the kernel runs in this thread: its CPU time, which
                            # the neighbours of a shared machine move far less than the wall time
                            cpu = nbytes / (time.thread_time() - cpu0) / 1e9
                            turns.setdefault((case, "1 cpu", name), []).append(cpu)
    finally:
        kernels._fused = compiled
    first = next(iter(builds))[0]
    for (case, threads, name), values in turns.items():
        values = values[1:]
        ratios = [v / f for v, f in zip(values, turns[(case, threads, first)][1:], strict=True)]
        out.setdefault(name, {}).setdefault(case, {})[str(threads)] = {  # "1 cpu": GB per CPU second
            "gb_per_s": round(statistics.median(values), 2),
            "range": [round(min(values), 2), round(max(values), 2)],
            f"vs_{first}": round(statistics.median(ratios), 2),
        }
    torch.set_num_threads(max(workers))
    for numel in (576, 4096):  # SmolLM2's and a 7B model's hidden size
        a, b = g[:numel], t[:numel]
        for path in ("compiled", "eager"):
            with kernel_path(path):
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(200):
                        compare_tensors(a, b)
                    best = min(best, (time.perf_counter() - t0) / 200)
            out[f"fp32_{numel}_{path}_us_per_pair"] = round(best * 1e6, 1)
    return out


def kernel_entry(tree: Path | None, target) -> ctypes._CFuncPtr:
    """``llmflow_pass1`` of the kernel in source tree ``tree`` (None: this checkout) built for
    ``target`` (in llmflow's cache, keyed by the source)."""
    from llmflow import native
    from llmflow.compare import kernels

    library = kernels.LIBRARY
    if tree is not None:
        source = tree / "llmflow" / "compare" / "pass1.cpp"
        if not source.is_file():
            raise SystemExit(f"--old: {source} does not exist")
        library = native.NativeLibrary(source, "compare kernel of --old")
    fn = ctypes.CDLL(str(library.build(target=target))).llmflow_pass1
    fn.argtypes, fn.restype = kernels.ARGTYPES, ctypes.c_int
    return fn


def kernel_ab(old_tree: Path, targets: list, repeat: int, elements: int = 1 << 24) -> dict:
    """The compare kernel of this checkout against ``old_tree``'s, each build side by side: its
    C entry point (``llmflow_pass1``) on pairs of ``elements`` in memory (fp32, bf16, and an fp32
    golden against a bf16 target; 64 MiB of fp32 a side by default), rows of ``FUSED_CHUNK``, one
    thread,
    the two timed in turns in one process (``repeat`` turns after a warm-up); the median
    milliseconds of each, old / new of those, and whether the 20 values are the same bits."""
    from llmflow.compare import kernels

    gen = torch.Generator().manual_seed(0)
    g = torch.randn(elements, generator=gen)
    t = g * (1 + 1e-3 * torch.randn(g.shape, generator=gen))
    cases = {"fp32": (g, t), "bf16": (g.bfloat16(), t.bfloat16()), "fp32_vs_bf16": (g, t.bfloat16())}
    out: dict = {"cpu": cpu_model(), "old": str(old_tree), "repeat": repeat, "elements": g.numel()}
    for target in targets:
        fns = {"old": kernel_entry(old_tree, target), "new": kernel_entry(None, target)}
        for case, (a, b) in cases.items():
            ms: dict = {"old": [], "new": []}
            values = {}
            for turn in range(repeat + 1):  # the first turn warms up and is dropped
                for label, fn in fns.items():
                    res = torch.empty(kernels.N_VALUES, dtype=torch.float64)
                    t0 = time.perf_counter()
                    fn(a.data_ptr(), a.dtype == torch.bfloat16, b.data_ptr(), b.dtype == torch.bfloat16,
                       a.numel(), kernels.FUSED_CHUNK, 1, res.data_ptr(), 1)
                    if turn:
                        ms[label].append((time.perf_counter() - t0) * 1e3)
                    values[label] = res.numpy().tobytes()
            old_ms, new_ms = statistics.median(ms["old"]), statistics.median(ms["new"])
            out.setdefault(target.name, {})[case] = {
                "old_ms": round(old_ms, 2), "new_ms": round(new_ms, 2),
                "old_over_new": round(old_ms / new_ms, 3),
                "min_ms": [round(min(ms["old"]), 2), round(min(ms["new"]), 2)],
                "same_bits": values["old"] == values["new"]}
            print(json.dumps({"target": target.name, "case": case, **out[target.name][case]}), flush=True)
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def kernel_build(target) -> Iterator[None]:
    """Within: compares (in this process and in the worker processes it starts) use the kernel
    built for ``target``."""
    from llmflow.compare import kernels

    compiled, env = kernels.fused(), os.environ.get("LLMFLOW_KERNEL_TARGET")
    kernels._fused = kernels.for_target(target) or False
    os.environ["LLMFLOW_KERNEL_TARGET"] = target.name
    try:
        yield
    finally:
        kernels._fused = compiled
        if env is None:
            os.environ.pop("LLMFLOW_KERNEL_TARGET", None)
        else:
            os.environ["LLMFLOW_KERNEL_TARGET"] = env


class SwappedKernel:
    """Within: in-process compares call the kernel of source tree ``tree`` (None: this
    checkout's) built for ``target``. A compare large enough to start worker processes
    (~27,000 pairs at 2 workers) would load this checkout's kernel in them: the synthetic dumps
    here have ~120 pairs a GB."""

    def __init__(self, tree: Path | None, target) -> None:
        self.label = "old" if tree is not None else "new"
        self.tree, self.target = tree, target

    def __enter__(self) -> None:
        from llmflow.compare import kernels

        self.before = kernels._fused
        kernels._fused = kernels._wrap(kernel_entry(self.tree, self.target))

    def __exit__(self, *exc: object) -> None:
        from llmflow.compare import kernels

        kernels._fused = self.before


def kernels_of(old: Path | None, target) -> list[SwappedKernel]:
    """The kernels a turn times for ``target``: this checkout's, and with ``--old`` the old
    tree's after it."""
    return [SwappedKernel(None, target)] + ([SwappedKernel(old, target)] if old is not None else [])


@contextlib.contextmanager
def kernel_path(path: str) -> Iterator[None]:
    """Within: compare_tensors on the compiled kernel ("compiled") or on eager torch ("eager")."""
    from llmflow.compare import kernels

    compiled = kernels.fused()
    kernels._fused = compiled if path == "compiled" else False
    try:
        yield
    finally:
        kernels._fused = compiled


def smollm2_bench(tokens: int) -> dict:
    """Seconds and pairs/s of comparing real SmolLM2 dumps (fp32 golden, bf16 target)."""
    from llmflow.compare import kernels
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.models import encode_prompt, load_model

    tmp = Path(tempfile.mkdtemp(prefix="llmflow-bench-compare-", dir="/tmp"))
    out: dict = {"tokens": tokens}
    try:
        for side, dtype in (("golden", "float32"), ("target", "bfloat16")):
            loaded = load_model("smollm2", dtype=dtype)
            ids = encode_prompt(loaded.tokenizer, "Tell me a story about a dragon.")
            config = DumpConfig(dump_path=str(tmp / side), mode="module", token_range="all")
            dump_run(loaded, ids, tokens, config)
        for path in ("compiled", "eager") if kernels.fused() else ("eager",):
            with kernel_path(path):
                t0 = time.perf_counter()
                res = compare_dumps(tmp / "golden", tmp / "target", tmp / f"out-{path}",
                                    CompareOptions(workers=1, xlsx=False))
                dt = time.perf_counter() - t0
            s = res["summary"]
            out.update(pairs=s.pairs, bytes=s.bytes)
            out[path] = {"seconds": round(dt, 2), "pairs_per_s": round(s.pairs / dt)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from llmflow import native

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes-gb", type=float, nargs="+", default=[1.0, 8.0], help="total dump sizes (both sides)"
    )
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="worker counts (processes or kernel threads), each measured")
    ap.add_argument("--targets", nargs="+", default=None,
                    help="builds of the compare kernel to measure (default: every one this CPU runs)")
    ap.add_argument("--repeat", type=int, default=3, help="raw and llmflow measured in turn, this many times")
    ap.add_argument("--no-msprobe", action="store_true")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--kernel", action="store_true", help="time compare_tensors alone, in memory")
    ap.add_argument("--old", type=Path, default=None,
                    help="this checkout's compare kernel against this source tree's, side by side")
    ap.add_argument("--kl", nargs="+", choices=["all", "logits"], default=["all"],
                    help="the compare's --kl, each measured (logits: no KL on these dumps' rows)")
    ap.add_argument("--smollm2", action="store_true", help="compare real SmolLM2 dumps, compiled vs eager")
    ap.add_argument("--tokens", type=int, default=20, help="new tokens of the --smollm2 dumps")
    args = ap.parse_args(argv)
    runs = native.supported_targets()
    unknown = set(args.targets or ()) - {t.name for t in runs}
    if unknown:
        ap.error(f"--targets: this CPU runs {[t.name for t in runs]}, not {sorted(unknown)}")
    targets = [t for t in runs if args.targets is None or t.name in args.targets]
    if args.kernel and args.old:
        report = kernel_ab(args.old, targets, args.repeat)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
    if args.kernel:
        print(json.dumps(kernel_bench(args.workers, targets, args.repeat, tuple(args.kl))), flush=True)
        return 0
    if args.smollm2:
        print(json.dumps(smollm2_bench(args.tokens)), flush=True)
        return 0
    report: dict = {"workers": args.workers, "cpus": os.cpu_count(), "cpu": cpu_model(),
                    "targets": [t.name for t in targets], "sizes": []}
    for size in args.sizes_gb:
        tmp = Path(tempfile.mkdtemp(prefix="llmflow-bench-compare-", dir="/tmp"))
        try:
            g, t = tmp / "golden", tmp / "target"
            n = write_side(g, size / 2, 0, 0.0)
            write_side(t, size / 2, 1, 1e-3)
            # flush the dumps just written: writeback in flight otherwise takes CPU from what is
            # measured (4 GB on 2 cores: llmflow 2.9 GB/s without, 5.1 with)
            os.sync()
            raw_read(data_files(g, t))  # warm the page cache once, like a second run would see
            turns: dict = {}  # (target, workers) -> [(llmflow / raw, raw, llmflow)] in turn order
            for i in range(args.repeat):
                raw_s, raw_b, raw_cpu = raw_read(data_files(g, t))
                raw = {"seconds": round(raw_s, 2), "bytes": raw_b, "gb_per_s": round(raw_b / raw_s / 1e9, 3),
                       "cpu_seconds": round(raw_cpu, 3), "load_average": os.getloadavg()[0]}
                for target in targets:
                    with kernel_build(target):
                        for kernel in kernels_of(args.old, target):
                            for workers in args.workers:
                                for kl in args.kl:
                                    out = tmp / f"out{i}-{target.name}-{workers}-{kl}"
                                    with kernel:
                                        ours = llmflow_compare(g, t, out, workers, kl)
                                    shutil.rmtree(out, ignore_errors=True)
                                    turns.setdefault((target.name, workers, kernel.label, kl), []).append(
                                        (ours["gb_per_s"] / raw["gb_per_s"], raw, ours))
            row: dict = {"size_gb": size, "tensors_per_side": n, "llmflow": []}
            for (target_name, workers, label, kl), measured in turns.items():
                median, raw, ours = sorted(measured, key=lambda x: x[0])[len(measured) // 2]
                speeds = [m[2]["gb_per_s"] for m in measured]
                row["llmflow"].append({
                    "target": target_name, "workers": workers, **({"kernel": label} if args.old else {}),
                    "kl": kl,
                    "raw": raw, "llmflow": ours,
                    "gb_per_s_range": [min(speeds), max(speeds)],
                    "peak_anon_mib_over_start": max(m[2]["peak_anon_mib_over_start"] for m in measured),
                    "llmflow_vs_raw": round(median, 3),
                    "llmflow_vs_raw_turns": [round(r, 3) for r, _, _ in measured],  # in the order measured
                    # CPU seconds of the compare over cat's, per turn: what a shared machine's
                    # neighbours move far less than the wall time; and the load average of each turn
                    "cpu_vs_raw_turns": [round(m[2]["cpu_seconds"] / m[1]["cpu_seconds"], 2)
                                         if m[1]["cpu_seconds"] else None for m in measured],
                    "load_average_turns": [m[1]["load_average"] for m in measured],
                })
                print(json.dumps(row["llmflow"][-1]), flush=True)
            if not args.no_msprobe and size == min(args.sizes_gb):
                row["msprobe"] = msprobe_compare(g, t, tmp)
                theirs = row["msprobe"].get("gb_per_s")
                if theirs:
                    row["llmflow_vs_msprobe"] = {
                        f"{r['target']} {r['workers']} kl={r['kl']}{' ' + r['kernel'] if args.old else ''}":
                            round(r["llmflow"]["gb_per_s"] / theirs, 1)
                        for r in row["llmflow"]}
                print(json.dumps({k: row.get(k) for k in ("msprobe", "llmflow_vs_msprobe")}), flush=True)
            report["sizes"].append(row)
        finally:
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
