"""The commands that only read workflows start without importing torch (a few seconds of start-up
otherwise): each runs in a fresh interpreter the user's way and ``-X importtime`` lists every
module it imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

REPO = Path(__file__).resolve().parents[2]
BISECT = str(REPO / "workflows" / "llama2_bisect.yaml")


def imported_modules(*args: str) -> tuple[int, set[str]]:
    """The exit code of ``llmflow ARGS`` and every module it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "llmflow", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    modules = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
               if line.startswith("import time:") and line.count("|") == 2}
    return done.returncode, modules


@pytest.mark.parametrize("args", [("validate", BISECT), ("plan", BISECT), ("workflows",), ("schema",),
                                  ("validate", "overflow_hunt"), ("validate", "weight_check")])
def test_workflow_commands_never_import_torch(args):
    rc, modules = imported_modules(*args)
    assert rc == 0
    assert "llmflow.cli" in modules  # (the listing is there to read)
    heavy = {m for m in modules if m.split(".")[0] in ("torch", "transformers", "numpy", "safetensors")}
    assert not heavy, sorted(heavy)[:10]


def test_the_dump_api_still_imports_from_the_top():
    script = ("import sys, llmflow.dump as d; assert 'torch' not in sys.modules; "
              "from llmflow import DumpConfig, register_hook; "
              "print(d.DumpConfig is DumpConfig, callable(register_hook), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert done.stdout.split() == ["True", "True", "True"], done.stderr
