"""scripts/install.sh into an environment that already has a torch (a GPU box's CUDA build, the torch
torch_npu was built against): it keeps that torch, installs llmflow beside it, and a second run
with nothing changed does nothing.

The environment is a fresh venv that sees the test venv's site-packages through a .pth file, so
its torch is the test venv's (installed outside the venv: pip cannot replace it in place, and
the test checks that no torch of its own appeared) and nothing is downloaded again.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_install_keeps_the_torch_it_finds(tmp_path):
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        env={}, cwd=tmp_path).stdout.strip())
    (purelib / "test-venv-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "TORCH_SPEC",
                                                               "FORCE_TORCH")}
    env.update(VENV=str(venv), EXTRAS="test", LLMFLOW_CACHE=str(tmp_path / "cache"))

    done = _run(["bash", REPO / "scripts" / "install.sh"], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"keeping torch {torch.__version__} in {venv}" in done.stdout
    assert f"done (torch {torch.__version__}," in done.stdout
    assert not list(purelib.glob("torch*")), "install.sh installed a torch of its own"
    where = _run([python, "-c", "import torch, llmflow; print(torch.__file__, llmflow.__file__)"],
                 env=env, cwd=tmp_path).stdout.split()
    assert where == [torch.__file__, str(REPO / "llmflow" / "__init__.py")]
    assert (venv / ".llmflow-installed").read_text().startswith(f"torch {torch.__version__}; ")

    start = time.monotonic()
    again = _run(["bash", REPO / "scripts" / "install.sh"], env=env, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr
    assert time.monotonic() - start < 10
