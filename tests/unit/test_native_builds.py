"""llmflow's compiled kernels on every CPU class. The compare kernel is built per instruction
set (x86-64-v4, -v3, -v2, aarch64, the compiler's baseline), never with -march=native, and the
best build the CPU runs is chosen by its features: every build this CPU runs passes the check
against eager torch, builds that share FMA give the same bits, and the same source builds for
aarch64 and passes the check under qemu-user where a cross-compiler and qemu are installed. The
dump's statistics kernel likewise: every build gives the same bits, the aarch64 build under
qemu-user included; the dump's capture sources compile for aarch64."""

from __future__ import annotations

import math
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from llmflow import native
from llmflow.compare import kernels

REPO = Path(__file__).resolve().parents[2]


def _compiler_or_skip() -> None:
    if native._compiler() is None:
        pytest.skip("no C++ compiler: llmflow runs on eager torch here")


def _cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows and a tail, |d| in each of the second loop's three forms, each dtype pairing."""
    gen = torch.Generator().manual_seed(5)
    cases = []
    for n in (1, 1001, 2 * kernels.FUSED_CHUNK + 13):
        for spread in (1e-3, 0.3, 3.0):
            a = torch.randn(n, generator=gen) * 3
            b = a + spread * torch.randn(n, generator=gen)
            cases += [(a, b), (a, b.bfloat16()), (a.bfloat16(), b), (a.bfloat16(), b.bfloat16())]
    return cases


def test_every_build_this_cpu_runs_passes_the_self_check() -> None:
    _compiler_or_skip()
    targets = native.supported_targets()
    assert targets and targets[-1] == native.BASELINE
    cases = [(a, b, kernels.pass1(a, b)) for a, b in _cases()]
    for target in targets:
        kernel = kernels.for_target(target)
        assert kernel is not None, target.name
        assert "-march=native" not in (kernels.library_dir(target) / "build.txt").read_text()
        assert kernels._agrees(kernel), target.name  # checked in this run, not only once per build
        for a, b, eager in cases:
            torch.testing.assert_close(kernel(a, b), eager, rtol=1e-5, atol=1e-9)


def test_builds_with_fma_give_the_same_bits() -> None:
    """The sums run over 16 lanes on registers of any width, in one order: x86-64-v3 (256-bit)
    and -v4 (512-bit) give the same bits, so compare output does not depend on the CPU class."""
    _compiler_or_skip()
    fma = [t for t in native.supported_targets() if t.name in ("x86-64-v3", "x86-64-v4")]
    if len(fma) < 2:
        pytest.skip("this CPU runs fewer than two of x86-64-v3/v4")
    first, second = (kernels.for_target(t) for t in fma)
    for a, b in _cases():
        for softmax in (True, False):  # the KL's sums, and the form without them
            bits = [kernel(a, b, softmax).view(torch.int64) for kernel in (first, second)]
            assert torch.equal(*bits)


def test_the_best_build_the_cpu_runs_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    names = lambda: [t.name for t in native.supported_targets()]  # noqa: E731
    monkeypatch.setattr(native, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "cpu_features", lambda: native._X86_V3 | {"sse", "sse2"})
    assert names() == ["x86-64-v3", "x86-64-v2", "baseline"]  # AVX2 without AVX-512
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset())  # no /proc/cpuinfo
    assert names() == ["baseline"]
    monkeypatch.setattr(native, "machine", lambda: "aarch64")
    assert names() == ["armv8-a", "baseline"]
    monkeypatch.setattr(native, "machine", lambda: "riscv64")
    assert names() == ["baseline"]
    monkeypatch.setattr(native, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "cpu_features", lambda: native._X86_V4)
    monkeypatch.setenv("LLMFLOW_KERNEL_TARGET", "x86-64-v2")
    assert names() == ["x86-64-v2"]


def test_a_target_the_cpu_lacks_sends_compares_to_eager_torch(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(native, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "cpu_features", lambda: native._X86_V2)
    monkeypatch.setenv("LLMFLOW_KERNEL_TARGET", "x86-64-v4")
    monkeypatch.setattr(kernels, "_fused", None)
    assert kernels.fused() is None
    assert "no build target runs on this CPU" in caplog.text


def test_the_cache_key_covers_the_target_and_the_compiler(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    _compiler_or_skip()
    targets = native.TARGETS["x86_64"]
    assert len({kernels.library_dir(t) for t in targets}) == len(targets)
    before = kernels.library_dir(native.BASELINE)
    wrapper = tmp_path / "my-c++"  # another compiler (here: the same one behind a script)
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which(native._compiler())} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    assert kernels.library_dir(native.BASELINE) != before


def _cross_tools_or_skip() -> tuple[str, str]:
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        pytest.skip("no aarch64 cross-compiler or qemu-user here "
                    "(apt-get install g++-aarch64-linux-gnu qemu-user)")
    return cxx, qemu


def test_the_aarch64_build_passes_the_self_check_under_qemu(tmp_path: Path) -> None:
    """The source llmflow builds on aarch64 (armv8-a: NEON, 128-bit registers, 4 sweeps a row)
    compiled by a cross-compiler with the aarch64 target's flags, run by qemu-user on the checks
    of ``kernels._agrees`` and a few more."""
    _, qemu = _cross_tools_or_skip()
    program = _aarch64_program(tmp_path, kernels.LIBRARY, "pass1_main.cpp")

    def emulated(a: torch.Tensor, b: torch.Tensor, softmax: bool = True) -> torch.Tensor:
        head = struct.pack("<qiiqii", a.numel(), a.dtype == torch.bfloat16, b.dtype == torch.bfloat16,
                           kernels.FUSED_CHUNK, 2, softmax)
        data = head + a.contiguous().view(torch.uint8).numpy().tobytes() + b.contiguous().view(
            torch.uint8).numpy().tobytes()
        done = subprocess.run([qemu, str(program)], input=data, capture_output=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert done.returncode == 0, done.stderr
        return torch.frombuffer(bytearray(done.stdout), dtype=torch.float64)

    assert kernels._agrees(emulated)
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(1001, generator=gen) * 3
    for b in (a + 1e-3 * torch.randn(1001, generator=gen),
              (a + 0.3 * torch.randn(1001, generator=gen)).bfloat16()):
        torch.testing.assert_close(emulated(a, b), kernels.pass1(a, b), rtol=1e-5, atol=1e-9)


def test_every_build_of_the_statistics_kernel_gives_the_same_bits() -> None:
    """A dump's statistics do not depend on the CPU class: products are rounded apart (no FMA)
    in every build, so each build this CPU runs passes the check and gives the same bits."""
    import ctypes

    from llmflow.dump import stats

    _compiler_or_skip()
    argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    builds = [stats.CpuStats(native.STATS.function("llmflow_stats", argtypes, None,
                                                    lambda f: stats._agrees(stats.CpuStats(f)), target))
              for target in native.supported_targets()]
    gen = torch.Generator().manual_seed(8)
    cases = [(torch.randn(n, generator=gen) * 3).to(dtype)
             for n in (5, 100, 8192 + 3) for dtype in stats.KERNEL_DTYPES if dtype.is_floating_point]
    for t in cases:
        code = stats.KERNEL_DTYPES[t.dtype]
        results = {tuple(build(t, code)) for build in builds}
        assert len(results) == 1, (t.dtype, t.numel(), results)


def _aarch64_program(tmp_path: Path, library: native.NativeLibrary, main: str) -> Path:
    """``library``'s source and the program ``main`` (tests/fixtures) cross-compiled for
    llmflow's aarch64 target with the flags llmflow builds that library with, linked statically."""
    cxx, _ = _cross_tools_or_skip()
    (target,) = [t for t in native.TARGETS["aarch64"] if t.name == "armv8-a"]
    program = tmp_path / main.removesuffix(".cpp")
    flags = [f for f in native._BASE_FLAGS if f != "-shared"]
    sources = [str(library.source), str(REPO / "tests" / "fixtures" / main)]
    build = subprocess.run([cxx, *flags, *target.flags, *library.flags, "-fopenmp", "-static", *sources,
                            "-o", str(program)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    return program


def test_the_aarch64_build_of_the_statistics_kernel_gives_this_machines_bits(tmp_path: Path) -> None:
    """The statistics of a dump made on an aarch64 host (Kunpeng) are the bits an x86 host's
    build gives (products rounded apart everywhere, no FMA): the same source cross-compiled with
    the aarch64 target's flags, run by qemu-user on the cases of ``stats._agrees`` and more,
    against the build this CPU runs."""
    from llmflow.dump import stats

    _compiler_or_skip()
    _, qemu = _cross_tools_or_skip()
    program = _aarch64_program(tmp_path, native.STATS, "stats_main.cpp")
    local = stats.for_target(None)
    assert local is not None
    here = stats.CpuStats(local)
    gen = torch.Generator().manual_seed(9)
    special = torch.tensor([1.0, float("inf"), -2.0, float("-inf"), 0.5] * 20)
    floats = [torch.randn(n, generator=gen) * 3 for n in (1, 7, 64, 1000, 70_001)]
    floats += [special, torch.cat([special, torch.tensor([float("nan")])]), torch.full((99,), 3e38)]
    cases = [t.to(dtype) for dtype in stats.KERNEL_DTYPES if dtype.is_floating_point for t in floats]
    cases += [torch.tensor([3, -7, 2**40, 0]), torch.arange(1000) - 300, (torch.arange(77) * 5).int()]
    data = b"".join(struct.pack("<iq", stats.KERNEL_DTYPES[t.dtype], t.numel())
                    + t.contiguous().view(torch.uint8).numpy().tobytes() for t in cases)
    done = subprocess.run([qemu, str(program)], input=data, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    emulated = torch.frombuffer(bytearray(done.stdout), dtype=torch.float64).view(len(cases), 6)
    for t, row in zip(cases, emulated.tolist(), strict=True):
        want = here(t, stats.KERNEL_DTYPES[t.dtype])
        # NaN is NaN: an x86 CPU's default NaN has the sign bit set, an ARM CPU's has not
        same = [(math.isnan(g) and math.isnan(w)) or struct.pack("<d", g) == struct.pack("<d", w)
                for g, w in zip(row, want, strict=True)]
        assert all(same), (t.dtype, t.numel(), row, want)


@pytest.mark.parametrize("library", [native.CAPTURE, native.TENSOR_META], ids=lambda lib: lib.name)
def test_the_dump_capture_sources_compile_for_aarch64(library: native.NativeLibrary) -> None:
    """The dump's capture in C and its torch C++ API reader build on an aarch64 host against its
    own Python and torch; here the cross-compiler checks they compile for aarch64 against this
    machine's headers (which it cannot link: this torch is x86's)."""
    cxx, _ = _cross_tools_or_skip()
    (target,) = [t for t in native.TARGETS["aarch64"] if t.name == "armv8-a"]
    flags = [f for f in native._BASE_FLAGS if f != "-shared"]
    done = subprocess.run([cxx, *flags, *target.flags, *library.flags, "-w", "-fsyntax-only",
                           str(library.source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
