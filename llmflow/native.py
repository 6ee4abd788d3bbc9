"""C++ compiled on this machine on first use, cached, and loaded: kernels through ctypes, and the
dump's capture as a Python extension module.

llmflow's hot loops that torch serves badly are a few hundred lines of plain C++ (GCC/Clang
vector extensions, no intrinsics, no Python headers): the compare's one-pass metrics
(``compare/pass1.cpp``) and the statistics of a dumped tensor (``dump/stats.cpp``). Each source
is one ``NativeLibrary``. ``function()`` returns one of its ctypes functions, building the
library first when this machine has none (a second or two with ``c++ -O3``) and checking it
against the caller's eager torch reference once per build; None sends the caller to that
reference.

Each source is built per instruction set (``TARGETS``: on x86-64 the microarchitecture levels
x86-64-v4 (AVX-512), -v3 (AVX2, FMA) and -v2 (SSE4.2), on aarch64 armv8-a (NEON), everywhere the
compiler's baseline), never with ``-march=native``, and the best build this CPU runs is chosen
from its feature flags (``/proc/cpuinfo``; where there is none, the baseline build). A build
that does not compile, or fails its check, is passed over for the next.
``LLMFLOW_KERNEL_TARGET=x86-64-v3`` (a target's name) keeps that build only: for measuring the
builds side by side, or for a CPU whose flags mislead.

Why ctypes and a compiler at run time rather than a wheel or a torch extension: the package stays
pure Python (one wheel for every platform), each CPU gets the vector ISA it has, ctypes releases
the GIL during the call, and a missing compiler costs speed, never correctness.

One source is not a kernel but Python's own work done in C: the dump's capture
(``dump/capture.cpp``: the walk over each recorded call's values, the index entries, API mode's
dispatch), where a ctypes call (~1-2 us) would cost more than the work. It is built against this
interpreter's headers (``sysconfig``), once per Python version (the flags, and so the build's
hash, name the ABI), for the baseline target only (it has no vector code), and loaded with
``extension()``; where there is no compiler or no Python headers, its callers keep their Python
methods, which define what it does (tests check that both write the same dump). Another reads a
tensor's metadata for that capture through torch's C++ API (``dump/tensor_meta.cpp``): built
against the headers and libraries of the torch this process imports (``torch_api=True``: the
flags name torch's version and path), loaded through ctypes; without it the capture reads
through torch's Python bindings.

A build goes into ``<llmflow cache>/kernels/<machine>-<target>-<hash>/`` where the hash covers
what the build depends on: the source, the flags and the compiler (its resolved path, size and
time). No build depends on the CPU it was made on, so a cache shared by a cluster's machines
(a home directory) serves each of them the build its CPU runs. ``build.txt`` records the command
that worked; a failed build is written to ``build-failed.txt`` so later processes pass over it at
once instead of running the compiler again; ``build(force=True)`` tries again: the install step
runs ``python -m llmflow.native``, which builds every library in ``LIBRARIES`` for the best
target. ``LLMFLOW_FUSED=0`` turns every kernel and the compiled capture off. ``CXX`` picks the
compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_BASE_FLAGS = ("-O3", "-std=gnu++17", "-fPIC", "-shared")
# tried in order for each target: with OpenMP; without (Apple clang has none: one thread)
OPENMP_CHOICES: tuple[tuple[str, ...], ...] = (("-fopenmp",), ())
_FAILED = "build-failed.txt"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """One instruction set a library is built for: the compiler flags, and the CPU features
    (as /proc/cpuinfo names them) a CPU needs to run the build."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str] = frozenset()


_X86_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
BASELINE = Target("baseline", ())  # the compiler's default ISA: runs wherever the compiler's output runs
# per machine (platform.machine(), lower case), best first: the x86-64 microarchitecture levels
# (v4: AVX-512, v3: AVX2 and FMA, v2: SSE4.2); on aarch64 NEON is part of the base ISA
TARGETS: dict[str, tuple[Target, ...]] = {
    "x86_64": (Target("x86-64-v4", ("-march=x86-64-v4",), _X86_V4),
               Target("x86-64-v3", ("-march=x86-64-v3",), _X86_V3),
               Target("x86-64-v2", ("-march=x86-64-v2",), _X86_V2),
               BASELINE),
    "aarch64": (Target("armv8-a", ("-march=armv8-a",)), BASELINE),
}
_MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def disabled() -> bool:
    """``LLMFLOW_FUSED=0`` (or false/no/off): every caller uses its eager torch path."""
    return os.environ.get("LLMFLOW_FUSED", "1").lower() in ("0", "false", "no", "off")


def machine() -> str:
    """This machine's architecture, as ``TARGETS`` names it."""
    name = platform.machine().lower()
    return _MACHINE_ALIASES.get(name, name)


def supported_targets() -> tuple[Target, ...]:
    """The targets this CPU runs, best first (``LLMFLOW_KERNEL_TARGET=name`` keeps that one only,
    or none where this CPU lacks it)."""
    features = cpu_features()
    found = tuple(t for t in TARGETS.get(machine(), (BASELINE,)) if t.needs <= features)
    wanted = os.environ.get("LLMFLOW_KERNEL_TARGET")
    return tuple(t for t in found if t.name == wanted) if wanted else found


class NativeLibrary:
    """One C++ source built into one shared library per target, in the llmflow cache."""

    def __init__(self, source: Path, what: str, flags: tuple[str, ...] = (), openmp: bool = True,
                 per_target: bool = True, torch_api: bool = False):
        self.source = source
        self.per_target = per_target  # built per instruction set (vector code), or for the baseline only
        self.what = what  # for messages: "compare kernel"
        self._flags = flags
        self.torch_api = torch_api  # compiled and linked against this process's torch
        self.openmp = openmp  # try OPENMP_CHOICES (vector kernels), or build without OpenMP
        self.name = source.stem + ".so"
        self.target: Target | None = None  # the build ``function`` returned last
        self._extensions: dict[str, Any] = {}  # module name -> the loaded module (None: unavailable)

    @property
    def flags(self) -> tuple[str, ...]:
        """The compiler's flags for every target, after the target's own (torch's headers and
        ABI for a ``torch_api`` library)."""
        return (*self._flags, *(_torch_api_flags()[0] if self.torch_api else ()))

    @property
    def link(self) -> tuple[str, ...]:
        """What goes after the source: the libraries to link (torch's, for a ``torch_api`` one)."""
        return _torch_api_flags()[1] if self.torch_api else ()

    def library_dir(self, target: Target | None = None) -> Path:
        """Where this source's build for ``target`` (by default the best this CPU runs) lives."""
        from llmflow.models import cache_dir

        target = target or self._best()
        flags = (*self.flags, *self.link) if self.openmp else (*self.flags, *self.link, "(no OpenMP)")
        key = _build_key(self.source, target, flags, _compiler_identity())
        return cache_dir() / "kernels" / f"{machine()}-{target.name}-{key}"

    def compiled(self, target: Target | None = None) -> bool:
        """Is the library built here for ``target`` (loading it then takes milliseconds)?"""
        return not disabled() and (self.library_dir(target) / self.name).is_file()

    def build(self, force: bool = False, target: Target | None = None) -> Path:
        """Compile the source for ``target`` into the cache (atomically: a concurrent build is as
        good as ours); by default for the best target this CPU runs that compiles.

        Raises ``RuntimeError`` with the compiler's message when it does not compile; the failure
        is remembered (``build-failed.txt``), so later calls raise at once until ``force``.
        """
        if target is not None or not self.per_target:
            return self._build(target or BASELINE, force)
        errors = []
        for candidate in supported_targets():
            try:
                return self._build(candidate, force)
            except RuntimeError as exc:
                errors.append(str(exc))
        raise RuntimeError(" | ".join(errors) or f"{self.what}: no build target runs on this CPU")

    def _build(self, target: Target, force: bool) -> Path:
        final = self.library_dir(target)
        lib, failed = final / self.name, final / _FAILED
        if lib.is_file():
            return lib
        if failed.is_file() and not force:
            raise RuntimeError(failed.read_text(encoding="utf-8").strip())
        final.mkdir(parents=True, exist_ok=True)
        cxx = _compiler()
        errors = []
        if cxx is None:
            errors.append("no C++ compiler (c++, g++ or clang++; or set CXX)")
        else:
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=final)
            os.close(fd)
            try:
                for openmp in OPENMP_CHOICES if self.openmp else ((),):
                    flags = [*_BASE_FLAGS, *target.flags, *self.flags, *openmp]
                    cmd = [cxx, *flags, str(self.source), *self.link, "-o", tmp]
                    try:
                        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                    except (OSError, subprocess.SubprocessError) as exc:  # CXX names no program ...
                        errors.append(f"{' '.join(cmd)}: {exc}")
                        break
                    if done.returncode == 0:
                        os.replace(tmp, lib)
                        failed.unlink(missing_ok=True)
                        (final / "build.txt").write_text(" ".join(cmd) + "\n", encoding="utf-8")
                        return lib
                    errors.append(f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}")
            finally:
                Path(tmp).unlink(missing_ok=True)
        message = f"{self.what}: cannot compile {self.source} for {target.name}: " + " | ".join(errors)
        failed.write_text(message + "\n", encoding="utf-8")
        raise RuntimeError(message)

    def function(self, symbol: str, argtypes: list[Any], restype: Any,
                 agrees: Callable[[Any], bool], target: Target | None = None,
                 fallback: str = "eager torch") -> Any | None:
        """The ctypes function ``symbol`` of the best build this CPU runs (or of ``target``),
        built first if need be, once ``agrees(function)`` (the caller's check against its eager
        torch reference) has passed for that build. A target that does not compile or disagrees
        is passed over for the next; None, with one warning naming why (no compiler, a failed
        check), sends the caller to its eager path (``fallback`` names it in the warning).
        ``self.target`` names the build returned.

        The check runs once per build, not per process (a ``verified`` file beside the library):
        the same library computes the same thing in every process.
        """
        reasons = []
        for candidate in (target,) if target else supported_targets() if self.per_target else (BASELINE,):
            try:
                fn = getattr(ctypes.CDLL(str(self._build(candidate, force=False))), symbol)
                fn.argtypes, fn.restype = argtypes, restype
                verified = self.library_dir(candidate) / "verified"
                if verified.is_file() or agrees(fn):
                    verified.touch()
                    if reasons:
                        _log.warning("%s: %s; using the %s build", self.what, "; ".join(reasons),
                                     candidate.name)
                    self.target = candidate
                    return fn
                reasons.append(f"the {candidate.name} build disagrees with {fallback}")
            except Exception as exc:  # no compiler, an odd platform ...: eager torch works everywhere
                reasons.append(f"{candidate.name} unavailable ({exc})")
        _log.warning("%s unavailable (%s); using %s (slower)", self.what,
                     "; ".join(reasons) or "no build target runs on this CPU", fallback)
        return None

    def extension(self, module: str) -> Any | None:
        """The source as the Python extension module ``module`` (its ``PyInit_<module>``), built
        for this interpreter with the compiler's baseline target, or None with one warning where
        it cannot be built or loaded (the caller then keeps its Python path). Loaded once per
        process: every caller gets the same module (and types)."""
        if module in self._extensions:
            return self._extensions[module]
        self._extensions[module] = None
        try:
            path = self.build()
            loader = importlib.machinery.ExtensionFileLoader(module, str(path))
            spec = importlib.util.spec_from_loader(module, loader)
            if spec is None:
                raise ImportError(f"no module spec for {path}")
            found = importlib.util.module_from_spec(spec)
            loader.exec_module(found)
            self.target = BASELINE
            self._extensions[module] = found
            return found
        except Exception as exc:  # no compiler, no Python headers, an odd platform ...
            _log.warning("%s unavailable (%s); using its Python path (slower)", self.what, exc)
            return None

    def _best(self) -> Target:
        if not self.per_target:
            return BASELINE
        supported = supported_targets()
        return supported[0] if supported else BASELINE


@functools.cache
def _build_key(source: Path, target: Target, flags: tuple[str, ...], compiler: str) -> str:
    """A hash of what the build depends on: the source, the flags, the compiler (its resolved
    path, size and time: an upgrade or another CXX is another build). Not the CPU: no build
    uses -march=native, and each CPU picks among the targets by its own features."""
    h = hashlib.sha256(source.read_bytes())
    h.update(repr((_BASE_FLAGS, OPENMP_CHOICES, target.flags, flags)).encode())
    h.update(compiler.encode())
    return h.hexdigest()[:16]


def _compiler_identity() -> str:
    cxx = _compiler()
    path = shutil.which(cxx) if cxx else None
    if path is None:
        return f"no compiler: {cxx}"
    real = os.path.realpath(path)
    stat = os.stat(real)
    return f"{real} {stat.st_size} {stat.st_mtime_ns}"


@functools.cache
def cpu_features() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere: the baseline build runs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _compiler() -> str | None:
    return os.environ.get("CXX") or next(
        (c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


_PACKAGE = Path(__file__).parent
# every kernel llmflow has, in one place
PASS1 = NativeLibrary(_PACKAGE / "compare" / "pass1.cpp", "compare kernel")
# The statistics kernel's float32 sums of squares are chains of a += v * v, which GCC fuses into
# FMAs or not by the CPU it tunes for (not on AMD Zen): products rounded apart, the statistics a
# dump writes have the same bits whatever the CPU and the target
STATS = NativeLibrary(_PACKAGE / "dump" / "stats.cpp", "dump statistics kernel", flags=("-ffp-contract=off",))


def _python_extension_flags() -> tuple[str, ...]:
    """What a build against this interpreter's C API needs: its headers, and (the build key
    covers the flags) its ABI, so each Python version gets a build of its own."""
    flags = [f"-I{sysconfig.get_paths()['include']}", f"-DLLMFLOW_PYTHON_ABI={sys.implementation.cache_tag}"]
    if sys.platform == "darwin":  # the interpreter provides the C API's symbols when it loads the module
        flags += ["-undefined", "dynamic_lookup"]
    return tuple(flags)


@functools.cache
def _torch_api_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(compile flags, link flags) of a source built against this process's torch: its headers,
    its C++ ABI, its version (in the build's hash: a torch upgrade is another build) and its
    libraries, found again at load time through the run path."""
    import torch

    root = Path(torch.__file__).parent
    lib = root / "lib"
    compile_flags = (*_python_extension_flags(), f"-I{root / 'include'}",
                     f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
                     f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
                     f"-DLLMFLOW_TORCH={torch.__version__}")
    link_flags = (f"-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}")
    return compile_flags, link_flags


# the dump's capture in C (a Python extension module: see capture.cpp)
CAPTURE = NativeLibrary(_PACKAGE / "dump" / "capture.cpp", "dump capture in C",
                        flags=_python_extension_flags(), openmp=False, per_target=False)
# the capture's tensor metadata through torch's C++ API (see tensor_meta.cpp)
TENSOR_META = NativeLibrary(_PACKAGE / "dump" / "tensor_meta.cpp", "dump tensor metadata reader",
                            openmp=False, per_target=False, torch_api=True)
LIBRARIES = (PASS1, STATS, CAPTURE, TENSOR_META)


if __name__ == "__main__":  # python -m llmflow.native: build every kernel now (install time)
    for library in LIBRARIES:
        try:
            print(f"llmflow: {library.what} built in {library.build(force=True).parent}")
        except (RuntimeError, OSError) as exc:  # no compiler: llmflow still works, on eager torch
            print(f"llmflow: {exc}; llmflow uses eager torch instead (slower)")
