"""env-check on real dumps taken under different deterministic settings, and against this process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from llmflow.stages.env_check import EnvCheckStage, live_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from checks_helpers import ctx, real_dump  # noqa: E402


def _dump_with(tmp: Path, name: str, deterministic: bool, monkeypatch) -> Path:
    was = torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("HCCL_DETERMINISTIC", "true" if deterministic else "false")
    monkeypatch.setenv("ASCEND_HOME_PATH", f"/opt/{name}/Ascend")
    try:
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        return real_dump(tmp, name=name, mode="none", new_tokens=1, token_range=[0])
    finally:
        torch.use_deterministic_algorithms(was)


def test_different_deterministic_settings_are_numerics_relevant(tmp_path, monkeypatch):
    golden = _dump_with(tmp_path, "golden", True, monkeypatch)
    target = _dump_with(tmp_path, "target", False, monkeypatch)
    c = ctx(tmp_path, {"golden": str(golden), "target": str(target)}, "env")
    out = EnvCheckStage().run(c)
    report = json.loads(Path(out["report_file"]).read_text())
    items = {it["key"]: it for it in report["items"]}
    det = items["torch_settings.deterministic_algorithms"]
    assert (det["golden"], det["target"], det["numerics_relevant"]) == (True, False, True)
    hccl = items["env_vars.HCCL_DETERMINISTIC"]
    assert (hccl["golden"], hccl["target"], hccl["numerics_relevant"]) == ("true", "false", True)
    assert items["env_vars.ASCEND_HOME_PATH"]["numerics_relevant"] is False
    s = c.summary["env_diff"]
    assert s["differences"] == len(report["items"]) >= 3
    assert s["numerics_relevant"] == sum(it["numerics_relevant"] for it in report["items"]) >= 2
    assert s["items"][0]["numerics_relevant"]


def test_live_against_a_dump(tmp_path, monkeypatch):
    dump = real_dump(tmp_path, mode="none", new_tokens=1, token_range=[0], dtype="float16")
    live = live_env()
    assert set(live) == set(json.loads((dump / "env.json").read_text()))
    c = ctx(tmp_path, {"golden": "live", "target": str(dump)}, "env")
    EnvCheckStage().run(c)
    keys = {it["key"]: it for it in c.summary["env_diff"]["items"]}
    # the dump has a model (dtype, config), the live process has none
    assert keys["torch_settings.model_dtype"]["target"] == "float16"
    assert keys["torch_settings.model_dtype"]["numerics_relevant"]
    assert keys["model_config.model_class"]["missing"] == "golden"


def test_identical_dumps_have_no_difference(tmp_path):
    a = real_dump(tmp_path, name="a", mode="none", new_tokens=1, token_range=[0])
    c = ctx(tmp_path, {"golden": str(a), "target": str(a / "env.json")}, "env")
    EnvCheckStage().run(c)
    assert c.summary["env_diff"]["differences"] == 0
