"""llmflow.seeding and the seed stage."""

from __future__ import annotations

import json
import os
import random

import torch

from llmflow.seeding import DETERMINISTIC_ENV, apply_settings, determinism_settings, seed_all
from llmflow.workflow import run_workflow


def test_determinism_settings_is_pure_json(monkeypatch):
    monkeypatch.delenv("HCCL_DETERMINISTIC", raising=False)
    s = determinism_settings(7, True)
    assert json.loads(json.dumps(s)) == s
    assert s["seed"] == 7 and s["deterministic"] is True
    assert s["env"] == {
        "PYTHONHASHSEED": "7",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "HCCL_DETERMINISTIC": "true",
        "LCCL_DETERMINISTIC": "1",
        "ATB_MATMUL_SHUFFLE_K_ENABLE": "0",
        "ATB_LLM_LCOC_ENABLE": "0",
    }
    assert "HCCL_DETERMINISTIC" not in os.environ
    loose = determinism_settings(7, False)
    assert loose["env"] == {"PYTHONHASHSEED": "7"} and loose["torch"]["cudnn_benchmark"] is True


def test_seed_all_seeds_and_switches(monkeypatch):
    for key in [*DETERMINISTIC_ENV, "PYTHONHASHSEED"]:
        monkeypatch.delenv(key, raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        applied = seed_all(42)
        a = (random.random(), torch.rand(3).tolist())
        seed_all(42)
        assert (random.random(), torch.rand(3).tolist()) == a
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["PYTHONHASHSEED"] == "42"
        assert os.environ["ATB_LLM_LCOC_ENABLE"] == "0" and os.environ["LCCL_DETERMINISTIC"] == "1"
        assert {"random", "numpy", "torch"} <= set(applied["seeded"])
        apply_settings(determinism_settings(1, False))
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.benchmark = False


def test_seed_stage_outputs_and_summary(tmp_path):
    wf = tmp_path / "wf.yaml"
    wf.write_text("name: s\nstages:\n  seed: {uses: seed, with: {seed: 5, deterministic: false}}\n")
    res = run_workflow(wf, run_dir=tmp_path / "run")
    out = res.stages["seed"].outputs
    assert out["settings"] == determinism_settings(5, False)
    assert out["settings_file"] == str(tmp_path / "run" / "seed" / "seed_settings.json")
    assert json.loads((tmp_path / "run" / "seed" / "seed_settings.json").read_text()) == out["settings"]
    assert res.summary["seed"] == out["settings"]
