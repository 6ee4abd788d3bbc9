"""The HTML report: self-contained, escaped, and working in a real (headless) browser."""

from __future__ import annotations

import re
import struct
import sys
from pathlib import Path

from llmflow.report.html import render_report, rows_of, write_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import run_chromium, synthetic_verdict  # noqa: E402

COMPARE_ROWS = [
    {"name": "logits", "step": 0, "cosine_similarity": 0.99999, "verdict": "pass"},
    {"name": "logits", "step": 1, "cosine_similarity": 0.91, "verdict": "fail"},
    {"name": "model.layers.0", "step": 0, "cosine_similarity": 0.999, "verdict": "warn"},
    {"name": "=HYPERLINK(\"http://x\")", "step": 2, "cosine_similarity": None, "verdict": "pass"},
]


def _report(tmp_path: Path) -> Path:
    return write_report(tmp_path / "report.html", title="bisect <demo>", verdict=synthetic_verdict(),
                        tables={"compare: logits": COMPARE_ROWS}, meta={"run": "runs/x"})


def test_report_is_self_contained_and_escaped(tmp_path):
    html = _report(tmp_path).read_text()
    assert "<script>alert" not in html and "&lt;script&gt;alert" in html
    assert "&lt;b&gt;not&lt;/b&gt;" in html and "bisect &lt;demo&gt;" in html
    # no network: nothing is fetched from anywhere
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "@import" not in html and "url(" not in html
    assert html.count("<svg") == 2 and "polyline" in html
    assert 'class="tok diff"' in html and "Lyon" in html
    assert "model.layers.7.mlp.down_proj/mul.0" in html


def test_sections_only_when_data(tmp_path):
    html = render_report(title="t", tables={"rows": [{"a": 1}]})
    assert "Verdict" not in html and "<svg" not in html and "<table" in html


def test_rows_of_parses_csv_strings():
    rows = rows_of([{"a": "1", "b": "0.5", "c": "", "d": "x", "e": "-3"}])
    assert rows == [{"a": 1, "b": 0.5, "c": None, "d": "x", "e": -3}]


def test_chromium_loads_without_errors_and_sorts(tmp_path):
    path = _report(tmp_path)
    # a test-only script drives the page: sort candidates by score descending, filter compare rows
    probe = path.with_name("probe.html")
    driver = """<script>
      var th=document.querySelectorAll('#t-candidates th')[4]; th.click(); th.click();
      var first=document.querySelector('#t-candidates tbody tr td:nth-child(2)').textContent;
      var box=document.querySelector('.filters[data-table="t-extra-0"]');
      var sel=box.querySelector('select'); sel.value='fail'; sel.dispatchEvent(new Event('change'));
      document.documentElement.setAttribute('data-probe', first+'|'+box.querySelector('.count').textContent);
    </script></body>"""
    probe.write_text(path.read_text().replace("</body>", driver))
    res = run_chromium(probe, "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert 'data-ready="1"' in dom
    assert not re.search(r'data-js-error="', dom), re.search(r'data-js-error="[^"]*"', dom)
    assert 'data-probe="model.layers.7.mlp.down_proj|1 rows"' in dom


def test_chromium_screenshot_shows_the_chart(tmp_path):
    path = _report(tmp_path)
    shot = tmp_path / "shot.png"
    res = run_chromium(path, f"--screenshot={shot}", "--window-size=1200,1400")
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 1400)
    assert len(data) > 20_000  # a blank page compresses to a few KB; charts and tables do not


def test_chromium_error_hook_reports_script_errors(tmp_path):
    # the no-error check above is only worth something if an error would be seen
    path = _report(tmp_path)
    broken = path.with_name("broken.html")
    broken.write_text(path.read_text().replace("</body>", "<script>undefinedFunction()</script></body>"))
    dom = run_chromium(broken, "--dump-dom").stdout
    assert re.search(r'data-js-error="[^"]*undefinedFunction', dom)
