"""The report stage: compare CSVs streamed into the page, file links relative to where the page
ends up, each side's env.json and the run's parameters shown, bad inputs as one-line errors."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

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


def _with_kept_op(r: dict, *, write_file: bool = True, file: str = "first_bad_op.safetensors",
                  sampled: bool = False) -> str:
    """The run's verdict with the first bad op's tensors kept beside it (a down_proj whose output
    is halved in channel 3), and its own error per step; the op's name."""
    from safetensors.torch import save_file

    from llmflow.results.verdict import FIRST_BAD_OP_FILE, OpTensors, OwnErrorStep, OwnErrorSteps

    v = synthetic_verdict()
    op = v.first_bad_op
    keys = ["golden.output.0", "target.output.0"]
    v.first_bad_op_tensors = OpTensors(file=file, op=op, step=0, tensors=keys,
                                       sampled=keys if sampled else [],
                                       notes=["every 3th element kept, flattened"] if sampled else [])
    v.own_error_steps = OwnErrorSteps(module=v.first_bad_module, metric="rel_l2", rows=[
        OwnErrorStep(step=s, own_error=0.5, peer_median=3e-3, peers=11) for s in range(4)])
    path = Path(r["verdict_file"])
    path.write_text(json.dumps(to_json(v)))
    if write_file:
        golden = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0))
        target = golden.clone()
        target[..., 3] *= 0.5
        if sampled:
            golden, target = golden.reshape(-1)[::3].clone(), target.reshape(-1)[::3].clone()
        save_file({"golden.output.0": golden, "target.output.0": target.bfloat16()},
                  str(path.with_name(FIRST_BAD_OP_FILE)))
    return op


def test_the_op_panel_shows_the_kept_tensors_of_the_first_bad_op(tmp_path):
    r = _run(tmp_path)
    run = r.pop("run")
    op = _with_kept_op(r)
    ReportStage().run(_ctx(run, r))
    dom = parse_dom((run / "report" / "report.html").read_text())
    (panel,) = find(dom, "section", id="op-panel")
    (name,) = [c for c in find(dom, "code", "opname") if c.within("section", id="op-panel")]
    assert name.text == op and "first_bad_op.safetensors" in panel.text and "at step 0" in panel.text
    worst = [e.text for e in find(dom, "p", "small") if e.within("section", id="op-panel")]
    assert worst[0].startswith("Worst: channel 3")
    commands = [b.attrs["data-copy"] for b in find(dom, "button", "copy")
                if b.within("section", id="op-panel")]
    kept = run / "bisect" / "first_bad_op.safetensors"
    assert commands == [f"llmflow inspect {kept} golden.output.0", f"llmflow inspect {kept} target.output.0"]
    # the chosen module's own error per step: a line per series and one table row per step
    lines = [p for p in find(dom, "polyline") if p.within("section", id="own-error-steps")]
    assert len(lines) == 2
    rows = [t for t in find(dom, "tr") if t.within("table", id="t-own-steps") and t.within("tbody")]
    assert len(rows) == 4


@pytest.mark.parametrize(("file", "written", "logged"), [
    ("first_bad_op.safetensors", False, "the first bad op's tensors cannot be read from"),
    ("../first_bad_op.safetensors", True, "is not a file name"),
])
def test_without_its_file_the_kept_op_gives_way_to_the_dumps_and_is_logged(tmp_path, file, written, logged):
    r = _run(tmp_path)
    run = r.pop("run")
    _with_kept_op(r, write_file=written, file=file)
    lines: list[str] = []
    ctx = _ctx(run, r)
    ctx.log = lines.append
    ReportStage().run(ctx)
    assert any(logged in line and "first_bad_op.safetensors" in line for line in lines), lines
    dom = parse_dom((run / "report" / "report.html").read_text())
    assert not find(dom, "section", id="op-panel")  # these dumps hold no tensors either
    assert find(dom, "section", id="own-error-steps")


def test_a_sampled_kept_op_is_not_split_by_channel_and_says_it_was_sampled(tmp_path):
    r = _run(tmp_path)
    run = r.pop("run")
    _with_kept_op(r, sampled=True)
    ReportStage().run(_ctx(run, r))
    dom = parse_dom((run / "report" / "report.html").read_text())
    (panel,) = find(dom, "section", id="op-panel")
    assert "every 3th element kept, flattened" in panel.text
    assert not [e for e in find(dom, "p", "small") if e.within("section", id="op-panel")
                and e.text.startswith("Worst:")]
    assert len([r for r in find(dom, "tr") if r.within("table", **{"class": "worst"})]) > 5


@pytest.mark.parametrize(("row", "locators", "expected"), [
    ({"target_data_path": "a:1"}, ["a:1"], [1.0, 2.0]),
    ({"target_data_path": "rank0/a:1+rank1/a:1", "shards": "2 ranks, concat:0"},
     ["rank0/a:1", "rank1/a:1"], [1.0, 2.0, 10.0, 20.0]),
    ({"target_data_path": "rank0/a:1+rank1/a:1", "shards": "2 ranks, sum; rank 1 stands out (x)"},
     ["rank0/a:1", "rank1/a:1"], [11.0, 22.0]),
    ({"target_data_path": "rank0/a:1+rank1/a:1", "shards": "2 ranks, replicated"},
     ["rank0/a:1", "rank1/a:1"], [1.0, 2.0]),
    ({"target_data_path": "rank0/a:1+rank1/a:1",
      "shards": "2 ranks, replicated; the ranks' copies differ, the worst is rank 1's"},
     ["rank1/a:1"], [1.0, 2.0]),
    ({"target_data_path": "a:1+b:2", "target_name": "x.q+x.k"}, ["a:1", "b:2"], [11.0, 22.0]),
])
def test_the_panel_joins_a_rows_target_tensors_as_the_compare_did(row, locators, expected):
    from llmflow.stages.report import _row_parts

    got, join = _row_parts(row, "target")
    assert got == locators
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])][:len(got)]
    assert join(tensors).tolist() == expected


def test_a_row_whose_locators_do_not_match_its_ranks_is_refused():
    from llmflow.stages.report import _row_parts

    with pytest.raises(ValueError, match="joins 3 ranks but lists 2 locators"):
        _row_parts({"target_data_path": "rank0/a:1+rank1/a:1", "shards": "3 ranks, sum"}, "target")


def _row(name: str, *, step: int, order: int, verdict: str = "fail", rank: int = 0) -> dict:
    return {"name": name, "step": step, "rank": rank, "order": order, "kind": "output", "index": 0,
            "verdict": verdict, "golden_data_path": "g", "target_data_path": "t"}


def test_without_a_verdict_the_panel_shows_the_compares_first_failing_row_whatever_the_csv_order():
    from llmflow.stages.report import _TITLE, _WHAT, _RowTap

    tap = _RowTap(None)
    # the layer CSV streams first; its failing row lies after the module's in execution order
    for row in (_row("model.layers.1", step=0, order=40),
                _row("model.layers.0", step=0, order=9, verdict="pass"),
                _row("model.layers.1.mlp.up_proj", step=0, order=31),
                _row("model.layers.2.mlp", step=1, order=2)):
        tap.see(row)
    row, which = tap.pick(None)
    assert row["name"] == "model.layers.1.mlp.up_proj"
    assert _WHAT[which].startswith("the first failing compare row")
    assert _TITLE[which] == "The first failing tensor in detail"


@pytest.mark.parametrize(("names", "shown", "what"), [
    (("op.0", "model.layers.1.mlp", "model.layers.1"), "op.0", "the first bad op's output"),
    ((None, "model.layers.1.mlp", "model.layers.1"), "model.layers.1.mlp", "the chosen module's output"),
    ((None, None, "model.layers.1"), "model.layers.1", "the first bad layer's output"),
    ((None, "model.layers.9.mlp", "model.layers.9"), "model.layers.1.mlp.up_proj",
     "the first failing compare row"),
])
def test_the_panel_says_which_of_the_verdicts_names_it_shows(names, shown, what):
    from llmflow.stages.report import _WHAT, _RowTap

    v = synthetic_verdict()
    v.first_bad_op, v.first_bad_module, v.first_bad_layer = names
    tap = _RowTap(v)
    for row in (_row("op.0", step=0, order=35), _row("model.layers.1.mlp", step=0, order=33),
                _row("model.layers.1", step=0, order=40),
                _row("model.layers.1.mlp.up_proj", step=0, order=31)):
        tap.see(row)
    row, which = tap.pick(0)
    assert row["name"] == shown and _WHAT[which].startswith(what)


def test_the_first_failing_tensors_steps_are_gathered_for_its_chart():
    from llmflow.stages.report import _RowTap

    tap = _RowTap(None)
    rows = [_row("model.layers.1.mlp", step=0, order=31, verdict="pass"),
            _row("model.layers.1.mlp", step=1, order=31),
            _row("model.layers.1.mlp", step=1, order=31, rank=1),  # another rank's tensor
            _row("model.layers.0.mlp", step=2, order=9),
            _row("model.layers.1.mlp", step=2, order=31)]
    for row in rows:
        tap.see(row, Path("compare_module.csv"))
    assert tap.first_fail is rows[1] and tap.first_fail_source == Path("compare_module.csv")
    assert "model.layers.1.mlp" not in tap.rows  # which tensor fails first was not known while streaming
    tap.gather_first_fail(rows)
    assert tap.rows["model.layers.1.mlp"] == {0: rows[0], 1: rows[1], 2: rows[4]}
