"""CSV/XLSX tables: formula-safe cells, streaming, coloured cells, column widths, frozen header,
autofilter, and the one rule CSV cells are read back by."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import openpyxl
import pytest

from llmflow.report.tables import parse_cell, read_csv_rows, safe_cell, write_csv, write_xlsx

EVIL = ["=cmd|' /C calc'!A0", "+1+1", "-2+3", "@SUM(A1)", "\t=1", "＝1"]


@pytest.mark.parametrize("text", EVIL)
def test_safe_cell_never_starts_a_formula(text: str) -> None:
    out = safe_cell(text)
    assert out.startswith("'") and out[1:] == text


def test_safe_cell_keeps_numbers_and_plain_text() -> None:
    assert safe_cell(-1.5) == -1.5 and safe_cell(-3) == -3 and safe_cell(True) is True
    assert safe_cell(None) is None
    assert safe_cell("model.layers.0") == "model.layers.0"
    assert safe_cell([1, 2]) == "[1,2]"
    assert safe_cell(["=x"]) == '["=x"]'  # JSON text starts with a bracket: safe


def test_csv_formula_names_and_numbers(tmp_path: Path) -> None:
    rows = [{"name": n, "value": -0.5, "verdict": "fail"} for n in EVIL] + [{"name": "ok", "extra": 1}]
    p = tmp_path / "out.csv"
    assert write_csv(rows, p) == len(rows)
    with p.open(newline="", encoding="utf-8") as f:
        got = list(csv.DictReader(f))
    assert [r["name"] for r in got[:-1]] == ["'" + n for n in EVIL]
    assert got[0]["value"] == "-0.5"  # numbers stay numbers
    assert list(got[0]) == ["name", "value", "verdict", "extra"] and got[-1]["extra"] == "1"
    for r in got:
        assert not r["name"].startswith(("=", "+", "-", "@"))


def test_csv_streams_a_generator(tmp_path: Path) -> None:
    def gen():
        for i in range(5000):
            yield {"i": i, "sq": i * i}

    p = tmp_path / "g.csv"
    assert write_csv(gen(), p, columns=["i", "sq"]) == 5000
    assert p.read_text().splitlines()[-1] == "4999,24990001"
    assert write_csv(iter([]), tmp_path / "e.csv") == 0


def test_xlsx_sheets_colours_and_safety(tmp_path: Path) -> None:
    rows = [
        {"name": "=HYPERLINK(\"http://x\")", "cosine_similarity": 0.5, "verdict": "fail"},
        {"name": "model.layers.1", "cosine_similarity": 0.9991, "verdict": "warn"},
        {"name": "model.layers.2", "cosine_similarity": 1.0, "verdict": "pass", "kl": math.nan},
    ]
    p = tmp_path / "r.xlsx"
    write_xlsx({"module": rows, "layer": rows[:1], "bad/name:[x]": []}, p)
    wb = openpyxl.load_workbook(p)
    assert wb.sheetnames == ["module", "layer", "bad_name__x_"]
    ws = wb["module"]
    assert ws.freeze_panes == "A2"
    assert ws.auto_filter.ref == "A1:D4"
    assert [c.value for c in ws[1]] == ["name", "cosine_similarity", "verdict", "kl"]
    assert ws["A2"].value == "'=HYPERLINK(\"http://x\")" and ws["A2"].data_type == "s"
    assert ws["B2"].value == 0.5 and ws["B2"].number_format != "General"
    # by default the verdict cell is coloured, not the row
    assert ws["C2"].fill.start_color.rgb.endswith("FFC7CE")  # fail: red
    assert ws["C3"].fill.start_color.rgb.endswith("FFEB9C")  # warn: yellow
    assert ws["A2"].fill.fill_type is None and ws["B2"].fill.fill_type is None
    assert ws["C4"].fill.fill_type is None
    assert ws["D4"].value == "nan"
    for row in ws.iter_rows():
        for c in row:
            assert c.data_type != "f"
    # columns sized to their content: the long name's column is wider than the verdict's
    assert ws.column_dimensions["A"].width > ws.column_dimensions["C"].width >= len("verdict")


def test_xlsx_marks_colour_the_named_cells(tmp_path: Path) -> None:
    rows = [{"name": "a", "cosine_similarity": 0.5, "rmse": 0.1, "verdict": "fail"},
            {"name": "b", "cosine_similarity": 0.99, "rmse": 0.3, "verdict": "warn"}]
    p = tmp_path / "m.xlsx"
    write_xlsx({"s": rows}, p, marks=lambda r: {"cosine_similarity": "fail"} if r["name"] == "a"
               else {"rmse": "warn"})
    ws = openpyxl.load_workbook(p)["s"]
    assert ws["B2"].fill.start_color.rgb.endswith("FFC7CE") and ws["C2"].fill.fill_type is None
    assert ws["C3"].fill.start_color.rgb.endswith("FFEB9C") and ws["B3"].fill.fill_type is None
    assert ws["D2"].fill.fill_type is None  # only what marks names


@pytest.mark.parametrize(("text", "kind", "value"), [
    ("", "auto", None), ("3", "auto", 3), ("-3", "auto", -3), ("0.25", "auto", 0.25), ("True", "auto", True),
    ("1e-05", "auto", 1e-05), ("model.layers.0", "auto", "model.layers.0"), ("7", "text", "7"),
    ("0", "label", 0), ("1.0", "label", "1.0"), ("kw:mask", "label", "kw:mask"), ("", "text", None),
])
def test_parse_cell_one_rule(text: str, kind: str, value: object) -> None:
    got = parse_cell(text, kind)
    assert got == value and type(got) is type(value)


def test_csv_round_trip_with_column_kinds(tmp_path: Path) -> None:
    rows = [{"name": "7", "index": "1.0", "step": 2, "cos": math.nan, "ok": True},
            {"name": "x", "index": "0", "step": 3, "cos": 0.5, "ok": False}]
    p = tmp_path / "r.csv"
    write_csv(rows, p)
    back = list(read_csv_rows(p, text_columns=["name"], label_columns=["index"]))
    assert [r["name"] for r in back] == ["7", "x"] and [r["index"] for r in back] == ["1.0", 0]
    assert [r["step"] for r in back] == [2, 3] and math.isnan(back[0]["cos"]) and back[1]["ok"] is False
