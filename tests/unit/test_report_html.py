"""The HTML report's content: self-contained, escaped, each verdict state rendered, the compare
rows split into what was compared and what was not, the heat map, the units of the cost table."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from llmflow.report.html import render_report
from llmflow.report.html_compare import summarize_level
from llmflow.report.html_verdict import fmt_bytes, fmt_seconds, step_label

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import (  # noqa: E402
    children,
    find,
    parse_dom,
    side_rows,
    synthetic_layer_rows,
    synthetic_verdict,
)

ENV = {"versions": {"torch": "2.5.1<x>", "transformers": "4.46.0", "python": "3.11.9"},
       "generation": {"prompt": "Say <hi> & bye", "model": "smollm2", "device": "cpu", "dtype": "float32"}}
NPU_ENV = {"versions": {**ENV["versions"], "torch_npu": "2.5.1.rc1"},
           "generation": {**ENV["generation"], "device": "npu:0", "dtype": "bfloat16"}}


def _page(state: str = "fault", **kwargs) -> str:
    args = {"title": "bisect <demo>", "verdict": synthetic_verdict(state=state),
            "compare": {"logits": [{"step": "0", "name": "logits", "kind": "output", "match": "name",
                                    "cosine_similarity": "0.9", "verdict": "fail"}],
                        "layer": synthetic_layer_rows(), "module": synthetic_layer_rows(level="module")},
            "run": {"workflow": "llama2-bisect", "params": {"prompt": "Say <hi>", "max_new_tokens": 10},
                    "env": {"golden": ENV, "target": NPU_ENV}}}
    return render_report(**{**args, **kwargs})


def test_report_is_self_contained_and_escaped():
    html = _page()
    assert "<script>alert" not in html and "&lt;script&gt;alert" in html
    assert "&lt;b&gt;not&lt;/b&gt;" in html and "bisect &lt;demo&gt;" in html
    assert "&lt;i&gt;(op)&lt;/i&gt;" in html and "&lt;b&gt;no golden inputs&lt;/b&gt;" in html
    assert "Say &lt;hi&gt; &amp; bye" in html and "2.5.1&lt;x&gt;" in html
    # no network: nothing is fetched from anywhere
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "@import" not in html and "url(" not in html
    assert html.count("<script") == 1 and 'class="tok diff"' in html and "Lyon" in html


@pytest.mark.parametrize("state, status, label", [("fault", "fail", "FAILED"), ("pass", "pass", "PASSED"),
                                                   ("inconclusive", "inconclusive", "INCONCLUSIVE"),
                                                   ("moe", "fail", "FAILED")])
def test_banner_shows_the_status_and_headline(state, status, label):
    dom = parse_dom(_page(state))
    (banner,) = find(dom, "div", "banner")
    assert banner.classes == {"banner", status}
    assert banner.text.split()[0] == label
    assert find(dom, "span", "headline")[0].text == synthetic_verdict(state=state).headline


def test_inconclusive_says_why_and_what_to_run_next():
    dom = parse_dom(_page("inconclusive"))
    (box,) = find(dom, "div", "why-inconclusive")
    assert "the replay covers step 0 (prefill) only" in box.text and "<decode>" in box.text
    assert find(dom, "span", "next")[0].text == "llmflow run workflows/llama2_bisect.yaml --set replay_step=1"
    assert not find(parse_dom(_page("fault")), "div", "inconclusive")


def test_moe_routing_table_only_when_present():
    dom = parse_dom(_page("moe"))
    rows = [r for r in find(dom, "tr") if r.within("table", id="t-routing")][1:]
    assert [r.attrs["data-name"] for r in rows] == ["", ""] and len(rows) == 2
    assert "experts {3, 5} -> {3, 6} <top-2>" in rows[0].text and "model.layers.7.mlp.gate" in rows[0].text
    assert not find(parse_dom(_page("fault")), "table", id="t-routing")


def test_not_replayable_modules_and_reasons_are_collapsed():
    dom = parse_dom(_page())
    (details,) = [d for d in find(dom, "details", "notcompared") if d.within("section", id="candidates")]
    assert "open" not in details.attrs and "2 modules not replayable" in details.text
    assert "<b>no golden inputs</b> dumped" in details.text and "lm_head<x>" in details.text
    v = synthetic_verdict()
    v.replay.reasons = {}
    plain = parse_dom(_page(verdict=v))
    assert not [d for d in find(plain, "details") if d.within("section", id="candidates")]


def test_one_logits_table_and_the_compare_logits_point_to_it():
    dom = parse_dom(_page())
    assert len(find(dom, "table", id="t-logits")) == 1 and not find(dom, "table", id="t-cmp-logits")
    assert sum("Logits per step" in h.text for h in find(dom, "h2")) == 1
    # without the bisect's logits rows the compare level's table is the one
    v = synthetic_verdict()
    v.token_rows = []
    dom = parse_dom(_page(verdict=v))
    assert not find(dom, "table", id="t-logits") and len(find(dom, "table", id="t-cmp-logits")) == 1


def test_compared_rows_in_the_table_the_others_in_one_collapsed_line():
    dom = parse_dom(_page())
    # the module level's compared rows are the decoder-layer outputs: shown once, in the layer table
    assert not find(dom, "table", id="t-cmp-module")
    (head,) = [p for p in find(dom, "p") if p.within("section", id="compare-module")
               and "layer table" in p.text]
    assert "The 96 decoder-layer output rows of this level are in the layer table" in head.text
    (details,) = [d for d in find(dom, "details") if d.within("section", id="compare-module")]
    (summary,) = [s for s in find(dom, "summary") if s.parent is details]
    why = "golden inputs kept for replay (the target dumps outputs only)"
    assert summary.text == f"96 rows not compared: 96 {why}"
    rows = [[c.text for c in children(dom, tr)] for tr in find(dom, "tr")
            if tr.within("table", **{"class": "reasons"}) and tr.within("section", id="compare-module")]
    assert rows == [["why", "match", "kind", "rows"], [why, "unmatched golden", "input", "96"]]
    # counted, never listed row by row
    assert not find(dom, "table", id="t-cmp-module-not")
    # nothing left out where everything was compared
    assert not [d for d in find(dom, "details") if d.within("section", id="compare-layer")]


def test_tables_open_most_severe_first_with_the_reason_and_diverged_rows_last():
    rows = synthetic_layer_rows(n_steps=6, n_layers=4, bad_step=1, bad_layer=2)
    for r in rows:  # the texts part at token 2: steps 3.. ran on different inputs
        r["diverged"] = "True" if int(r["step"]) > 2 else "False"
        r["reason"] = "relative_euclidean_distance above the fail limit" if r["verdict"] == "fail" else ""
    dom = parse_dom(render_report(title="t", compare={"layer": rows}))
    table_rows = [r for r in find(dom, "tr") if r.within("table", id="t-cmp-layer")]
    header = [c.text for c in children(dom, table_rows[0])]
    assert header[:7] == ["step", "name", "kind", "index", "verdict", "reason", "diverged"]
    cells = [[c.text for c in children(dom, r)] for r in table_rows[1:]]
    steps = [int(c[0]) for c in cells]
    verdicts = [c[4] for c in cells]
    before = [i for i, c in enumerate(cells) if c[6] == "false"]
    assert before == list(range(len(before))) and {steps[i] for i in before} == {0, 1, 2}
    # before the texts part: the fails first, the worst (lowest cosine: step 2, layer 3) on top
    assert verdicts[:4] == ["fail"] * 4 and (steps[0], cells[0][1]) == (2, "model.layers.3")
    assert "above the fail limit" in cells[0][5]
    assert all(verdicts[i] == "pass" for i in before[4:])
    assert "the 12 rows after the texts part (diverged: their inputs differ) last" in \
        " ".join(p.text for p in find(dom, "p") if p.within("section", id="compare-layer"))


def test_compare_counts_every_row_but_keeps_max_rows():
    rows = synthetic_layer_rows(n_steps=4, n_layers=5, bad_layer=3, level="module")
    lv = summarize_level("module", rows, max_rows=3)
    assert (lv.n_compared, lv.n_not_compared) == (20, 20)
    assert len(lv.compared) == 3
    assert lv.why_counts() == [("golden inputs kept for replay (the target dumps outputs only)", 20)]
    # the three most severe: failing rows, lowest cosine similarity first
    assert [r["verdict"] for r in lv.compared] == ["fail"] * 3
    assert [(r["step"], r["name"]) for r in lv.compared] == [(3, "model.layers.4"), (3, "model.layers.3"),
                                                             (2, "model.layers.4")]
    html = render_report(title="t", compare={"module": rows}, max_rows=3)
    assert "showing the first 3 of 20 rows" in html


def test_candidates_link_to_their_compare_rows():
    dom = parse_dom(_page())
    links = {a.parent.parent.attrs["data-name"]: (a.attrs["href"], a.text)
             for a in find(dom, "a", "rowlink") if a.within("table", id="t-candidates")}
    # the module itself was not dumped on both sides: the link shows its decoder layer's outputs
    assert links["model.layers.7.mlp.down_proj"] == ("#rows=t-cmp-layer&name=model.layers.7",
                                                     "layer model.layers.7: 8 rows")
    assert "<script>alert('x')</script>" not in links
    # a module compared under its own name links to its own rows
    rows = [{"step": "0", "name": "model.layers.7.mlp.down_proj", "kind": "output", "match": "name",
             "verdict": "fail", "cosine_similarity": "0.5"}]
    dom = parse_dom(_page(compare={"module": rows}))
    (own,) = [a for a in find(dom, "a", "rowlink")
              if a.parent.parent.attrs["data-name"] == "model.layers.7.mlp.down_proj"]
    assert (own.attrs["href"], own.text) == ("#rows=t-cmp-module&name=model.layers.7.mlp.down_proj", "1 row")


def test_heat_map_cells_and_marks():
    dom = parse_dom(_page())
    cells = find(dom, "rect", "cell")
    assert len(cells) == 8 * 12
    by_pos = {(int(c.attrs["data-step"]), int(c.attrs["data-layer"])): c for c in cells}
    assert float(by_pos[(0, 0)].attrs["data-value"]) == pytest.approx(2e-3)
    assert by_pos[(0, 0)].attrs["fill"] != by_pos[(1, 7)].attrs["fill"]  # pale vs dark
    assert "(fail)" in by_pos[(1, 7)].text and "(pass)" in by_pos[(1, 6)].text
    (outline,) = find(dom, "rect", "outline")
    assert (outline.attrs["x"], outline.attrs["y"]) == (by_pos[(1, 7)].attrs["x"], by_pos[(1, 7)].attrs["y"])
    marked = [t.text for t in find(dom, "text", "marked")]
    assert marked == ["1 → ' capital'", "7"]  # the verdict's first bad token (row) and layer (column)
    assert len(find(dom, "path", "marker")) == 2
    # the texts differ at token 3: from step 4 on the sides run on different input tokens
    (split,) = find(dom, "line", "split")
    assert split.attrs["y1"] == by_pos[(4, 0)].attrs["y"]


def test_first_failing_cell_is_never_after_the_texts_part():
    # the texts part at token 3 (the verdict); every cell that fails is at step 5 or later
    v = synthetic_verdict()
    assert v.first_mismatch_token == 3
    dom = parse_dom(_page(verdict=v, compare={"layer": synthetic_layer_rows(bad_step=5)}))
    assert any("(fail)" in c.text for c in find(dom, "rect", "cell"))
    assert not find(dom, "rect", "outline")
    # without a verdict, the compare's own diverged marks place the texts part
    rows = synthetic_layer_rows(bad_step=5)
    for r in rows:
        r["diverged"] = str(int(r["step"]) > 3)
    dom = parse_dom(render_report(title="t", compare={"layer": rows}))
    assert not find(dom, "rect", "outline") and find(dom, "line", "split")


def test_no_heat_map_for_a_single_step():
    html = _page(compare={"layer": synthetic_layer_rows(n_steps=1)})
    assert "rect class=\"cell\"" not in html and 'id="heat"' not in html


def test_run_shows_prompt_sides_and_parameters():
    dom = parse_dom(_page())
    assert find(dom, "pre", "prompt")[0].text == "Say <hi> & bye"
    sides = side_rows(dom)
    assert "differs" in sides["device"].classes and "differs" in sides["dtype"].classes
    assert "differs" not in sides["torch"].classes and "2.5.1.rc1" in sides["torch_npu"].text
    params = find(dom, "p", "params")[0].text
    assert "llama2-bisect" in params and "prompt=Say <hi>" in params and "max_new_tokens=10" in params


def test_curves_say_which_step_they_plot():
    v = synthetic_verdict()
    v.replay.step = 4
    headings = [h.text for h in find(parse_dom(_page(verdict=v)), "h2")]
    assert "Per-layer error at step 4 (decode): raw (dumps) against isolated (replay)" in headings
    assert step_label(0) == "step 0 (prefill)"


def test_cost_in_units_and_phases_as_a_table():
    dom = parse_dom(_page())
    text = " ".join(r.text for r in find(dom, "tr") if r.within("section", id="cost"))
    assert "1.23 MB" in text and "98.8 MB" in text and "1.25 %" in text and "12.5 s" in text
    assert "1234567" not in text and "{" not in text  # no raw byte counts, no JSON
    phase = [r for r in find(dom, "tr") if r.within("section", id="cost") and "isolation replay" in r.text]
    assert len(phase) == 1 and "9.5 s" in phase[0].text
    assert (fmt_bytes(999), fmt_bytes(206206), fmt_bytes(3.2e9)) == ("999 B", "206 kB", "3.2 GB")
    assert (fmt_seconds(0.004), fmt_seconds(75), fmt_seconds(125)) == ("4 ms", "75 s", "2 min 5 s")


def test_sections_only_when_data():
    html = render_report(title="t", tables={"rows": [{"a": 1}]})
    assert "Verdict" not in html and "<svg" not in html and "<table" in html and 'class="banner' not in html
