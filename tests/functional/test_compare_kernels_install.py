"""`python -m llmflow.compare.kernels`, the install step, builds the compiled kernel on a machine
whose cache is empty (it once printed "unavailable" there and left every compare on eager torch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def test_install_step_builds_kernels_into_an_empty_cache(tmp_path: Path) -> None:
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler: compare runs on eager torch here")
    env = {**os.environ, "LLMFLOW_CACHE": str(tmp_path), "LLMFLOW_FUSED": "1"}
    done = subprocess.run([sys.executable, "-m", "llmflow.compare.kernels"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    packages = list(tmp_path.glob("kernels/*/pass1.so"))
    assert len(packages) == 1, done.stdout
    assert str(packages[0].parent) in done.stdout
