"""The report stage: compare CSVs streamed into the page, file links relative to where the page
ends up, each side's env.json and the run's parameters shown, bad inputs as one-line errors."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest

from llmflow.errors import UserError
from llmflow.results.codec import to_json
from llmflow.stages.base import StageContext
from llmflow.stages.report import ReportStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import find, parse_dom, side_rows, synthetic_layer_rows, synthetic_verdict  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _write_csv(path: Path, rows: list[dict]) -> Path:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _run(tmp_path: Path) -> dict:
    """A run directory as the runner leaves it, with compare, bisect and dump outputs."""
    run = tmp_path / "run"
    cmp_dir = run / "compare"
    cmp_dir.mkdir(parents=True)
    csvs = {"layer": str(_write_csv(cmp_dir / "compare_layer.csv", synthetic_layer_rows())),
            "module": str(_write_csv(cmp_dir / "compare_module.csv", synthetic_layer_rows(level="module")))}
    (cmp_dir / "compare.xlsx").write_bytes(b"PK")
    (run / "bisect").mkdir()
    (run / "bisect" / "verdict.json").write_text(json.dumps(to_json(synthetic_verdict())))
    for side, dtype in (("golden", "float32"), ("target", "bfloat16")):
        (run / side).mkdir()
        generation = {"prompt": "Tell me <a> story", "model": "smollm2", "device": "cpu", "dtype": dtype}
        (run / side / "env.json").write_text(json.dumps({
            "versions": {"torch": "2.5.1", "transformers": "4.46.0"}, "generation": generation}))
    (run / "summary.json").write_text(json.dumps({"workflow": "llama2-bisect",
                                                  "params": {"target_dtype": "bfloat16", "seed": 7}}))
    return {"run": run, "verdict_file": str(run / "bisect" / "verdict.json"), "csv": csvs,
            "xlsx": str(cmp_dir / "compare.xlsx"), "golden_dump": str(run / "golden" / "env.json"),
            "target_dump": str(run / "target" / "env.json")}


def _ctx(run: Path, params: dict, out: Path | None = None) -> StageContext:
    final = run / "report"
    out = out or final
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(stage_id="report", params=params, out_dir=out, final_dir=final, run_dir=run,
                        workflow_dir=REPO / "workflows", inputs={}, log=lambda _m: None)


def test_links_resolve_from_where_the_page_ends_up(tmp_path):
    r = _run(tmp_path)
    run = r.pop("run")
    # the runner writes into a temporary directory, then moves it to the stage's final directory
    tmp_out = run / ".tmp" / "report-x"
    ReportStage().run(_ctx(run, r, out=tmp_out))
    shutil.move(tmp_out, run / "report")
    page = run / "report" / "report.html"
    dom = parse_dom(page.read_text())
    hrefs = {a.attrs["href"] for a in find(dom, "a", "file")}
    names = ("compare_layer.csv", "compare_module.csv", "compare.xlsx")
    assert hrefs == {f"../compare/{name}" for name in names}
    assert all((page.parent / h).resolve().is_file() for h in hrefs)


def test_page_shows_env_params_and_the_compare_split(tmp_path):
    r = _run(tmp_path)
    run = r.pop("run")
    ReportStage().run(_ctx(run, r))
    dom = parse_dom((run / "report" / "report.html").read_text())
    assert find(dom, "pre", "prompt")[0].text == "Tell me <a> story"
    sides = side_rows(dom)
    assert "differs" in sides["dtype"].classes and "bfloat16" in sides["dtype"].text
    assert "2.5.1" in sides["torch"].text and "differs" not in sides["torch"].classes
    params = find(dom, "p", "params")[0].text
    assert "llama2-bisect" in params and "target_dtype=bfloat16" in params and "seed=7" in params
    (summary,) = [s for s in find(dom, "summary") if s.within("section", id="compare-module")]
    assert summary.text.startswith("96 rows not compared: 96 golden inputs kept for replay")
    assert len(find(dom, "rect", "cell")) == 8 * 12


def test_a_dump_without_env_still_gives_a_page(tmp_path):
    r = _run(tmp_path)
    run = r.pop("run")
    empty = tmp_path / "not_a_dump"
    empty.mkdir()
    out = ReportStage().run(_ctx(run, {**r, "target_dump": str(empty)}))
    dom = parse_dom(Path(out["html"]).read_text())
    sides = side_rows(dom)
    assert "float32" in sides["dtype"].text and "differs" in sides["dtype"].classes  # target: unknown


def test_a_missing_csv_is_a_user_error(tmp_path):
    r = _run(tmp_path)
    run = r.pop("run")
    missing = run / "compare" / "nope.csv"
    with pytest.raises(UserError, match=r"report: csv: cannot read .*nope\.csv"):
        ReportStage().run(_ctx(run, {**r, "csv": {"layer": str(missing)}}))
