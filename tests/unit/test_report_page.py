"""The HTML report in a real (headless) browser: it loads without script errors in every verdict
state, its banner, heat map and collapsed lines are in the DOM, its row links filter the compare
tables, and its screenshot shows the banner in the status's colour."""

from __future__ import annotations

import re
import struct
import sys
from pathlib import Path

import pytest

from llmflow.report.html import write_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import (  # noqa: E402
    find,
    parse_dom,
    png_rows,
    run_chromium,
    synthetic_layer_rows,
    synthetic_verdict,
)

BANNER_RGB = {"fail": (0xcf, 0x22, 0x2e), "pass": (0x1a, 0x7f, 0x37), "inconclusive": (0xbf, 0x87, 0x00)}


def _report(tmp_path: Path, state: str = "fault") -> Path:
    env = {"versions": {"torch": "2.5.1"}, "generation": {"prompt": "Say <hi>", "device": "cpu"}}
    compare = {"layer": synthetic_layer_rows(), "module": synthetic_layer_rows(level="module", mlp=True)}
    return write_report(tmp_path / f"{state}.html", title="bisect <demo>",
                        verdict=synthetic_verdict(state=state), compare=compare, meta={"run": "runs/x"},
                        run={"params": {"seed": 1}, "env": {"golden": env, "target": env}})


def _dom(path: Path, fragment: str = "") -> list:
    res = run_chromium(path, "--dump-dom", fragment=fragment)
    assert res.returncode == 0, res.stderr[-2000:]
    dom = parse_dom(res.stdout)
    (html,) = find(dom, "html")
    assert html.attrs.get("data-ready") == "1" and "data-js-error" not in html.attrs, html.attrs
    return dom


@pytest.mark.parametrize("state, status", [("fault", "fail"), ("pass", "pass"),
                                           ("inconclusive", "inconclusive"), ("moe", "fail")])
def test_every_state_loads_and_shows_its_banner(tmp_path, state, status):
    dom = _dom(_report(tmp_path, state))
    (banner,) = find(dom, "div", "banner")
    assert banner.classes == {"banner", status}
    assert find(dom, "span", "headline")[0].text == synthetic_verdict(state=state).headline
    assert len(find(dom, "rect", "cell")) == 8 * 12 and len(find(dom, "table", id="t-logits")) == 1
    assert bool(find(dom, "table", id="t-routing")) == (state == "moe")
    assert bool(find(dom, "div", "why-inconclusive")) == (state == "inconclusive")
    (details,) = [d for d in find(dom, "details") if d.within("section", id="compare-module")]
    assert "open" not in details.attrs  # collapsed until asked
    count = [s for s in find(dom, "span", "count") if s.parent.attrs.get("data-table") == "t-cmp-module"]
    assert count[0].text == "96 rows"  # the MLP outputs: the layer outputs are in the layer table
    assert details.attrs.get("class") == "notcompared"
    assert details.text.startswith("96 rows not compared: 96 ")  # the golden inputs, in one line


def test_a_candidates_link_shows_that_modules_rows(tmp_path):
    path = _report(tmp_path)
    dom = _dom(path)
    (link,) = [a for a in find(dom, "a", "rowlink")
               if a.parent.parent.attrs["data-name"] == "model.layers.7.mlp.down_proj"]
    dom = _dom(path, fragment=link.attrs["href"].removeprefix("#"))
    rows = [r for r in find(dom, "tr") if r.within("table", id="t-cmp-layer") and "data-name" in r.attrs]
    shown = [r.attrs["data-name"] for r in rows if "display: none" not in r.attrs.get("style", "")]
    assert shown == ["model.layers.7"] * 8 and len(rows) == 96
    count = [s for s in find(dom, "span", "count") if s.parent.attrs.get("data-table") == "t-cmp-layer"]
    assert count[0].text == "8 rows"


def test_a_link_into_the_module_table_shows_that_modules_rows(tmp_path):
    dom = _dom(_report(tmp_path), fragment="rows=t-cmp-module&name=model.layers.3.mlp")
    rows = [r for r in find(dom, "tr") if r.within("table", id="t-cmp-module") and "data-name" in r.attrs]
    shown = [r.attrs["data-name"] for r in rows if "display: none" not in r.attrs.get("style", "")]
    assert shown == ["model.layers.3.mlp"] * 8 and len(rows) == 96


def test_tables_sort_and_filter(tmp_path):
    path = _report(tmp_path)
    # a test-only script drives the page: sort candidates by score descending, keep failing rows
    probe = path.with_name("probe.html")
    driver = """<script>
      var th=[].filter.call(document.querySelectorAll('#t-candidates th'),
                            function(h){return h.textContent==='score';})[0];
      th.click(); th.click();
      var first=document.querySelector('#t-candidates tbody tr td:nth-child(2)').textContent;
      var box=document.querySelector('.filters[data-table="t-cmp-layer"]');
      var sel=box.querySelector('select'); sel.value='fail'; sel.dispatchEvent(new Event('change'));
      document.documentElement.setAttribute('data-probe', first+'|'+box.querySelector('.count').textContent);
    </script></body>"""
    probe.write_text(path.read_text().replace("</body>", driver))
    (html,) = find(_dom(probe), "html")
    assert html.attrs["data-probe"] == "model.layers.7.mlp.down_proj|35 rows"


@pytest.mark.parametrize("state", ["fault", "pass"])
def test_screenshot_shows_the_banner_in_its_colour(tmp_path, state):
    path = _report(tmp_path, state)
    shot = tmp_path / f"{state}.png"
    res = run_chromium(path, f"--screenshot={shot}", "--window-size=1200,1400", "--hide-scrollbars")
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    data = shot.read_bytes()
    assert struct.unpack(">II", data[16:24]) == (1200, 1400)
    assert len(data) > 60_000  # a blank page compresses to a few kB; texts, charts and tables do not
    width, rows = png_rows(data, 0, 140)
    want = BANNER_RGB["fail" if state == "fault" else state]
    def is_banner(px: tuple[int, int, int]) -> bool:
        return all(abs(a - b) <= 6 for a, b in zip(px, want, strict=True))

    banner_rows = [y for y, row in enumerate(rows) if sum(map(is_banner, row)) > width // 2]
    assert len(banner_rows) >= 20, f"no {state} banner at the top"  # a band of the status's colour


def test_error_hook_reports_script_errors(tmp_path):
    # the no-error checks above are only worth something if an error would be seen
    path = _report(tmp_path)
    broken = path.with_name("broken.html")
    broken.write_text(path.read_text().replace("</body>", "<script>undefinedFunction()</script></body>"))
    dom = run_chromium(broken, "--dump-dom").stdout
    assert re.search(r'data-js-error="[^"]*undefinedFunction', dom)
