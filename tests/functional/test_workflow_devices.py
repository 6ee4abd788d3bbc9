"""A run whose stages name a device this machine lacks stops before anything runs: the target dump
on ``npu:0`` is refused before the golden dump ahead of it (hours at 70B), one line naming the
stage and the device, exit 2, no run dir made. A stage the run reuses is not asked: a run dir
brought from the NPU host reruns its compare on a CPU host."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO, assert_bad_input, llmflow, write_workflow  # noqa: E402

HELD = '''
import os

from llmflow.stages.base import Stage


class Held(Stage):
    """Holds the device named in HELD_DEVICE while it runs (none where it is unset)."""

    type = "held"
    outputs = {"ok": "true"}

    def resources(self, params):
        device = os.environ.get("HELD_DEVICE")
        return {f"device:{device}"} if device else set()

    def run(self, ctx):
        return {"ok": True}
'''


def test_the_shipped_bisect_with_a_target_on_a_missing_npu_stops_before_the_golden_dump(tmp_path):
    proc = llmflow("run", str(REPO / "workflows" / "llama2_bisect.yaml"), "--set", "target_device=npu:0",
                   "--set", "target_model=smollm2", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert_bad_input(proc, "stage 'dump-npu': device 'npu:0': torch_npu is not installed")
    assert not (tmp_path / "run").exists()


def test_a_stage_reused_from_the_run_dir_is_not_asked_for_its_device(tmp_path):
    (tmp_path / "held.py").write_text(HELD, encoding="utf-8")
    wf = write_workflow(tmp_path, """
        name: devices
        stages:
          on-device: {uses: "held.py:Held"}
          after: {uses: "held.py:Held", needs: [on-device]}
    """)
    run = ("run", str(wf), "--run-dir", str(tmp_path / "run"))
    assert llmflow(*run, cwd=tmp_path).returncode == 0  # made where the device was (no device named)
    missing = {"HELD_DEVICE": "npu:7"}
    proc = llmflow(*run, cwd=tmp_path, env=missing)  # both reused: nothing to ask
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("PASSED"), proc.stdout
    proc = llmflow(*run, "--only", "after", "--force", cwd=tmp_path, env=missing)
    assert_bad_input(proc, "stage 'after': device 'npu:7': torch_npu is not installed")
    assert "on-device" not in proc.stdout.strip().splitlines()[-1]
