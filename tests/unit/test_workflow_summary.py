"""summary.json on a disk that refuses writes: the small form, then a line on stderr, never a crash."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from llmflow.workflow import summary as summary_module
from llmflow.workflow.model import Workflow
from llmflow.workflow.result import StageResult
from llmflow.workflow.summary import SummaryWriter


def _writer(tmp_path: Path) -> SummaryWriter:
    wf = Workflow(path=tmp_path / "wf.yaml", display="wf.yaml", name="w", description="", params={},
                  stages={})
    results = {"a": StageResult("a", "echo", status="failed", error="boom", traceback="Traceback ...")}
    return SummaryWriter(tmp_path / "summary.json", wf, {"p": 1}, results)


def test_a_failed_write_is_retried_small(tmp_path, monkeypatch):
    real = summary_module.atomic_write_json
    calls = []

    def full_once(path, data, **how):
        calls.append(data)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data, **how)

    monkeypatch.setattr(summary_module, "atomic_write_json", full_once)
    _writer(tmp_path).write("failed")
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["status"] == "failed"
    assert written["stages"] == {"a": {"type": "echo", "status": "failed", "error": "boom"}}


def test_when_even_the_small_write_fails_stderr_says_so_once(tmp_path, monkeypatch, capsys):
    def always_full(path, data, **how):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(summary_module, "atomic_write_json", always_full)
    writer = _writer(tmp_path)
    writer.write("running")
    writer.write("failed")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0] and "No space left on device" in err[0], err
    assert writer.data["status"] == "failed"


@pytest.fixture(autouse=True)
def _no_stray_files(tmp_path):
    yield
    assert {p.name for p in tmp_path.iterdir()} <= {"summary.json"}
