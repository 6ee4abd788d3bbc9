"""`make demo`: the demo's target has a planted bug, so llmflow finding it (exit 1) is success; any
other outcome fails the target. Run through make with the install and llmflow stood in for."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_demo(tmp_path: Path, llmflow_exit: int) -> subprocess.CompletedProcess:
    stub = tmp_path / "llmflow"
    stub.write_text(f"#!/bin/sh\necho 'FAILED: the planted bug'\nexit {llmflow_exit}\n")
    stub.chmod(0o755)
    return subprocess.run(["make", "-s", "-C", str(REPO), "demo", "DEMO_INSTALL=true", f"LLMFLOW={stub}"],
                          capture_output=True, text=True, timeout=60)


def test_found_planted_bug_is_success_and_says_so(tmp_path):
    done = make_demo(tmp_path, 1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == \
        "make demo: OK, llmflow found the planted bug (it exits 1 when it finds a fault)"


@pytest.mark.parametrize("code", [0, 2, 3])
def test_any_other_outcome_fails(tmp_path, code):
    done = make_demo(tmp_path, code)
    assert done.returncode != 0 and f"got exit {code}" in done.stderr


def test_demo_installs_without_the_test_extras():
    text = (REPO / "Makefile").read_text()
    assert "DEMO_INSTALL ?= EXTRAS= ./scripts/install.sh" in text
    assert '-e ".${EXTRAS:+[$EXTRAS]}"' in (REPO / "scripts" / "install.sh").read_text()
