"""CSV and XLSX tables of compare rows: streamed, formula-safe, the cells that tripped coloured.

A 7B model's compare is ~100k rows, so the CSV is written row by row from any iterable and the
XLSX uses openpyxl's write-only mode (rows go straight to the zip stream; memory stays flat).
``read_csv_rows`` is the one way a CSV written here is read back (the XLSX, the HTML report), with
one rule for what is a number.

Names in a dump come from someone else's model code and end up in cells a person opens in Excel.
In a CSV, ``safe_cell`` makes sure no text cell can start a formula (``=``, ``+``, ``-``, ``@``, and
the tab / carriage return tricks) by prefixing ``'`` (``guard_text``; text that itself starts with
``'`` is prefixed too, so that ``read_csv_rows`` gives back the exact text by taking one ``'`` off,
``unguard_text``). In an XLSX the cell holds the text itself: a string cell (never a formula) with
Excel's quote-prefix style, the flag Excel sets on text typed after a ``'``. Numbers stay numbers.

Colours are conditional-format rules (``Rule``), not fills: the workbook's own formulas, built here
from column names and constants, never from a cell's text, so a user who sorts, filters or edits a
sheet keeps the colours on the right cells.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any

__all__ = ["CsvStream", "Rule", "columns_of", "guard_text", "parse_cell", "read_csv_rows", "safe_cell",
           "unguard_text", "write_csv", "write_xlsx"]

FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")
GUARD = "'"  # a CSV cell's text that would start like a formula gets this in front
GUARDED_START = (GUARD, *FORMULA_START)  # the text that gets it: the guard itself too, so it can come off
FILLS = {"fail": "FFC7CE", "warn": "FFEB9C"}  # Excel's own "bad" red and "neutral" yellow
NUMBER_FORMAT = "0.000000"  # metrics; large/small magnitudes get the scientific format below
SCI_FORMAT = "0.000E+00"
WIDTH_SAMPLE = 1000  # rows read ahead to size the columns (the rest stream past)
MIN_WIDTH, MAX_WIDTH = 6, 60  # autofit bounds, in characters
FREEZE_AFTER = "name"  # by default the panes freeze right of this column (and below the header)


def guard_text(text: str) -> str:
    """A CSV cell's text that no spreadsheet reads as a formula: ``text`` with ``'`` in front where it
    starts like one (or with ``'`` itself, so that ``unguard_text`` is its exact inverse)."""
    return GUARD + text if text.startswith(GUARDED_START) else text


def unguard_text(text: str) -> str:
    """``guard_text``'s inverse: the text a CSV cell written here stands for (one ``'`` taken off)."""
    return text[1:] if text.startswith(GUARD) else text


def cell_value(value: Any) -> Any:
    """A value a table cell can hold: numbers and bools as they are, None as None, numpy / torch
    scalars as numbers, lists/dicts as JSON text, anything else as its text (not yet guarded)."""
    if value is None or isinstance(value, (bool, int, float)) or type(value) is str:
        return value
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return value.item()  # numpy / torch scalars
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str, separators=(",", ":"))
    return str(value)


def safe_cell(value: Any) -> Any:
    """A value that is safe in a CSV cell: ``cell_value``, its text never starting like a formula
    (``guard_text``)."""
    v = cell_value(value)
    return guard_text(v) if isinstance(v, str) else v


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


# control characters XML 1.0 cannot hold (a name with a BEL in it): written as \x07 and the like
_NOT_IN_XML = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _xlsx_value(value: Any) -> Any:
    """``value`` as an XLSX cell holds it: the text itself (``_text_cell`` keeps it text)."""
    v = cell_value(value)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # Excel has no NaN/Inf numbers; "nan"/"inf"/"-inf" as text
    if isinstance(v, str):
        if _NOT_IN_XML.search(v):
            v = _NOT_IN_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", v)
        if len(v) > 32000:
            return v[:32000] + "..."  # Excel's cell limit is 32767 characters
    return v


def _is_typed(text: str) -> bool:
    """Whether Excel (and openpyxl) would take ``text`` for something other than text: a formula
    (``FORMULA_START``) or an error value (``#N/A``, ``#REF!``, ...)."""
    if text.startswith(FORMULA_START):
        return True
    if not text.startswith("#"):
        return False
    from openpyxl.cell.cell import ERROR_CODES

    return text in ERROR_CODES


def _text_cell(ws: Any, text: str) -> Any:
    """A write-only cell that holds ``text`` as a string (openpyxl takes a leading ``=`` for a
    formula and ``#N/A`` for an error, so the type is set after the value) with the quote-prefix
    style: Excel shows the text and never evaluates it, also when the cell is edited."""
    from openpyxl.cell import WriteOnlyCell

    cell = WriteOnlyCell(ws, value=text)
    cell.data_type = "s"
    cell.quotePrefix = True
    return cell


def _xlsx_cell(ws: Any, value: Any) -> Any:
    """What ``ws.append`` takes for a header's or a note's ``value``: the value, or a text cell."""
    v = _xlsx_value(value)
    return _text_cell(ws, v) if isinstance(v, str) and _is_typed(v) else v


@dataclass(frozen=True)
class Rule:
    """A conditional format: the cells of ``columns`` coloured ``level`` (fail red, warn yellow)
    in the rows where ``condition`` holds.

    ``condition`` is an Excel formula for one row: ``{self}`` stands for the cell being coloured,
    ``{NAME}`` for column NAME's cell in the same row. It is built from column names and
    constants only (``excel_text`` quotes a constant); a rule naming a column the sheet lacks is
    left out.
    """

    columns: tuple[str, ...]
    level: str
    condition: str


def excel_text(text: str) -> str:
    """``text`` as an Excel string literal (quotes doubled; braces doubled for ``Rule``'s format)."""
    return '"' + text.replace('"', '""').replace("{", "{{").replace("}", "}}") + '"'


def equals_rule(column: str, value: str, level: str) -> Rule:
    """Colour ``column``'s cell where it holds ``value``."""
    return Rule((column,), level, "{self}=" + excel_text(value))


VERDICT_RULES = (equals_rule("verdict", "fail", "fail"), equals_rule("verdict", "warn", "warn"))


def _shown_width(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, float):
        return 10
    return len(str(value))


def write_xlsx(sheets: Mapping[str, Sequence[dict[str, Any]] | Iterable[dict[str, Any]]], path: str | Path,
               columns: Mapping[str, Sequence[str]] | None = None, rules: Sequence[Rule] = VERDICT_RULES,
               notes: Mapping[str, Sequence[tuple[str, Any]]] | None = None,
               freeze_after: Mapping[str, str] | None = None) -> None:
    """One sheet per key, in order (sheet names made Excel-safe): bold header, autofilter, columns
    autofit to their content (the first ``WIDTH_SAMPLE`` rows, within ``MIN_WIDTH``..``MAX_WIDTH``),
    panes frozen below the header and right of the name columns (``freeze_after[sheet]``, else
    ``FREEZE_AFTER`` where the sheet has it), numbers stored as numbers, text formula-safe.
    ``rules``: the conditional formats of every sheet (by default the verdict cell of a fail or warn
    row). ``notes[sheet]``: (label, value) lines above that sheet's table. Rows are streamed."""
    from openpyxl import Workbook
    from openpyxl.cell import WriteOnlyCell
    from openpyxl.styles import Font

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wb = Workbook(write_only=True)
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
        lines = list((notes or {}).get(name) or [])
        top = len(lines) + 1 + bool(lines)  # the header's row
        # (write-only: widths and panes go out with the first row, so they are set before it)
        _autofit(ws, cols, head, lines)
        after = (freeze_after or {}).get(name, FREEZE_AFTER)
        ws.freeze_panes = _cell_ref(cols.index(after) + 1 if after in cols else 0, top + 1)
        for label, value in lines:
            ws.append([_bold(ws, _xlsx_cell(ws, label), bold), _xlsx_cell(ws, value)])
        if lines:
            ws.append([])
        ws.append([_bold(ws, _xlsx_cell(ws, c), bold) for c in cols])
        n = 0
        for row in chain(head, it):
            out = []
            for c in cols:
                v = _xlsx_value(row.get(c))
                if isinstance(v, float):
                    cell = WriteOnlyCell(ws, value=v)
                    sci = v != 0 and not 1e-4 <= abs(v) < 1e6
                    cell.number_format = SCI_FORMAT if sci else NUMBER_FORMAT
                    out.append(cell)
                elif isinstance(v, str) and _is_typed(v):
                    out.append(_text_cell(ws, v))
                else:
                    out.append(v)
            ws.append(out)
            n += 1
        if cols:
            ws.auto_filter.ref = f"{_cell_ref(0, top)}:{_cell_ref(len(cols) - 1, top + max(n, 1))}"
            _add_rules(ws, cols, rules, top + 1, top + max(n, 1))
    wb.save(path)


def _bold(ws: Any, value: Any, font: Any) -> Any:
    """``value`` (a value or a cell) as a cell in ``font``."""
    from openpyxl.cell import Cell, WriteOnlyCell

    cell = value if isinstance(value, Cell) else WriteOnlyCell(ws, value=value)
    cell.font = font
    return cell


def _cell_ref(col: int, row: int, *, fixed_col: bool = False) -> str:
    """``(0, 2)`` -> "A2" (``col`` counted from 0); ``fixed_col``: "$A2"."""
    from openpyxl.utils import get_column_letter

    return ("$" if fixed_col else "") + get_column_letter(col + 1) + str(row)


def _autofit(ws: Any, cols: Sequence[str], head: Sequence[dict[str, Any]],
             lines: Sequence[tuple[str, Any]]) -> None:
    """Each column as wide as its widest header or cell in ``head`` (the notes' labels count in
    the first column, their values in the second), within ``MIN_WIDTH``..``MAX_WIDTH``."""
    from openpyxl.utils import get_column_letter

    widths = [max([len(str(c)) + 3] + [_shown_width(_xlsx_value(r.get(c))) + 1 for r in head]) for c in cols]
    for i, part in enumerate(zip(*lines, strict=True)):
        if i < len(widths):
            widths[i] = max([widths[i]] + [_shown_width(_xlsx_value(v)) + 1 for v in part])
    for i, width in enumerate(widths):
        ws.column_dimensions[get_column_letter(i + 1)].width = min(max(width, MIN_WIDTH), MAX_WIDTH)


def _add_rules(ws: Any, cols: Sequence[str], rules: Sequence[Rule], first: int, last: int) -> None:
    """The sheet's conditional formats over its data rows ``first``..``last``."""
    from openpyxl.formatting.rule import FormulaRule
    from openpyxl.styles import PatternFill

    where = {c: i for i, c in enumerate(cols)}
    for rule in rules:
        if rule.level not in FILLS:
            raise ValueError(f"rule level {rule.level!r}: one of {sorted(FILLS)}")
        targets = [where[c] for c in rule.columns if c in where]
        refs = {c: _cell_ref(i, first, fixed_col=True) for c, i in where.items()}
        try:
            formulas = [rule.condition.format(self=_cell_ref(i, first), **refs) for i in targets]
        except KeyError:
            continue  # the rule reads a column this sheet does not have
        colour = FILLS[rule.level]
        fill = PatternFill(start_color=colour, end_color=colour, fill_type="solid")
        for i, formula in zip(targets, formulas, strict=True):
            ws.conditional_formatting.add(f"{_cell_ref(i, first)}:{_cell_ref(i, last)}",
                                          FormulaRule(formula=[formula], fill=fill))


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


class _LastLine:
    """The file a ``csv.writer`` writes into when the caller wants the line itself (the writer
    hands over each row as one string)."""

    text = ""

    def write(self, text: str) -> None:
        self.text = text


class CsvStream:
    """A CSV file written one row at a time with a fixed header (several can be open at once)."""

    def __init__(self, path: str | Path, columns: Sequence[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = list(columns)
        self.rows = 0
        self._f = self.path.open("w", newline="", encoding="utf-8")
        self._line = _LastLine()
        self._w = csv.writer(self._line)
        self._w.writerow([_csv_value(c) for c in self.columns])
        self._f.write(self._line.text)

    def render(self, row: dict[str, Any], _n: frozenset = _NUMBERS, _g: Any = guard_text) -> str:
        """``row``'s line in this file's columns (a compare row goes to one file per level it
        belongs to: rendered once, its ~25 floats formatted once)."""
        # numbers, the most cells of a compare row, skip the checks; text goes straight to the guard
        # (going through _csv_value, a second call a cell, is most of the cost of a 60-column row)
        self._w.writerow([v if type(v) in _n else (_g(v) if type(v) is str
                                                   else ("" if v is None else _csv_value(v)))
                          for v in map(row.get, self.columns)])
        return self._line.text

    def write_line(self, line: str) -> None:
        """Append a line ``render`` made (for this file's columns)."""
        self._f.write(line)
        self.rows += 1

    def write(self, row: dict[str, Any]) -> None:
        self.write_line(self.render(row))

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
    ``label_columns`` as labels, the rest "auto"), but a cell the writer guarded (it starts with
    ``'``) is text, its guard taken off (``unguard_text``): the header and the cells hold what was
    written, ``=1+1`` and not ``'=1+1``. Streams: for turning a big CSV into an XLSX sheet or an HTML
    table."""
    text, label = set(text_columns), set(label_columns)
    with Path(path).open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is not None:
            reader.fieldnames = [unguard_text(k) for k in reader.fieldnames]
        kinds = {k: "text" if k in text else "label" if k in label else "auto"
                 for k in reader.fieldnames or ()}
        for raw in reader:
            yield {k: unguard_text(v) if v and v.startswith(GUARD) else parse_cell(v, kinds.get(k, "auto"))
                   for k, v in raw.items() if k is not None}
