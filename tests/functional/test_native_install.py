"""`python -m llmflow.native`, the install step, builds every compiled kernel (the compare's and
the dump's statistics), the dump's compiled capture and its tensor reader on a machine whose
cache is empty (an earlier install step once printed "unavailable" there and left every compare
on eager torch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch


def _python_headers() -> bool:
    return (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()


def test_install_step_builds_kernels_into_an_empty_cache(tmp_path: Path) -> None:
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler: llmflow runs on eager torch here")
    env = {**os.environ, "LLMFLOW_CACHE": str(tmp_path), "LLMFLOW_FUSED": "1"}
    done = subprocess.run([sys.executable, "-m", "llmflow.native"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # (the capture is a Python extension: it needs this interpreter's headers as well; its tensor
    # reader torch's headers too)
    torch_headers = _python_headers() and (Path(torch.__file__).parent / "include" / "torch").is_dir()
    for name in ("pass1.so", "stats.so", *(("capture.so",) if _python_headers() else ()),
                 *(("tensor_meta.so",) if torch_headers else ())):
        built = list(tmp_path.glob(f"kernels/*/{name}"))
        assert len(built) == 1, done.stdout
        assert str(built[0].parent) in done.stdout


def test_a_fresh_process_loads_the_capture_the_install_step_built(tmp_path: Path) -> None:
    """The capture built at install (the baseline target, this interpreter's ABI) is the one a
    dump then loads, without building again."""
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")) or not _python_headers():
        pytest.skip("no C++ compiler or no Python headers: the capture runs its Python methods here")
    env = {**os.environ, "LLMFLOW_CACHE": str(tmp_path), "LLMFLOW_FUSED": "1"}
    subprocess.run([sys.executable, "-m", "llmflow.native"], env=env, capture_output=True, timeout=300,
                   check=True)
    (built,) = tmp_path.glob("kernels/*/capture.so")
    before = built.stat().st_mtime_ns
    code = "import llmflow.dump.capture as c; print(c._NATIVE.__file__)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(built) and built.stat().st_mtime_ns == before
