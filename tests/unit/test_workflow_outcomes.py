"""A run's exit code and last line come from what its stages concluded (ctx.set_outcome): the most
severe outcome that no downstream outcome supersedes; cached stages keep theirs; crashes and bad
input beat outcomes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from llmflow import cli as cli_package
from llmflow.cli import main
from llmflow.workflow import run_workflow
from llmflow.workflow.state import STATE_FILE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workflow_helpers import REPO, llmflow, ran, write_workflow  # noqa: E402

TWO_BRANCHES = """
    name: branches
    params:
      left: {type: string, default: pass}
      right: {type: string, default: pass}
    stages:
      left:
        uses: {HELPERS}:OutcomeStage
        with: {status: "${params.left}", headline: "left says ${params.left}"}
      right:
        uses: {HELPERS}:OutcomeStage
        with: {status: "${params.right}", headline: "right says ${params.right}"}
"""

# compare -> mid (judges nothing) -> bisect -> report (judges nothing); side is a branch of its own
CHAIN = """
    name: chain
    params:
      compare: {type: string, default: fail}
      bisect: {type: string, default: pass}
      side: {type: string, default: ""}
    stages:
      compare:
        uses: {HELPERS}:OutcomeStage
        with: {status: "${params.compare}", headline: "compare: rows ${params.compare}"}
      mid:
        uses: {HELPERS}:EchoStage
        needs: [compare]
        with: {value: "${stages.compare.outputs.verdict_file}"}
      bisect:
        uses: {HELPERS}:OutcomeStage
        needs: [mid]
        with: {status: "${params.bisect}", headline: "bisect: ${params.bisect}"}
      report:
        uses: {HELPERS}:EchoStage
        needs: [bisect]
        with: {value: "${stages.bisect.outputs.verdict_file}"}
      side:
        uses: {HELPERS}:OutcomeStage
        with: {status: "${params.side}", headline: "side: ${params.side}"}
"""


def cli(capsys, *args: str) -> tuple[int, list[str]]:
    rc = main(list(args))
    return rc, capsys.readouterr().out.splitlines()


def summary_of(rd: Path) -> dict:
    data = json.loads((rd / "summary.json").read_text())
    jsonschema.validate(data, json.loads((REPO / "schemas" / "summary.schema.json").read_text()))
    return data


@pytest.mark.parametrize(
    ("left", "right", "code", "last"),
    [
        ("pass", "pass", 0, "PASSED (left says pass (also pass: right))"),
        ("fail", "inconclusive", 1, "FAILED: left says fail"),
        ("inconclusive", "fail", 1, "FAILED: right says fail"),
        ("inconclusive", "pass", 3, "INCONCLUSIVE: left says inconclusive"),
        ("pass", "inconclusive", 3, "INCONCLUSIVE: right says inconclusive"),
        ("fail", "fail", 1, "FAILED: left says fail (also fail: right)"),
        ("", "pass", 0, "PASSED (right says pass)"),
        ("", "", 0, "PASSED (2 done)"),  # nothing judged the target: the stage counts, as ever
    ],
)
def test_two_branches_most_severe_decides(tmp_path, capsys, left, right, code, last):
    wf = str(write_workflow(tmp_path, TWO_BRANCHES))
    rd = tmp_path / "run"
    rc, out = cli(capsys, "run", wf, "--run-dir", str(rd), "--set", f"left={left}", "--set", f"right={right}")
    assert (rc, out[-1]) == (code, last)
    summary = summary_of(rd)
    assert summary["status"] == {0: "passed", 1: "failed", 3: "inconclusive"}[code]
    if left or right:
        assert summary["outcome"]["status"] == {0: "pass", 1: "fail", 3: "inconclusive"}[code]
    else:
        assert summary["outcome"] is None


@pytest.mark.parametrize(
    ("compare", "bisect", "side", "code", "last"),
    [
        ("fail", "pass", "", 0, "PASSED (bisect: pass)"),  # the bisect speaks for the compare
        ("fail", "inconclusive", "", 3, "INCONCLUSIVE: bisect: inconclusive"),
        ("pass", "fail", "", 1, "FAILED: bisect: fail"),
        ("fail", "", "", 1, "FAILED: compare: rows fail"),  # no later judge: the compare stands
        ("fail", "pass", "inconclusive", 3, "INCONCLUSIVE: side: inconclusive"),
        ("inconclusive", "pass", "fail", 1, "FAILED: side: fail"),
    ],
)
def test_downstream_outcome_supersedes(tmp_path, capsys, compare, bisect, side, code, last):
    wf = str(write_workflow(tmp_path, CHAIN))
    rd = tmp_path / "run"
    sets = ["--set", f"compare={compare}", "--set", f"bisect={bisect}", "--set", f"side={side}"]
    rc, out = cli(capsys, "run", wf, "--run-dir", str(rd), *sets)
    assert (rc, out[-1]) == (code, last)
    outcome = summary_of(rd)["outcome"]
    assert outcome["superseded"] == (["compare"] if bisect else [])  # transitively, through mid
    if bisect:
        assert f"compare: {compare}: compare: rows {compare}  (superseded by a stage that needs it)" in out


def test_cached_rerun_keeps_the_outcome(tmp_path, capsys):
    wf = str(write_workflow(tmp_path, CHAIN))
    rd = tmp_path / "run"
    sets = ["--set", "bisect=", "--set", "side=inconclusive"]
    first = cli(capsys, "run", wf, "--run-dir", str(rd), *sets)
    assert first[0] == 1 and first[1][-1] == "FAILED: compare: rows fail"
    state = json.loads((rd / "compare" / STATE_FILE).read_text())
    assert state["outcome"] == {"status": "fail", "headline": "compare: rows fail"}
    assert json.loads((rd / "mid" / STATE_FILE).read_text())["outcome"] is None

    rc, out = cli(capsys, "run", wf, "--run-dir", str(rd), *sets)
    assert (rc, out[-1]) == (1, "FAILED: compare: rows fail")
    assert ran(rd) == ["compare", "mid", "bisect", "report", "side"]  # nothing ran the second time
    summary = summary_of(rd)
    assert all(s["status"] == "cached" for s in summary["stages"].values())
    side = summary["stages"]["side"]["outcome"]
    assert side == {"status": "inconclusive", "headline": "side: inconclusive"}
    assert summary["outcome"] == {"status": "fail", "headline": "compare: rows fail",
                                  "stages": ["compare"], "superseded": []}


def test_stale_downstream_outcome_does_not_speak(tmp_path):
    """--only re-runs the compare; the bisect's stored outcome was about the old compare."""
    wf = write_workflow(tmp_path, CHAIN)
    rd = tmp_path / "run"
    assert run_workflow(wf, run_dir=rd).exit_code == 0  # compare fail, bisect pass
    res = run_workflow(wf, run_dir=rd, only=["compare"], set_params=["compare=inconclusive"])
    assert res.stages["bisect"].status == "cached"  # kept (not selected) but stale
    assert (res.exit_code, res.reason) == (3, "compare: rows inconclusive")
    res = run_workflow(wf, run_dir=rd, set_params=["compare=inconclusive"])
    assert res.stages["bisect"].status == "done" and res.exit_code == 0


@pytest.mark.parametrize(("user", "code"), [(False, 1), (True, 2)])
def test_a_failed_stage_beats_outcomes(tmp_path, capsys, user, code):
    wf = str(write_workflow(tmp_path, f"""
        name: crash
        stages:
          judge: {{uses: "{{HELPERS}}:OutcomeStage", with: {{status: pass, headline: fine}}}}
          broken: {{uses: "{{HELPERS}}:FailStage", with: {{user: {str(user).lower()}}}}}
    """))
    rc, out = cli(capsys, "run", wf, "--run-dir", str(tmp_path / "run"))
    assert rc == code and out[-1].startswith("FAILED: stage 'broken' failed")
    assert summary_of(tmp_path / "run")["status"] == "failed"


def test_run_help_documents_the_exit_codes():
    proc = llmflow("run", "--help")
    assert proc.returncode == 0
    codes = ("0  PASSED (headline)", "1  FAILED: headline", "2  FAILED: reason", "3  INCONCLUSIVE: headline")
    for line in codes:
        assert line in proc.stdout
    assert "superseded" in proc.stdout
    doc = cli_package.__doc__
    assert "3    INCONCLUSIVE" in doc and "130  interrupted" in doc
