"""The report of a run that only compares (``llmflow run compare_dumps``), read as a person reads it:
the page leads with the run's conclusion in the words summary.json holds (PASSED, FAILED, or
INCONCLUSIVE with the damaged dump's problem and the next step), and each level's counts are the
compare summary's, the decoder-layer outputs the layer table shows included."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import find, parse_dom  # noqa: E402
from compare_helpers import model_items, write_dump  # noqa: E402
from workflow_helpers import llmflow  # noqa: E402

EXIT = {"pass": 0, "fail": 1, "inconclusive": 3}
LABEL = {"pass": "PASSED", "fail": "FAILED", "inconclusive": "INCONCLUSIVE"}


def _steps(**kwargs: Any) -> dict[int, list]:
    return {step: model_items(seed=step, **kwargs) for step in (0, 1)}


def _layer_2_scaled(layer: int, x):
    return x * 3 if layer == 2 else x


def _target(tmp: Path, state: str) -> Path:
    """The target dump of each state: the golden's tensors, layer 2's output scaled, or the
    golden's tensors with step 1's data file cut short (as a copy that stopped midway)."""
    if state == "fail":
        return write_dump(tmp / "target", _steps(fault=_layer_2_scaled))
    target = write_dump(tmp / "target", _steps())
    if state == "inconclusive":
        data = sorted((target / "rank0" / "data").glob("*.safetensors"))[-1]  # step 1's
        data.write_bytes(data.read_bytes()[:200])
    return target


def _text(element) -> str:
    return " ".join(element.text.split())


@pytest.fixture(scope="module", params=["pass", "fail", "inconclusive"])
def compare_run(request, tmp_path_factory) -> tuple[str, Path, dict[str, Any], str]:
    state = request.param
    tmp = tmp_path_factory.mktemp(f"compare-{state}")
    golden = write_dump(tmp / "golden", _steps())
    target = _target(tmp, state)
    run = tmp / "run"
    proc = llmflow("run", "compare_dumps", "--set", f"golden_dump={golden}", "--set", f"target_dump={target}",
                   "--run-dir", str(run), "--progress", "plain", cwd=tmp, timeout=300)
    assert proc.returncode == EXIT[state], proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    assert summary["outcome"]["status"] == state, summary["outcome"]
    return state, run, summary, (run / "report" / "report.html").read_text(encoding="utf-8")


def test_the_page_leads_with_the_runs_conclusion(compare_run):
    state, _run, summary, html = compare_run
    dom = parse_dom(html)
    (banner,) = find(dom, "div", "banner")
    assert banner.classes == {"banner", state}
    assert _text(banner) == f"{LABEL[state]} {summary['outcome']['headline']}"
    assert summary["outcome"]["headline"].startswith("compare: ")
    # first on the page, above the run and the tables
    assert html.index('class="banner') < html.index('id="run"') < html.index('id="compare-logits"')


def test_an_inconclusive_page_names_the_damage_and_what_to_run_next(compare_run):
    state, _run, summary, html = compare_run
    dom = parse_dom(html)
    said = summary["stages"]["compare"]["outcome"]
    problems = [_text(li) for li in find(dom, "li") if li.within("div", **{"class": "problems"})]
    nexts = [_text(span) for span in find(dom, "span", "next")]
    if state != "inconclusive":
        assert problems == [] and nexts == [] and not find(dom, "div", "why-inconclusive")
        return
    damage = summary["compare"]["problems"]["target"]
    assert damage and "truncated" in damage[0]
    assert problems == [f"target dump: {p}" for p in damage]
    assert nexts == [said["next"]] and said["next"].startswith("llmflow inspect the target dump")


def test_each_level_counts_its_rows_as_the_compare_summary_does(compare_run):
    state, _run, summary, html = compare_run
    dom = parse_dom(html)
    levels = summary["compare"]["levels"]
    assert {"layer", "module"} <= set(levels)
    for level, counted in levels.items():
        (head,) = [p for p in find(dom, "p", "muted") if p.within("section", id=f"compare-{level}")
                   and re.match(r"\d+ rows?, \d+ compared", _text(p))]
        compared = sum(n for verdict, n in counted["counts"].items() if verdict != "unmatched")
        assert _text(head).startswith(f"{counted['rows']} row{'s' if counted['rows'] != 1 else ''}, "
                                      f"{compared} compared"), (level, _text(head))
        for verdict in ("pass", "warn", "fail"):
            n = counted["counts"][verdict]
            assert (f"{n} {verdict}" in _text(head)) == bool(n), (level, verdict, _text(head))
    if state == "fail":  # the failing decoder layers are module rows too, counted there
        assert levels["module"]["counts"]["fail"] >= 2
