"""C++ kernels compiled on this machine on first use, cached, and loaded through ctypes.

llmflow's hot loops that torch serves badly are a few hundred lines of plain C++ (GCC/Clang
vector extensions, no intrinsics, no Python headers): the compare's one-pass metrics
(``compare/pass1.cpp``) and the statistics of a dumped tensor (``dump/stats.cpp``). Each source
is one ``NativeLibrary``. ``function()`` returns one of its ctypes functions, building the
library first when this machine has none (under a second with ``c++ -O3 -march=native``) and
checking it against the caller's eager torch reference once per build; None sends the caller to
that reference.

Why ctypes and a compiler at run time rather than a wheel or a torch extension: the package stays
pure Python (one wheel for every platform), ``-march=native`` uses the host's full vector ISA,
ctypes releases the GIL during the call, and a missing compiler costs speed, never correctness.

The build goes into ``<llmflow cache>/kernels/<machine>-<hash>/`` where the hash covers the
source, the flags and the CPU's feature flags: ``-march=native`` code is never run on another CPU
that shares the cache (a cluster's home directory). ``build.txt`` records the command that
worked; a failed build is written to ``build-failed.txt`` so later processes go to the eager
path at once instead of running the compiler again; ``build(force=True)`` tries again: the
install step runs ``python -m llmflow.native``, which builds every library in ``LIBRARIES``.
``LLMFLOW_FUSED=0`` turns every kernel off. ``CXX`` picks the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_BASE_FLAGS = ("-O3", "-std=gnu++17", "-fPIC", "-shared")
# tried in order: the host's full vector ISA with OpenMP; without OpenMP (Apple clang has none:
# one thread); the compiler's baseline ISA
FLAG_CHOICES: tuple[tuple[str, ...], ...] = (("-march=native", "-fopenmp"), ("-march=native",), ())
_FAILED = "build-failed.txt"
_log = logging.getLogger(__name__)


def disabled() -> bool:
    """``LLMFLOW_FUSED=0`` (or false/no/off): every caller uses its eager torch path."""
    return os.environ.get("LLMFLOW_FUSED", "1").lower() in ("0", "false", "no", "off")


class NativeLibrary:
    """One C++ source built into one shared library, for this CPU, in the llmflow cache."""

    def __init__(self, source: Path, what: str):
        self.source = source
        self.what = what  # for messages: "compare kernel"
        self.name = source.stem + ".so"

    def library_dir(self) -> Path:
        """Where this source's build for this CPU (and these flags) lives."""
        from llmflow.models import cache_dir

        return cache_dir() / "kernels" / f"{platform.machine()}-{_build_key(self.source, FLAG_CHOICES)}"

    def compiled(self) -> bool:
        """Is the library built here (loading it then takes milliseconds)?"""
        return not disabled() and (self.library_dir() / self.name).is_file()

    def build(self, force: bool = False) -> Path:
        """Compile the source into the cache (atomically: a concurrent build is as good as ours).

        Raises ``RuntimeError`` with the compiler's message when no flag choice compiles; the
        failure is remembered (``build-failed.txt``), so later calls raise at once until ``force``.
        """
        final = self.library_dir()
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
                for flags in FLAG_CHOICES:
                    cmd = [cxx, *_BASE_FLAGS, *flags, str(self.source), "-o", tmp]
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
        message = f"{self.what}: cannot compile {self.source}: " + " | ".join(errors)
        failed.write_text(message + "\n", encoding="utf-8")
        raise RuntimeError(message)

    def function(self, symbol: str, argtypes: list[Any], restype: Any,
                 agrees: Callable[[Any], bool]) -> Any | None:
        """The ctypes function ``symbol``, built first if need be, once ``agrees(function)`` (the
        caller's check against its eager torch reference) has passed for this build; else None,
        with one warning naming why (no compiler, a failed check): the caller's eager path.

        The check runs once per build, not per process (a ``verified`` file beside the library):
        the same library computes the same thing in every process.
        """
        try:
            fn = getattr(ctypes.CDLL(str(self.build())), symbol)
            fn.argtypes, fn.restype = argtypes, restype
            verified = self.library_dir() / "verified"
            if verified.is_file() or agrees(fn):
                verified.touch()
                return fn
            _log.warning("%s disagrees with eager torch; using eager torch", self.what)
        except Exception as exc:  # no compiler, an odd platform ...: eager torch works everywhere
            _log.warning("%s unavailable (%s); using eager torch (slower)", self.what, exc)
        return None


@functools.cache
def _build_key(source: Path, flag_choices: tuple[tuple[str, ...], ...]) -> str:
    h = hashlib.sha256(source.read_bytes())
    h.update(repr((_BASE_FLAGS, flag_choices)).encode())
    h.update(_cpu_features().encode())
    return h.hexdigest()[:16]


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or next(
        (c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


_PACKAGE = Path(__file__).parent
# every kernel llmflow has, in one place
PASS1 = NativeLibrary(_PACKAGE / "compare" / "pass1.cpp", "compare kernel")
STATS = NativeLibrary(_PACKAGE / "dump" / "stats.cpp", "dump statistics kernel")
LIBRARIES = (PASS1, STATS)


if __name__ == "__main__":  # python -m llmflow.native: build every kernel now (install time)
    for library in LIBRARIES:
        try:
            print(f"llmflow: {library.what} built in {library.build(force=True).parent}")
        except (RuntimeError, OSError) as exc:  # no compiler: llmflow still works, on eager torch
            print(f"llmflow: {exc}; llmflow uses eager torch instead (slower)")
