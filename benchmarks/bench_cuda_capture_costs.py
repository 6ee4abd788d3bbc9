"""What each per-tensor step of a dump's capture costs the forward thread on a CUDA GPU.

Run on a machine with a CUDA device (seconds)::

    python benchmarks/bench_cuda_capture_costs.py

Times, in microseconds of the calling thread per call (20,000 calls after 200 to warm up, the
device synchronised before the clock starts and after it stops), the ways a capture can keep a
decode step's small tensor for the writer: a copy on the device (``clone``), a CUDA event per copy
against the current stream's key (``copies.StreamKey``: what the writer's one event per step
needs), a pinned host buffer and its copy (tensor dumps), a reference and its version counter
(what a tensor needs that nothing changes before the writer reads it), and the statistics of a
step's worth of copies at once (``batched_stats``: one read-back). docs/benchmarks.md has an
H100's figures.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from llmflow.dump.stats import batched_stats

CALLS = 20_000


def per_call(fn: Callable[[], object], calls: int = CALLS) -> float:
    """Microseconds of this thread per call of ``fn``."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_capture_costs: no CUDA device visible to torch")
    gen = torch.Generator(device="cuda").manual_seed(0)
    small = torch.randn(1, 1, 576, device="cuda", generator=gen)  # a decode step's hidden state
    wide = torch.randn(1, 32, 1536, device="cuda", generator=gen)
    held: list[tuple[torch.Tensor, int]] = []

    def hold() -> None:
        held.append((small, small._version))
        if len(held) > 5000:
            held.clear()

    def event() -> None:
        torch.cuda.Event().record()

    rows: dict[str, Callable[[], object]] = {
        "clone() of 576 floats": small.clone,
        "clone() of 32x1536 floats": wide.clone,
        "CUDA event created and recorded": event,
        "current stream's key": lambda: torch._C._cuda_getCurrentStream(small.get_device()),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "empty pinned tensor + non-blocking copy": lambda: torch.empty(
            small.shape, dtype=small.dtype, pin_memory=True).copy_(small, non_blocking=True),
        "reference + version counter": hold,
    }
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print("| per captured tensor | us |\n|---|---|")
    for name, fn in rows.items():
        print(f"| {name} | {per_call(fn):.2f} |")
    # a decode step of SmolLM2 by modules: ~430 tensors of a few shapes
    shapes = [(1, 1, 576)] * 300 + [(1, 1, 1536)] * 90 + [(1, 9, 1, 64)] * 30 + [(1, 3, 1, 64)] * 10
    step = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    us = per_call(lambda: batched_stats(step), 200)
    print(f"| batched_stats of {len(step)} tensors (one step) | {us:.0f} |")


if __name__ == "__main__":
    main()
