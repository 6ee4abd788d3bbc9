"""The report of a real bisect run, the user's way: ``llmflow run`` in a subprocess on a workflow
that extends the bisect recipe to dump decoder-layer outputs at every step, then the page in a
headless browser: no script errors, the banner, the heat map over every step and layer, the run's
versions, one logits table, the collapsed unmatched line, file links that resolve, row links; and
for a decode-attention fault the first failing row and cell before the texts part, the module
tree with the chosen attention outlined, the op panel on the first bad op's own tensors (or,
without them, the nearest dumped tensor, saying so), the attention's own error per step."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import openpyxl
import pytest
import torch
from path_helpers import checkout_path

from llmflow.stages.base import StageContext
from llmflow.stages.report import ReportStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import find, parse_dom, run_chromium, side_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAYERS, TOKENS = 4, 4
WORKFLOW = f"""name: bisect-every-step
description: The bisect recipe with decoder-layer outputs dumped at every step.
extends: {REPO / "workflows" / "recipes" / "bisect_base.yaml"}
stages:
  dump-golden:
    with: {{token_range: all}}
  dump-npu:
    with: {{token_range: all}}
"""


def _dom(page: Path, fragment: str = "") -> list:
    res = run_chromium(page, "--dump-dom", fragment=fragment)
    assert res.returncode == 0, res.stderr[-2000:]
    dom = parse_dom(res.stdout)
    (html,) = find(dom, "html")
    assert html.attrs.get("data-ready") == "1" and "data-js-error" not in html.attrs, html.attrs
    return dom


@pytest.mark.slow  # ~20 s: two dump subprocesses, compare, bisect, report
def test_report_of_a_bisect_run_over_every_step(tmp_path):
    wf = tmp_path / "every_step.yaml"
    wf.write_text(WORKFLOW)
    model = f"tiny-llama:layers={LAYERS},seed=1"
    cmd = [sys.executable, "-m", "llmflow.cli", "run", str(wf), "--set", f"golden_model={model}",
           "--set", f"target_model={model}", "--set", f"max_new_tokens={TOKENS}", "--set",
           f"target_patch={REPO / 'plugins' / 'example_faults.py'}:wrong_act_layer_2", "--run-dir",
           str(tmp_path / "run")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_COLOR": "1"})
    # the exit code is the bisect's outcome (its own tests check it); here the report matters
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stages"]["report"]["status"] == "done", summary["stages"]["report"]
    page = tmp_path / "run" / "report" / "report.html"
    # the console says what is slow while it happens, and ends with the page to open
    lines = res.stdout.strip().splitlines()
    assert lines[-2] == f"report: {page}", lines[-4:]
    assert any(f"dump-npu: model {model}: loading on cpu as bfloat16" in line for line in lines), res.stdout
    dom = _dom(page)

    (banner,) = find(dom, "div", "banner")
    assert "fail" in banner.classes and "model.layers.2.mlp.act_fn" in banner.text
    cells = find(dom, "rect", "cell")
    assert {(int(c.attrs["data-step"]), int(c.attrs["data-layer"])) for c in cells} == \
        {(s, i) for s in range(TOKENS) for i in range(LAYERS)}
    # the first bad layer's column is marked, and the first bad token's row when the logits fail
    # (whether they do on a tiny model in bf16 depends on the CPU)
    bad_token = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())["first_bad_token"]
    marked = [t.text for t in find(dom, "text", "marked")]
    assert marked[-1] == "2" and [m.split(" ")[0] for m in marked[:-1]] == ([] if bad_token is None
                                                                             else [str(bad_token)])
    sides = side_rows(dom)
    assert torch.__version__ in sides["torch"].text and "bfloat16" in sides["dtype"].text
    assert find(dom, "pre", "prompt")[0].text == "Tell me a story about a dragon."
    assert len(find(dom, "table", id="t-logits")) == 1 and not find(dom, "table", id="t-cmp-logits")
    (unmatched,) = [s for s in find(dom, "summary") if s.within("section", id="compare-module")]
    assert "golden inputs kept for replay" in unmatched.text
    hrefs = {a.attrs["href"] for a in find(dom, "a", "file")}
    assert {Path(h).name for h in hrefs} >= {"compare_logits.csv", "compare_layer.csv", "compare.xlsx"}
    assert all((page.parent / h).resolve().is_file() for h in hrefs), hrefs

    (link,) = [a for a in find(dom, "a", "rowlink") if a.parent.parent.attrs.get("data-name")
               == "model.layers.2.mlp.act_fn"]
    dom = _dom(page, fragment=link.attrs["href"].removeprefix("#"))
    table_id = link.attrs["href"].split("=", 1)[1].split("&", 1)[0]
    rows = [r for r in find(dom, "tr") if r.within("table", id=table_id) and "data-name" in r.attrs]
    shown = {r.attrs["data-name"] for r in rows if "display: none" not in r.attrs.get("style", "")}
    assert shown == {"model.layers.2"} and len(rows) > TOKENS


@pytest.mark.slow  # ~30 s: two dump subprocesses, compare, bisect, report
def test_the_report_leads_to_a_decode_attention_fault(tmp_path):
    """A decode-only attention bug (its output scaled by 3) in layer 2 of a tiny Llama:
    the first failing row and heat-map cell are before the texts part, at layer 2; the module tree
    has the attention open and outlined; the op panel shows the first bad op's tensors kept in
    first_bad_op.safetensors and its inspect commands run; the attention's own error per step is
    small at the prefill and large at every decode step, and drawn; a verdict without the kept
    tensors gives the nearest dumped tensor, saying so."""
    wf = tmp_path / "every_step.yaml"
    wf.write_text(WORKFLOW)
    model = f"tiny-llama:layers={LAYERS},seed=1"
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "llmflow.cli", "run", str(wf), "--set", f"golden_model={model}",
           "--set", f"target_model={model}", "--set", "max_new_tokens=6", "--set",
           f"target_patch={REPO / 'plugins' / 'example_faults.py'}:decode_attn_scale_layer_2",
           "--run-dir", str(run)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_COLOR": "1"})
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    verdict = json.loads((run / "bisect" / "verdict.json").read_text())
    assert verdict["first_bad_module"] == "model.layers.2.self_attn", verdict["headline"]
    summary = json.loads((run / "compare" / "compare_summary.json").read_text())
    parted = (summary["divergence"] or {}).get("first_differing_token")
    parted = parted if parted is not None else 10**9  # texts that never part: no row is diverged
    first = summary["levels"]["layer"]["first_fail"]
    assert first["name"] == "model.layers.2" and first["step"] <= parted and not first["diverged"]
    dom = _dom(run / "report" / "report.html")

    # the heat map's first failing cell: the same row, before the texts part
    (outline,) = find(dom, "rect", "outline")
    assert outline.text == f"first failing cell: step {first['step']}, layer 2"
    # the layer table opens on a failing row before the texts part
    rows = [r for r in find(dom, "tr") if r.within("table", id="t-cmp-layer") and "data-name" in r.attrs]
    assert "fail" in rows[0].classes
    header = [th.text for th in find(dom, "th") if th.within("table", id="t-cmp-layer")]
    cells = [td for td in find(dom, "td") if td.parent is rows[0]]
    assert int(cells[header.index("step")].text) <= parted
    assert cells[header.index("diverged")].text == "false"
    # the module tree: the attention of layer 2 outlined, every fold around it open
    (chosen,) = find(dom, "li", id="tree-module-chosen")
    assert chosen.attrs["data-name"] == "model.layers.2.self_attn" and "chosen" in chosen.classes
    node = chosen.parent
    while node is not None:
        assert node.tag != "details" or "open" in node.attrs
        node = node.parent
    folds = {d.parent.attrs.get("data-name"): "open" in d.attrs for d in find(dom, "details")}
    closed = [name for name, is_open in folds.items() if not is_open
              and name in {f"model.layers.{i}" for i in range(LAYERS)}]
    assert sorted(closed) == [f"model.layers.{i}" for i in range(LAYERS) if i != 2]
    # the op panel: the first bad op's own tensors, charts, the worst elements, both sides, commands that run
    kept = verdict["first_bad_op_tensors"]
    assert kept["op"] == verdict["first_bad_op"] and kept["op"].startswith("model.layers.2.self_attn/")
    assert {"golden.output.0", "target.output.0"} <= set(kept["tensors"]) and kept["step"] > 0
    stages = json.loads((run / "summary.json").read_text())["stages"]
    assert stages["bisect"]["outputs"]["op_tensors_file"] == str(run / "bisect" / kept["file"])
    (panel,) = find(dom, "section", id="op-panel")
    (op_name,) = [c for c in find(dom, "code", "opname") if c.within("section", id="op-panel")]
    assert op_name.text == kept["op"] and f"at step {kept['step']}" in panel.text
    assert "first_bad_op.safetensors" in panel.text
    assert [e for e in find(dom, "rect", "bar") if e.within("section", id="op-panel")]
    assert len([r for r in find(dom, "tr") if r.within("table", **{"class": "worst"})]) > 5
    buttons = [b for b in find(dom, "button", "copy") if b.within("section", id="op-panel")]
    assert len(buttons) == 2
    for button in buttons:
        argv = shlex.split(button.attrs["data-copy"])
        assert argv[:2] == ["llmflow", "inspect"]
        shown = subprocess.run([sys.executable, "-m", "llmflow", *argv[1:]], capture_output=True, text=True,
                               timeout=120,
                               env={**os.environ, "PYTHONPATH": checkout_path(REPO), "NO_COLOR": "1"})
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.strip().splitlines()[-1].startswith("PASSED")
        assert argv[2].endswith("first_bad_op.safetensors") and argv[3].endswith(".output.0")
    # the attention's own error per step: the rounding at the prefill, the fault at every decode step
    own = verdict["own_error_steps"]
    assert own["module"] == "model.layers.2.self_attn"
    errors = {r["step"]: r["own_error"] for r in own["rows"]}
    assert sorted(errors) == list(range(6)) and errors[0] < 0.05
    peers = {r["step"]: r["peer_median"] for r in own["rows"]}
    assert all(errors[s] > 20 * errors[0] and errors[s] > 20 * peers[s] for s in range(1, 6)), own
    assert [p for p in find(dom, "polyline") if p.within("section", id="own-error-steps")]
    assert any("bisect: module: own error per step done" in line for line in res.stdout.splitlines())
    # the xlsx opens on the summary sheet with the same first failing row
    ws = openpyxl.load_workbook(run / "compare" / "compare.xlsx")["summary"]
    values = list(ws.iter_rows(values_only=True))
    head = next(i for i, r in enumerate(values) if r and r[0] == "level")
    layer = dict(zip(values[head], next(r for r in values[head + 1:] if r[0] == "layer"), strict=True))
    assert (layer["first_fail_name"], layer["first_fail_step"]) == ("model.layers.2", first["step"])

    # a verdict that keeps no op tensors (an older one): the nearest dumped tensor, and the page says so
    older = tmp_path / "older" / "verdict.json"
    older.parent.mkdir()
    older.write_text(json.dumps({k: v for k, v in verdict.items() if k != "first_bad_op_tensors"}))
    out = tmp_path / "older" / "report"
    out.mkdir()
    params = {"verdict_file": str(older), "csv": stages["compare"]["outputs"]["csv"],
              "golden_dump": stages["dump-golden"]["outputs"]["dump_dir"],
              "target_dump": stages["dump-npu"]["outputs"]["dump_dir"]}
    ReportStage().run(StageContext(stage_id="report", params=params, out_dir=out, final_dir=out, run_dir=run,
                                   workflow_dir=tmp_path, inputs={}, log=lambda _m: None))
    dom = parse_dom((out / "report.html").read_text())
    (panel,) = find(dom, "section", id="op-panel")
    (op_name,) = [c for c in find(dom, "code", "opname") if c.within("section", id="op-panel")]
    assert op_name.text == "model.layers.2" and "keeps no tensors of the first bad op" in panel.text
