"""A model whose module and save() names start like spreadsheet formulas, compared the user's way
(``python -m llmflow compare``): the CSV guards the names, the XLSX and the HTML report show the
names themselves, as compare_summary.json holds them."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import openpyxl
import torch
from torch import nn

import llmflow
from llmflow import DumpConfig, register_hook
from llmflow.stages.base import StageContext
from llmflow.stages.report import ReportStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import find, parse_dom  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHILDREN = ["=1+1", "+SUM(1;2)", "@SUM(A1)", "-1+2", "'quoted", "+1"]
SAVED = "=HYPERLINK(\"http://evil\",\"x\")"


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        for name in CHILDREN:
            self.add_module(name, Inner())
        self.head = nn.Linear(8, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for name in CHILDREN:
            h = h + getattr(self, name)(h)
        llmflow.save(SAVED, h)
        return self.head(h)


def _dump(path: Path, fault: bool) -> None:
    torch.manual_seed(0)
    model = Root().eval()
    if fault:  # the target's "+SUM(1;2)" is off: its rows and the ones after it fail
        with torch.no_grad():
            getattr(model, "+SUM(1;2)").lin.weight.mul_(1.5)
    handle = register_hook(model, DumpConfig(dump_path=str(path), token_range="all", module_list=[],
                                             tensor_part=2))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(2):
            logits = model(ids)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    handle.remove()


def test_formula_names_are_themselves_in_the_xlsx_and_the_report(tmp_path: Path) -> None:
    golden, target, out = tmp_path / "golden", tmp_path / "target", tmp_path / "out"
    _dump(golden, fault=False)
    _dump(target, fault=True)
    res = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(golden), "-mp", str(target),
                          "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "FAILED" in res.stdout, res.stdout + res.stderr  # the fault is found
    summary = json.loads((out / "compare_summary.json").read_text())
    expected = {*CHILDREN, *(f"{n}.lin" for n in CHILDREN)}

    # the CSV: every such name behind the guard's apostrophe
    with open(summary["csv"]["module"], newline="", encoding="utf-8") as f:
        csv_names = {r["name"] for r in csv.DictReader(f)}
    assert {"'" + n for n in expected} <= csv_names

    # the XLSX: the names themselves, string cells, the formula-like ones quote-prefixed
    wb = openpyxl.load_workbook(out / "compare.xlsx")
    ws = wb["module"]
    col = [c.value for c in ws[1]].index("name") + 1
    cells = [ws.cell(r, col) for r in range(2, ws.max_row + 1)]
    assert expected <= {c.value for c in cells}
    for c in cells:
        assert c.data_type == "s" and c.quotePrefix == c.value.startswith(("=", "+", "-", "@")), c.value
    save_col = [c.value for c in wb["save"][1]].index("name") + 1
    assert wb["save"].cell(2, save_col).value == SAVED
    assert all(c.data_type != "f" for s in wb.worksheets for row in s.iter_rows() for c in row)

    # the verdict's names: the first failing row is the faulty module, as in the XLSX
    first = summary["levels"]["module"]["first_fail"]
    assert first["name"] in ("+SUM(1;2)", "+SUM(1;2).lin")

    # the HTML report (the workflow's report stage, on these CSVs): rows anchored by the real names
    run = tmp_path / "run"
    (run / "report").mkdir(parents=True)
    ctx = StageContext(stage_id="report", params={"csv": summary["csv"], "xlsx": summary["xlsx"]},
                       out_dir=run / "report", final_dir=run / "report", run_dir=run,
                       workflow_dir=REPO / "workflows", inputs={}, log=lambda _m: None)
    page = Path(ReportStage().run(ctx)["html"]).read_text(encoding="utf-8")
    anchors = {tr.attrs["data-name"] for tr in find(parse_dom(page), "tr") if "data-name" in tr.attrs}
    verdict_names = {r["name"] for lv in summary["levels"].values() for r in lv["worst"]}
    assert first["name"] in anchors and verdict_names <= anchors
    assert expected | {SAVED} <= anchors
    assert "&#39;=" not in page and "&#39;+" not in page
