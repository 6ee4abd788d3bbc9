"""The typed results of a compare and a run: ``compare_summary.json`` written by ``llmflow compare``
(a subprocess, the user's way) reads back as ``CompareSummary`` and writes the same JSON again;
a file that does not fit is one line naming the file and the field; summary.json of a real run
reads as ``RunSummary`` and validates against the committed schema, which is the one generated
from the types."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from path_helpers import checkout_path

from llmflow.errors import UserError
from llmflow.results.codec import from_json, to_json
from llmflow.results.compare import (
    CompareOutcome,
    CompareSummary,
    Coverage,
    Divergence,
    JudgedAs,
    LevelCoverage,
    LevelSummary,
    LogitsAgreement,
    Matching,
    MissingStep,
    SummaryRow,
    read_compare_summary,
)
from llmflow.results.schemas import summary_schema
from llmflow.results.summary import (
    ReportBlock,
    RunOutcome,
    StageOutcome,
    StageSummary,
    read_run_summary,
    run_summary_from_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import model_items, write_dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": checkout_path(REPO)}


def llmflow(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=ENV)


def _layer_2_scaled(i: int, x: torch.Tensor) -> torch.Tensor:
    return x * 1.5 if i == 2 else x


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Golden and a bf16 target laid out as the dump stage writes them (``<side>/dump`` beside
    ``<side>/generation.json``): layer 2 of the target is off from step 0, the texts part at
    token 1 (step 2's rows are diverged), and the target lacks step 3. Also a statistics-only
    pair (no logits agreement)."""
    root = tmp_path_factory.mktemp("results")
    write_dump(root / "golden" / "dump", {s: model_items(seed=s) for s in range(4)})
    write_dump(root / "target" / "dump",
               {s: model_items(seed=s, dtype=torch.bfloat16, fault=_layer_2_scaled) for s in range(3)})
    for side, ids in (("golden", [5, 6, 7, 8]), ("target", [5, 9, 9, 9])):
        (root / side / "generation.json").write_text(json.dumps({"prompt": "p", "output_ids": ids}))
    for side, noise in (("stats_golden", 0.0), ("stats_target", 1e-3)):
        write_dump(root / side, {s: model_items(seed=s, noise=noise) for s in (0, 1)}, data_mode="statistics")
    return root


@pytest.fixture(scope="module")
def compared(dumps: Path) -> Path:
    """``llmflow compare`` of the faulty pair: exit 1, FAILED."""
    out = dumps / "out"
    proc = llmflow("compare", "-gp", str(dumps / "golden" / "dump"), "-mp", str(dumps / "target" / "dump"),
                   "-o", str(out))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("FAILED: ")
    return out / "compare_summary.json"


def test_compare_summary_reads_back_as_its_types_and_writes_the_same_json(compared: Path) -> None:
    data = json.loads(compared.read_text())
    s = from_json(CompareSummary, data, where=str(compared))
    assert to_json(s) == data and json.dumps(to_json(s), indent=1) == compared.read_text()
    assert isinstance(s.outcome, CompareOutcome) and s.outcome.status == "fail" and s.verdict == "fail"
    layer = s.levels["layer"]
    assert isinstance(layer, LevelSummary) and isinstance(layer.first_fail, SummaryRow)
    first = layer.first_fail
    assert (first.name, first.step, first.diverged) == ("model.layers.2", 0, False)
    assert layer.worst and all(isinstance(r, SummaryRow) and r.step <= 1 for r in layer.worst)
    assert layer.diverged == 4  # step 2's four layer rows
    assert isinstance(s.logits, LogitsAgreement) and s.logits.steps == 3
    assert isinstance(s.divergence, Divergence) and s.divergence.first_differing_token == 1
    assert isinstance(s.matching, Matching) and s.matching.method == "name" and s.matching.rows["name"] > 0
    assert isinstance(s.judged_as, JudgedAs) and isinstance(s.coverage, Coverage)
    assert all(isinstance(c, LevelCoverage) for c in s.coverage.levels.values())
    assert s.missing_steps == [MissingStep(side="target", golden_step=3, target_step=3)]
    # every field of every type is in the file, null where it has no value
    assert set(data["levels"]["layer"]["first_fail"]) == {f.name for f in dataclasses.fields(SummaryRow)}


def test_a_statistics_compare_has_no_logits_agreement_and_rows_without_tensor_metrics(dumps: Path) -> None:
    out = dumps / "stats_out"
    proc = llmflow("compare", "-gp", str(dumps / "stats_golden"), "-mp", str(dumps / "stats_target"),
                   "-o", str(out))
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((out / "compare_summary.json").read_text())
    s = read_compare_summary(out / "compare_summary.json")
    assert to_json(s) == data and s.logits is None and data["logits"] is None
    rows = [r for lv in s.levels.values() for r in (lv.first_fail, lv.first_warn, *lv.worst) if r]
    assert rows and all(r.cosine_similarity is None and r.norm_rel_diff is not None for r in rows)
    assert all(r.diverged is None for r in rows)  # no generation record: not known


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d["levels"]["layer"].update(rows="many"), "levels.layer.rows"),
    (lambda d: d["levels"]["layer"]["first_fail"].update(step=1.5), "levels.layer.first_fail.step"),
    (lambda d: d["outcome"].update(status="maybe"), "outcome.status"),
    (lambda d: d["coverage"].pop("paired"), "coverage.paired"),
    (lambda d: d.update(renamed=1), "unknown field 'renamed'"),
])
def test_a_compare_summary_that_does_not_fit_is_one_line_naming_file_and_field(
        compared: Path, tmp_path: Path, edit, field: str) -> None:
    data = json.loads(compared.read_text())
    edit(data)
    bad = tmp_path / "compare_summary.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError) as err:
        read_compare_summary(bad)
    assert str(bad) in str(err.value) and field in str(err.value) and "\n" not in str(err.value)
    bad.write_text("{not json")
    with pytest.raises(UserError, match="cannot read it as JSON"):
        read_compare_summary(bad)


def test_the_committed_summary_schema_is_the_generated_one(tmp_path: Path) -> None:
    committed = REPO / "schemas" / "summary.schema.json"
    assert committed.read_text() == json.dumps(summary_schema(), indent=2) + "\n"
    proc = llmflow("schema", "--kind", "summary", "-o", str(committed), "--check")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("is up to date)"), proc.stdout + proc.stderr
    stale = tmp_path / "summary.schema.json"
    stale.write_text("{}\n")
    proc = llmflow("schema", "--kind", "summary", "-o", str(stale), "--check")
    assert proc.returncode == 1 and "llmflow schema --kind summary -o" in proc.stdout
    proc = llmflow("schema", "--kind", "verdicts")
    assert proc.returncode == 2 and "--kind" in proc.stderr and "Traceback" not in proc.stderr


def test_a_runs_summary_reads_as_its_types_and_validates(dumps: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = llmflow("run", "compare_dumps", "--run-dir", str(run), "--progress", "plain",
                   "--set", f"golden_dump={dumps / 'golden' / 'dump'}",
                   "--set", f"target_dump={dumps / 'target' / 'dump'}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((run / "summary.json").read_text())
    jsonschema.validate(data, json.loads((REPO / "schemas" / "summary.schema.json").read_text()))
    summary, others = read_run_summary(run / "summary.json")
    assert others == {} and summary.status == "failed"
    assert isinstance(summary.outcome, RunOutcome) and summary.outcome.stages == ["compare"]
    assert all(isinstance(st, StageSummary) for st in summary.stages.values())
    assert isinstance(summary.stages["compare"].outcome, StageOutcome)
    assert isinstance(summary.compare, CompareSummary)
    assert summary.compare.levels["layer"].first_fail.name == "model.layers.2"
    assert summary.compare == read_compare_summary(run / "compare" / "compare_summary.json")
    assert isinstance(summary.report, ReportBlock) and Path(summary.report.html).is_file()
    # a block the types do not know (a plugin stage's) is kept apart; a typed one that does not
    # fit is named
    typed, extra = run_summary_from_json({**data, "my_stage": {"x": 1}})
    assert extra == {"my_stage": {"x": 1}} and typed == summary
    data["stages"]["compare"]["status"] = "finished"
    with pytest.raises(UserError, match=r"summary\.json\.stages\.compare\.status"):
        run_summary_from_json(data)
