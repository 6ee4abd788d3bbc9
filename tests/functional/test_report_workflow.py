"""The report of a real bisect run, the user's way: ``llmflow run`` in a subprocess on a workflow
that extends the bisect recipe to dump decoder-layer outputs at every step, then the page in a
headless browser: no script errors, the banner, the heat map over every step and layer, the run's
versions, one logits table, the collapsed unmatched line, file links that resolve, row links."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
