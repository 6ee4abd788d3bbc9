"""overflow-scan on real dumps of a tiny Llama: an fp16 overflow at a known Linear (absent in fp32),
an injected NaN, statistics-only dumps, the stage's files and the overflow_hunt workflow."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import jsonschema
import pytest

from llmflow.checks.overflow import scan
from llmflow.formats.llmflow_dump import LlmflowDumpReader
from llmflow.stages.overflow_scan import OverflowScanStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from checks_helpers import NAN_MODULE, OVERFLOW_MODULE, TINY, ctx, nan_o_proj, overflow_up_proj, real_dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("data_mode", ["tensor", "statistics"])
def test_fp16_overflow_is_found_at_the_scaled_linear(tmp_path, data_mode):
    dump = real_dump(tmp_path, dtype="float16", patch=overflow_up_proj, data_mode=data_mode)
    r = scan(LlmflowDumpReader(dump))
    first = r["first_origin"]
    assert (first["name"], first["kind"], first["step"], first["module_type"]) == \
        (OVERFLOW_MODULE, "inf", 0, "Linear")
    assert first["inputs_clean"]
    # the inf becomes a NaN further down; the trace walks back to the scaled Linear
    assert r["counts"]["nan"] > 0
    assert r["nan_trace"][0]["kind"] == "nan" and r["nan_trace"][-1]["name"] == OVERFLOW_MODULE
    # nothing upstream of the scaled Linear is flagged
    flagged = {row["name"] for row in r["rows"]}
    assert not any(n.startswith("model.layers.0.") for n in flagged)


def test_the_same_model_in_fp32_does_not_overflow(tmp_path):
    r = scan(LlmflowDumpReader(real_dump(tmp_path, dtype="float32", patch=overflow_up_proj)))
    assert r["first_origin"] is None and r["anomalies"] == 0 and r["counts"]["entries_scanned"] > 50


def test_api_mode_names_the_op_inside_the_module(tmp_path):
    r = scan(LlmflowDumpReader(real_dump(tmp_path, dtype="float16", patch=overflow_up_proj, mode="all",
                                         new_tokens=1)))
    first = r["first_origin"]
    assert first["name"].startswith(OVERFLOW_MODULE + "/") and first["level"] == "api"
    assert first["module"] == OVERFLOW_MODULE


def test_injected_nan_origin_and_propagation(tmp_path):
    r = scan(LlmflowDumpReader(real_dump(tmp_path, patch=nan_o_proj)))
    first = r["first_origin"]
    assert (first["name"], first["kind"], first["step"]) == (NAN_MODULE, "nan", 0)
    assert [e["name"] for e in r["nan_trace"]] == [NAN_MODULE]
    # every step shows it, and it spreads to later layers and the logits
    assert {o["step"] for o in r["origins"]} == {0, 1}
    assert any(row["name"] == "logits" for row in r["rows"])
    assert any(row["name"].startswith("model.layers.1.") for row in r["rows"])


def test_stage_writes_report_csv_and_summary(tmp_path):
    dump = real_dump(tmp_path, dtype="float16", patch=overflow_up_proj)
    c = ctx(tmp_path, {"dump": str(dump), "steps": [1]}, "overflow")
    out = OverflowScanStage().run(c)
    report = json.loads(Path(out["report_file"]).read_text())
    assert report["first_origin"]["name"] == OVERFLOW_MODULE and report["first_origin"]["step"] == 1
    with open(out["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["step"] for r in rows} == {"1"}
    assert [r["name"] for r in rows if r["origin"] == "True"] == [OVERFLOW_MODULE]
    s = c.summary["overflow"]
    assert s["first_origin"]["name"] == OVERFLOW_MODULE and s["first_origin"]["kind"] == "inf"
    assert s["anomalies"] == len(rows) and s["counts"]["steps"] == [1]
    assert c.outcome is not None and c.outcome.status == "fail"
    assert c.outcome.headline.startswith("overflow: ") and OVERFLOW_MODULE in c.outcome.headline


def test_stage_passes_a_clean_dump(tmp_path):
    dump = real_dump(tmp_path, dtype="float32", patch=overflow_up_proj)
    c = ctx(tmp_path, {"dump": str(dump)}, "overflow")
    OverflowScanStage().run(c)
    assert c.outcome is not None and c.outcome.status == "pass"
    assert c.outcome.headline.startswith("overflow: no Inf or NaN in ")


def test_overflow_hunt_workflow(tmp_path):
    from llmflow.workflow import run_workflow

    sets = [f"model={TINY}", "max_new_tokens=2", "prompt=hi",
            f"patch={REPO / 'tests' / 'checks_helpers.py'}:overflow_up_proj"]
    run_workflow(REPO / "workflows" / "overflow_hunt.yaml", set_params=sets, run_dir=tmp_path / "run")
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert all(v["status"] == "done" for v in s["stages"].values()), s["stages"]
    assert s["status"] == "failed" and s["outcome"]["status"] == "fail"  # the fault found
    jsonschema.validate(s, json.loads((REPO / "schemas" / "summary.schema.json").read_text()))
    assert s["overflow"]["first_origin"]["name"] == OVERFLOW_MODULE
    assert s["overflow"]["first_origin"]["kind"] == "inf"


SCAN_WORKFLOW = """name: scan
params:
  dump: {type: string, format: path}
stages:
  overflow:
    uses: overflow-scan
    with: {dump: "${params.dump}"%s}
"""


def _scan_cli(tmp: Path, dump: Path, with_more: str = ""):
    """A user's own workflow of one overflow-scan stage, run through the CLI."""
    import subprocess

    wf = tmp / "scan.yaml"
    wf.write_text(SCAN_WORKFLOW % with_more, encoding="utf-8")
    return subprocess.run([sys.executable, "-m", "llmflow", "run", str(wf), "--run-dir", str(tmp / "run"),
                           "--progress", "plain", "--set", f"dump={dump}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp)


def test_a_dump_cut_short_is_inconclusive_not_passed(tmp_path):
    """A data file cut short (a copy broken off): what could not be read may hold the Inf or
    NaN, so the scan of the rest does not pass the dump."""
    dump = real_dump(tmp_path, data_mode="tensor")
    data = sorted((dump / "rank0" / "data").glob("*.safetensors"))[0]
    data.write_bytes(data.read_bytes()[:100])
    proc = _scan_cli(tmp_path, dump)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert lines[-1].startswith("INCONCLUSIVE") and "cannot be trusted whole" in lines[-1], lines[-1]
    assert any(line.startswith("next:") for line in lines), lines


def test_a_nan_in_a_damaged_dump_still_fails(tmp_path):
    dump = real_dump(tmp_path, patch=nan_o_proj)
    (dump / "rank0" / "data").joinpath("extra.safetensors").write_bytes(b"")  # (not named by the index)
    index = dump / "rank0" / "index.jsonl"
    index.write_text(index.read_text(encoding="utf-8") + '{"torn', encoding="utf-8")  # a torn last line
    proc = _scan_cli(tmp_path, dump)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("FAILED")


def test_steps_the_dump_does_not_hold_scan_nothing_and_say_so(tmp_path):
    dump = real_dump(tmp_path)
    proc = _scan_cli(tmp_path, dump, ", steps: [7]")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "no tensor entries to scan in the steps and ranks asked for" in last, last


def test_an_expert_weight_that_overflowed_on_the_cast_is_named_at_its_op(tmp_path):
    """A Mixtral expert's weights past float16's range: cast to fp16 they are Inf, so the experts'
    grouped matmul makes NaN from clean hidden states. With module and API records (mode all) the
    op is named, not the experts module around it, and the last line says its weight input held
    Inf on entry: the user's way, ``llmflow run overflow_hunt`` with a patch file."""
    import os
    import subprocess

    from path_helpers import checkout_path

    (tmp_path / "big_expert.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'plugins')!r})\n"
        "from example_faults import scale_expert\n\n\n"
        "def patch(model):\n"
        "    scale_expert(1, 1, 3e6)(model)\n")
    model = "tiny-mixtral:layers=2,hidden=64,seed=0"
    cmd = [sys.executable, "-m", "llmflow", "run", "overflow_hunt", "--run-dir", "run", "--progress", "plain",
           "--set", f"model={model}", "--set", "patch=big_expert.py:patch", "--set", "mode=all",
           "--set", "max_new_tokens=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last.startswith("FAILED: overflow: ") and "model.layers.1.mlp.experts/" in last, last
    assert "held Inf/NaN on entry" in last and "weight that overflowed when cast" in last, last
