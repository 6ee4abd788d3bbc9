"""`python -m llmflow.native`, the install step, builds every compiled kernel (the compare's and
the dump's statistics) on a machine whose cache is empty (an earlier install step once printed
"unavailable" there and left every compare on eager torch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def test_install_step_builds_kernels_into_an_empty_cache(tmp_path: Path) -> None:
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler: llmflow runs on eager torch here")
    env = {**os.environ, "LLMFLOW_CACHE": str(tmp_path), "LLMFLOW_FUSED": "1"}
    done = subprocess.run([sys.executable, "-m", "llmflow.native"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for name in ("pass1.so", "stats.so"):
        built = list(tmp_path.glob(f"kernels/*/{name}"))
        assert len(built) == 1, done.stdout
        assert str(built[0].parent) in done.stdout
