"""The code stays ruff-clean (the project's lint settings are in pyproject.toml)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "llmflow", "plugins",
                           "tests", "benchmarks", "scripts"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
