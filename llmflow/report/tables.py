"""CSV and XLSX tables of compare rows: streamed, formula-safe, the cells that tripped coloured.

A 7B model's compare is ~100k rows, so the CSV is written row by row from any iterable and the
XLSX uses openpyxl's write-only mode (rows go straight to the zip stream; memory stays flat).
``read_csv_rows`` is the one way a CSV written here is read back (the XLSX, the HTML report), with
one rule for what is a number.

Names in a dump come from someone else's model code and end up in cells a person opens in Excel:
``safe_cell`` makes sure no text cell can start a formula (``=``, ``+``, ``-``, ``@``, and the tab /
carriage return tricks) by prefixing ``'``. Numbers stay numbers.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, islice
from pathlib import Path
from typing import Any

__all__ = ["CsvStream", "columns_of", "parse_cell", "read_csv_rows", "safe_cell", "write_csv", "write_xlsx"]

FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")
FILLS = {"fail": "FFC7CE", "warn": "FFEB9C"}  # Excel's own "bad" red and "neutral" yellow
NUMBER_FORMAT = "0.000000"  # metrics; large/small magnitudes get the scientific format below
SCI_FORMAT = "0.000E+00"
WIDTH_SAMPLE = 1000  # rows read ahead to size the columns (the rest stream past)
MAX_WIDTH = 60
Marks = Callable[[dict[str, Any]], dict[str, str]]  # row -> {column: "fail" | "warn"}


def safe_cell(value: Any) -> Any:
    """A value that is safe in a spreadsheet cell: numbers and bools as they are, None as None,
    lists/dicts as JSON text, and text never starting like a formula (prefixed with ``'``)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if type(value) is str:
        return "'" + value if value.startswith(FORMULA_START) else value
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return value.item()  # numpy / torch scalars
    if isinstance(value, (list, tuple, dict)):
        value = json.dumps(value, default=str, separators=(",", ":"))
    text = str(value)
    if text.startswith(FORMULA_START):
        return "'" + text
    return text


def columns_of(rows: Sequence[dict[str, Any]], first: Sequence[str] = ()) -> list[str]:
    """``first`` then every other key of ``rows`` in order of first appearance."""
    return list(dict.fromkeys(chain(first, (k for r in rows for k in r))))


_NUMBERS = frozenset((int, float, bool))


def _csv_value(value: Any) -> Any:
    if type(value) is list and all(type(x) is int for x in value):
        return "[" + ",".join(map(str, value)) + "]"  # a shape: what json.dumps writes, 5x faster
    v = safe_cell(value)
    return "" if v is None else v


def write_csv(rows: Iterable[dict[str, Any]], path: str | Path, columns: Sequence[str] | None = None) -> int:
    """Write ``rows`` to ``path`` as UTF-8 CSV, one row at a time; returns the number of rows.

    Without ``columns``: a list's keys in order of appearance; an iterator's first row's keys
    (keys that only later rows have are then left out, since the header is already written).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    it: Iterator[dict[str, Any]]
    if columns is None:
        if isinstance(rows, Sequence):
            columns = columns_of(rows)
            it = iter(rows)
        else:
            it = iter(rows)
            first = next(it, None)
            columns = list(first) if first is not None else []
            it = chain([first], it) if first is not None else iter(())
    else:
        it = iter(rows)
    n = 0
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow([_csv_value(c) for c in columns])
        for row in it:
            w.writerow([_csv_value(row.get(c)) for c in columns])
            n += 1
    return n


def _xlsx_value(value: Any) -> Any:
    v = safe_cell(value)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # Excel has no NaN/Inf numbers; "nan"/"inf"/"-inf" as text
    if isinstance(v, str) and len(v) > 32000:
        return v[:32000] + "..."  # Excel's cell limit is 32767 characters
    return v


def verdict_marks(row: dict[str, Any]) -> dict[str, str]:
    """The default cell marks: the ``verdict`` cell of a fail or warn row."""
    v = row.get("verdict")
    return {"verdict": v} if v in FILLS else {}


def _shown_width(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, float):
        return 10
    return len(str(value))


def write_xlsx(sheets: dict[str, Sequence[dict[str, Any]] | Iterable[dict[str, Any]]], path: str | Path,
               columns: dict[str, Sequence[str]] | None = None, marks: Marks | None = None) -> None:
    """One sheet per key (sheet names made Excel-safe): bold frozen header, autofilter, columns
    sized to their content (the first ``WIDTH_SAMPLE`` rows), numbers stored as numbers, text
    formula-safe. ``marks(row)`` names the cells to colour (fail red, warn yellow), by default the
    verdict cell. Rows are streamed."""
    from openpyxl import Workbook
    from openpyxl.cell import WriteOnlyCell
    from openpyxl.styles import Font, PatternFill
    from openpyxl.utils import get_column_letter

    marks = marks or verdict_marks
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wb = Workbook(write_only=True)
    fills = {k: PatternFill("solid", start_color=c, end_color=c) for k, c in FILLS.items()}
    bold = Font(bold=True)
    used: set[str] = set()
    for name, rows in (sheets or {"empty": []}).items():
        cols = list((columns or {}).get(name) or [])
        if not cols:
            if not isinstance(rows, Sequence):
                rows = list(rows)
            cols = columns_of(rows)  # type: ignore[arg-type]
        it = iter(rows)
        head = list(islice(it, WIDTH_SAMPLE))
        ws = wb.create_sheet(_sheet_title(name, used))
        for i, c in enumerate(cols, start=1):
            width = max([len(str(c)) + 3] + [_shown_width(_xlsx_value(r.get(c))) + 1 for r in head])
            ws.column_dimensions[get_column_letter(i)].width = min(width, MAX_WIDTH)
        ws.freeze_panes = "A2"
        header = []
        for c in cols:
            cell = WriteOnlyCell(ws, value=_xlsx_value(c))
            cell.font = bold
            header.append(cell)
        ws.append(header)
        n = 0
        for row in chain(head, it):
            marked = marks(row)
            out = []
            for c in cols:
                v = _xlsx_value(row.get(c))
                fill = fills.get(marked.get(c, ""))
                if isinstance(v, float) or fill is not None:
                    cell = WriteOnlyCell(ws, value=v)
                    if isinstance(v, float):
                        sci = v != 0 and not 1e-4 <= abs(v) < 1e6
                        cell.number_format = SCI_FORMAT if sci else NUMBER_FORMAT
                    if fill is not None:
                        cell.fill = fill
                    out.append(cell)
                else:
                    out.append(v)
            ws.append(out)
            n += 1
        if cols:
            ws.auto_filter.ref = f"A1:{get_column_letter(len(cols))}{n + 1}"
    wb.save(path)


def _sheet_title(name: str, used: set[str]) -> str:
    """Excel sheet names: at most 31 characters, none of ``[]:*?/\\``, unique (case-insensitive)."""
    base = "".join("_" if ch in "[]:*?/\\" else ch for ch in str(name)).strip("'") or "sheet"
    base = base[:31]
    title, i = base, 2
    while title.lower() in used:
        suffix = f"_{i}"
        title, i = base[:31 - len(suffix)] + suffix, i + 1
    used.add(title.lower())
    return title


class CsvStream:
    """A CSV file written one row at a time with a fixed header (several can be open at once)."""

    def __init__(self, path: str | Path, columns: Sequence[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = list(columns)
        self.rows = 0
        self._f = self.path.open("w", newline="", encoding="utf-8")
        self._w = csv.writer(self._f)
        self._w.writerow([_csv_value(c) for c in self.columns])

    def write(self, row: dict[str, Any], _n: frozenset = _NUMBERS, _f: tuple = FORMULA_START) -> None:
        # numbers, the most cells of a compare row, skip the checks; plain text is checked inline
        # (a function call a cell is most of the cost of a 60-column row)
        self._w.writerow([v if type(v) in _n else (("'" + v if v.startswith(_f) else v) if type(v) is str
                                                   else ("" if v is None else _csv_value(v)))
                          for v in map(row.get, self.columns)])
        self.rows += 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> CsvStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_INT = re.compile(r"^[+-]?\d+$")


def parse_cell(text: str | None, kind: str = "auto") -> Any:
    """One CSV cell read back: THE rule for every table llmflow reads.

    Empty -> None. ``kind`` "text": the text as it is (names, dtypes, shapes, reasons: a module
    named ``1`` stays ``"1"``). "label": an integer where the text is one, else the text (an
    ``index`` is ``0`` or ``"1.0"`` or ``"kw:mask"``). "auto": ``True``/``False`` -> bool, an
    integer -> int, a float (``nan``, ``inf`` included) -> float, anything else the text.
    """
    if text is None or text == "":
        return None
    if not isinstance(text, str):  # already read back (a row from read_csv_rows)
        return text
    if kind == "text":
        return text
    if _INT.match(text):
        return int(text)
    if kind == "label":
        return text
    if text in ("True", "False"):
        return text == "True"
    try:
        return float(text)
    except ValueError:
        return text


def read_csv_rows(path: str | Path, text_columns: Iterable[str] = (),
                  label_columns: Iterable[str] = ()) -> Iterator[dict[str, Any]]:
    """Rows of a CSV written here, each cell through ``parse_cell`` (``text_columns`` as text,
    ``label_columns`` as labels, the rest "auto"). Streams: for turning a big CSV into an XLSX
    sheet or an HTML table."""
    text, label = set(text_columns), set(label_columns)
    with Path(path).open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        kinds = {k: "text" if k in text else "label" if k in label else "auto"
                 for k in reader.fieldnames or ()}
        for raw in reader:
            yield {k: parse_cell(v, kinds.get(k, "auto")) for k, v in raw.items() if k is not None}
