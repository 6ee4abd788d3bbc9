"""`llmflow compare` run the user's way with each build of the compare kernel: the x86-64-v3
(AVX2) and x86-64-v4 (AVX-512) builds write byte-identical CSVs, and a build the CPU cannot run
(``LLMFLOW_KERNEL_TARGET`` naming another) leaves the compare on eager torch with the same verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from path_helpers import checkout_path

from llmflow import native
from llmflow.formats.base import Entry
from llmflow.formats.llmflow_dump import DumpDirWriter

REPO = Path(__file__).resolve().parents[2]
SIZES = (1, 1001, 2 * (1 << 16) + 13)  # one element, a tail, rows and a tail


def write_dump(path: Path, noise: float, dtype: torch.dtype) -> None:
    writer = DumpDirWriter(path, meta={"data_mode": "tensor"})
    gen = torch.Generator().manual_seed(1)
    tensors, entries = {}, []
    for i, n in enumerate(SIZES):
        x = torch.randn(n, generator=torch.Generator().manual_seed(i)) * 3
        tensors[str(i)] = (x + noise * torch.randn(n, generator=gen)).to(dtype)
        entries.append(Entry(step=0, rank=0, name=f"model.layers.{i}", kind="output", index="0",
                             level="module", order=i, dtype=str(dtype).removeprefix("torch."),
                             shape=(n,), module_type="LlamaDecoderLayer", key=str(i)))
    writer.write_batch(tensors, entries)
    writer.close()


def compare(tmp: Path, out: str, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, bytes]]:
    done = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(tmp / "g"), "-mp",
                           str(tmp / "t"), "-o", str(tmp / out), "--no-xlsx"],
                          capture_output=True, text=True, timeout=300, cwd=tmp,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO), **env})
    return done, {p.name: p.read_bytes() for p in sorted((tmp / out).glob("*.csv"))}


@pytest.fixture
def dumps(tmp_path: Path) -> Path:
    write_dump(tmp_path / "g", 0.0, torch.float32)
    write_dump(tmp_path / "t", 0.01, torch.bfloat16)
    return tmp_path


def test_avx2_and_avx512_builds_write_the_same_csv(dumps: Path) -> None:
    names = {t.name for t in native.supported_targets()}
    if native._compiler() is None or not {"x86-64-v3", "x86-64-v4"} <= names:
        pytest.skip("needs a C++ compiler and a CPU that runs both x86-64-v3 and -v4")
    v3, v3_csv = compare(dumps, "v3", LLMFLOW_KERNEL_TARGET="x86-64-v3")
    v4, v4_csv = compare(dumps, "v4", LLMFLOW_KERNEL_TARGET="x86-64-v4")
    assert v3.returncode == v4.returncode and v3.stdout.splitlines()[-1] == v4.stdout.splitlines()[-1]
    assert v3_csv and v3_csv == v4_csv


def test_a_build_this_cpu_cannot_run_leaves_the_compare_on_eager_torch(dumps: Path) -> None:
    default, _ = compare(dumps, "default")
    other, csv = compare(dumps, "other", LLMFLOW_KERNEL_TARGET="no-such-target")
    assert other.returncode == default.returncode, other.stderr
    assert other.stdout.splitlines()[-1] == default.stdout.splitlines()[-1]
    assert csv and "compare kernel unavailable" in other.stderr
