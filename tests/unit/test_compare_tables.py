"""CSV/XLSX tables: formula-safe cells, streaming, coloured cells, column widths, frozen header,
autofilter, and the one rule CSV cells are read back by."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import openpyxl
import pytest

from llmflow.report.tables import (
    MAX_WIDTH,
    MIN_WIDTH,
    CsvStream,
    Rule,
    equals_rule,
    guard_text,
    parse_cell,
    read_csv_rows,
    safe_cell,
    unguard_text,
    write_csv,
    write_xlsx,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from xlsx_rules import coloured_cells  # noqa: E402

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
    assert ws.freeze_panes == "B2"  # below the header, right of the name column
    assert ws.auto_filter.ref == "A1:D4"
    assert [c.value for c in ws[1]] == ["name", "cosine_similarity", "verdict", "kl"]
    # the name itself, as text Excel never evaluates (a string cell with the quote prefix)
    assert ws["A2"].value == "=HYPERLINK(\"http://x\")" and ws["A2"].data_type == "s" and ws["A2"].quotePrefix
    assert not ws["A3"].quotePrefix
    assert ws["B2"].value == 0.5 and ws["B2"].number_format != "General"
    # by default a rule colours the verdict cell, not the row; no cell holds a fill of its own
    assert coloured_cells(ws) == {"C2": "fail", "C3": "warn"}
    assert ws["D4"].value == "nan"
    for row in ws.iter_rows():
        for c in row:
            assert c.data_type != "f" and c.fill.fill_type is None
    # columns sized to their content: the long name's column is wider than the verdict's
    assert ws.column_dimensions["A"].width > ws.column_dimensions["C"].width >= len("verdict")


def test_xlsx_rules_colour_the_named_cells_and_follow_a_sort(tmp_path: Path) -> None:
    rows = [{"name": "a", "cosine_similarity": 0.5, "rmse": 0.1, "verdict": "fail",
             "why": "cosine_similarity"},
            {"name": "b", "cosine_similarity": 0.99, "rmse": 0.3, "verdict": "warn", "why": "rmse"}]
    p = tmp_path / "m.xlsx"
    rules = [Rule(("cosine_similarity", "rmse"), "fail", '{why}="cosine_similarity"'),
             Rule(("rmse",), "warn", '{why}="rmse"'), Rule(("absent",), "fail", "{self}>0"),
             Rule(("rmse",), "fail", "{nowhere}>0")]
    write_xlsx({"s": rows}, p, rules=rules)
    ws = openpyxl.load_workbook(p)["s"]
    assert coloured_cells(ws) == {"B2": "fail", "C2": "fail", "C3": "warn"}  # rules on absent columns: none
    # the rule is the workbook's: rows in another order keep their colours on the same values
    write_xlsx({"s": rows[::-1]}, p, rules=rules)
    assert coloured_cells(openpyxl.load_workbook(p)["s"]) == {"B3": "fail", "C3": "fail", "C2": "warn"}


def test_xlsx_cells_never_formulas_even_where_rules_are(tmp_path: Path) -> None:
    # a user string that looks like the rule's own formula stays text
    rows = [{"name": n, "verdict": "fail", "code": n} for n in ("=1+1", "+A1", "-2", "@SUM(A1)", '="fail"')]
    p = tmp_path / "f.xlsx"
    write_xlsx({"s": rows}, p,
               rules=[equals_rule("verdict", "fail", "fail"), equals_rule("code", "=1+1", "warn")],
               notes={"s": [("headline", "=cmd|' /C calc'!A0"), ("verdict", "fail")]})
    ws = openpyxl.load_workbook(p)["s"]
    cells = [c for row in ws.iter_rows() for c in row if c.value is not None]
    assert all(c.data_type != "f" for c in cells)
    # two notes, a blank line, the header
    assert ws["B1"].value == "=cmd|' /C calc'!A0" and ws["B1"].quotePrefix and ws["A4"].value == "name"
    assert ws.freeze_panes == "B5" and ws.auto_filter.ref == "A4:C9"
    # the code "=1+1" is that text (not a formula), so the rule comparing it to the text "=1+1" holds
    assert coloured_cells(ws) == {**{f"B{r}": "fail" for r in range(5, 10)}, "C5": "warn"}


def test_xlsx_autofit_is_bounded(tmp_path: Path) -> None:
    rows = [{"name": "x" * 500, "v": 1, "verdict": "pass"}]
    p = tmp_path / "w.xlsx"
    write_xlsx({"s": rows}, p)
    ws = openpyxl.load_workbook(p)["s"]
    assert ws.column_dimensions["A"].width == MAX_WIDTH and ws.column_dimensions["B"].width == MIN_WIDTH


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


def test_xlsx_writes_a_name_with_control_characters_escaped(tmp_path: Path) -> None:
    """XML cannot hold a BEL or a NUL: a dump's name with one is written as ``\\x07``, not a crash."""
    p = tmp_path / "t.xlsx"
    write_xlsx({"s": [{"name": "model.layers.1.ml\x07p\x00", "note": "tab\tand\nnewline kept"}]}, p)
    ws = openpyxl.load_workbook(p)["s"]
    assert [c.value for c in ws[2]] == ["model.layers.1.ml\\x07p\\x00", "tab\tand\nnewline kept"]


# names a dump may hold that start like a formula, or like the CSV guard itself
GUARDED_NAMES = ["=1+1", "+SUM(1;2)", "@SUM(A1)", "-1+2", "'quoted", "''=x", "\tname", "'=1+1", "'", "-3",
                 "+1"]


@pytest.mark.parametrize("name", GUARDED_NAMES)
def test_csv_guards_a_name_and_reads_it_back_exactly(tmp_path: Path, name: str) -> None:
    """The CSV cell starts with the guard's ``'``; ``read_csv_rows`` gives the name itself back, in a
    text column and in an "auto" one alike (``-3`` stays the text it was), from both writers."""
    row = {"name": name, "module_type": name, "cos": -0.5}
    assert unguard_text(guard_text(name)) == name and guard_text(name) == "'" + name
    for how in ("write_csv", "CsvStream"):
        p = tmp_path / f"{how}.csv"
        if how == "write_csv":
            write_csv([row], p)
        else:
            with CsvStream(p, list(row)) as s:
                s.write(row)
        with p.open(newline="", encoding="utf-8") as f:
            raw = next(csv.DictReader(f))
        assert raw["name"] == raw["module_type"] == "'" + name, how
        (back,) = read_csv_rows(p, text_columns=["name"])
        assert back == {"name": name, "module_type": name, "cos": -0.5}, how


def test_a_plain_name_is_not_guarded_and_a_guarded_header_reads_back(tmp_path: Path) -> None:
    p = tmp_path / "h.csv"
    write_csv([{"=col": "model.layers.0", "n": 3}], p)
    assert p.read_text(encoding="utf-8").splitlines() == ["'=col,n", "model.layers.0,3"]
    assert list(read_csv_rows(p)) == [{"=col": "model.layers.0", "n": 3}]


@pytest.mark.parametrize("name", [*GUARDED_NAMES, "#N/A", "#REF!"])
def test_xlsx_holds_the_name_itself_as_text_with_the_quote_prefix(tmp_path: Path, name: str) -> None:
    """The xlsx cell is the real name, a string (never a formula or an error value), and text that
    Excel would take for a formula carries Excel's quote prefix; written straight from rows and
    through the CSV (as compare writes it)."""
    csv_path = tmp_path / "r.csv"
    write_csv([{"name": name, "v": 1.0}], csv_path)
    for how, rows in (("rows", [{"name": name, "v": 1.0}]), ("csv", read_csv_rows(csv_path, ["name"]))):
        p = tmp_path / f"{how}.xlsx"
        write_xlsx({"s": rows}, p, notes={"s": [("headline", name)]})
        ws = openpyxl.load_workbook(p)["s"]
        for cell in (ws["A4"], ws["B1"]):  # the row's name, the note's value
            assert cell.value == name and cell.data_type == "s", (how, cell.coordinate)
            assert cell.quotePrefix == (name.startswith(("=", "+", "-", "@", "\t")) or name.startswith("#"))
