"""Do two versions of llmflow write the same compare rows? For changes meant to make the compare
faster and nothing else.

    .venv/bin/python benchmarks/check_compare_rows.py --old /tmp/llmflow-old [--workers 1 2 4]

``--old`` is a source tree of the version to check against (``git archive REF | tar -x -C DIR``);
the new one is this checkout. Writes several golden/target dump pairs under /tmp (fp32 against
fp32 and against bf16 and fp16, 4 MiB tensors and many small ones, lengths that leave tails, NaN
and Inf, integer tensors, a fake decoder's module outputs and logits over several steps), runs
``llmflow compare`` on each pair in a subprocess with the old tree once and with this one at each
``--workers`` count, and compares every CSV byte for byte. Prints one line per pair and exits 1
when any CSV differs (naming it), 0 when all are identical.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from compare_helpers import model_items, write_dump  # noqa: E402

from llmflow.formats.base import Entry  # noqa: E402
from llmflow.formats.llmflow_dump import DumpDirWriter  # noqa: E402


def write_flat(path: Path, tensors: list[torch.Tensor], steps: int = 1) -> None:
    """A dump of flat tensors as layer outputs, the same list at each step."""
    writer = DumpDirWriter(path, meta={"data_mode": "tensor"})
    for step in range(steps):
        batch, entries = {}, []
        for i, x in enumerate(tensors):
            batch[str(i)] = x
            entries.append(Entry(step=step, rank=0, name=f"model.layers.{i}", kind="output", index="0",
                                 level="module", order=i, dtype=str(x.dtype).removeprefix("torch."),
                                 shape=tuple(x.shape), module_type="LlamaDecoderLayer", key=str(i)))
        writer.write_batch(batch, entries)
    writer.close()


def flat_pair(root: Path, sizes: list[int], target_dtype: torch.dtype, noise: float,
              odd: bool = False, steps: int = 1) -> tuple[Path, Path]:
    gen = torch.Generator().manual_seed(7)
    golden = [torch.randn(n, generator=torch.Generator().manual_seed(i)) * 3 for i, n in enumerate(sizes)]
    target = [(x * (1 + noise * torch.randn(x.shape, generator=gen))).to(target_dtype) for x in golden]
    if odd:  # NaN and Inf on either side, an integer pair equal and one not, a large shift
        golden[0][5], target[0][7] = float("nan"), float("inf")
        golden[1] = torch.arange(sizes[1])
        target[1] = torch.arange(sizes[1])
        golden[2] = torch.arange(sizes[2]) % 7
        target[2] = (torch.arange(sizes[2]) % 7).flip(0)
        target[3] = (golden[3] + 5).to(target_dtype)
    write_flat(root / "g", golden, steps)
    write_flat(root / "t", target, steps)
    return root / "g", root / "t"


def dump_pairs(tmp: Path) -> dict[str, tuple[Path, Path]]:
    big = 1 << 20  # 4 MiB of fp32
    rows = 1 << 16  # one kernel row
    pairs = {
        "fp32_4MiB": flat_pair(tmp / "fp32_4MiB", [big] * 24, torch.float32, 1e-3),
        "bf16_tails": flat_pair(tmp / "bf16_tails", [1, 1001, 2 * rows + 13, big + 5, 3 * big],
                                torch.bfloat16, 1e-2, steps=3),
        "fp16_small": flat_pair(tmp / "fp16_small", [576] * 300 + [4096] * 100, torch.float16, 1e-3),
        "nan_inf_int": flat_pair(tmp / "nan_inf_int", [rows + 1, 100, 257, big, 33], torch.float32, 1e-4,
                                 odd=True, steps=2),
    }
    model = tmp / "model"
    write_dump(model / "g", {s: model_items(seed=s, n_layers=6, hidden=64) for s in range(4)})
    write_dump(model / "t", {s: model_items(seed=s, n_layers=6, hidden=64, noise=1e-3,
                                            dtype=torch.bfloat16) for s in range(4)})
    pairs["model_bf16"] = (model / "g", model / "t")
    return pairs


def compare(tree: Path, golden: Path, target: Path, out: Path, workers: int | None) -> dict[str, bytes]:
    args = [sys.executable, "-m", "llmflow", "compare", "-gp", str(golden), "-mp", str(target),
            "-o", str(out), "--no-xlsx"] + (["--workers", str(workers)] if workers else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=out.parent,
                          env={**os.environ, "PYTHONPATH": str(tree), "NO_COLOR": "1"})
    if done.returncode not in (0, 1):
        raise SystemExit(f"{tree}: llmflow compare exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.csv"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="source tree of the version to check against")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts of the new run")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)
    if not (args.old / "llmflow" / "__init__.py").is_file():
        ap.error(f"--old: {args.old} holds no llmflow/ source tree")
    tmp = Path(tempfile.mkdtemp(prefix="llmflow-check-rows-", dir="/tmp"))
    differ = []
    try:
        for name, (golden, target) in dump_pairs(tmp).items():
            old = compare(args.old, golden, target, tmp / f"{name}-old", None)
            if not old:
                differ.append(f"{name}: the old version wrote no CSV")
            for workers in args.workers:
                new = compare(REPO, golden, target, tmp / f"{name}-new-{workers}", workers)
                bad = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
                differ += [f"{name}: {k} differs (workers {workers})" for k in bad]
            lines = sum(v.count(b"\n") for v in old.values())
            print(f"{name}: {len(old)} CSV, {lines} lines, workers {args.workers}: "
                  f"{'identical' if not any(d.startswith(name + ':') for d in differ) else 'DIFFERENT'}",
                  flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(differ) if differ else "every CSV identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
