"""A fault in one expert's weights is named down to the op that carries it: transformers computes
the experts with ``torch._grouped_mm``, which API capture records (a private torch op that does
arithmetic), so the first bad op is that grouped matmul, not the routing-weight ``mul`` after it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from example_faults import faulty_module  # noqa: E402

from llmflow.dump.api import PRIVATE_ARITHMETIC, SKIPPED, api_name  # noqa: E402
from llmflow.models import load_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAYER = 1


def test_private_matmuls_are_recorded_and_private_helpers_are_not():
    assert api_name(torch._grouped_mm) == "_grouped_mm"
    assert api_name(torch._scaled_mm) == "_scaled_mm"
    assert api_name(torch._C._get_tracing_state) is None
    assert api_name(torch._assert) is None
    assert not PRIVATE_ARITHMETIC & SKIPPED
    assert all(name.startswith("_") and not name.startswith("__") for name in PRIVATE_ARITHMETIC)


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_expert_fault_first_bad_op_is_the_grouped_matmul(family, tmp_path):
    model = f"tiny-{family}:layers=4"
    run_dir = tmp_path / "runs" / "moe"
    cmd = [sys.executable, "-m", "llmflow", "run", "llama2_bisect", "--run-dir", str(run_dir),
           "--progress", "plain", "--set", f"golden_model={model}", "--set", f"target_model={model}",
           "--set", "max_new_tokens=4",
           "--set", f"target_patch={REPO / 'plugins' / 'example_faults.py'}:scale_expert_layer_{LAYER}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    want = faulty_module(load_model(model).model, "scale_expert", LAYER)
    v = json.loads((run_dir / "bisect" / "verdict.json").read_text())
    assert v["first_bad_module"] == want and v["first_bad_expert"] == 1, v["headline"]
    op = v["first_bad_op"]
    # the experts' second grouped matmul (down_proj, whose expert 1 is scaled), not the mul after it
    assert op and op.startswith(want + "/"), op
    assert re.fullmatch(r"_?grouped_mm\.1", op.rsplit("/", 1)[1]), op
    assert last.startswith("FAILED") and f"first bad op {op}" in last, last
