"""The conditional formats of an XLSX written by ``llmflow.report.tables``, evaluated the way Excel
would for the formula forms llmflow writes: which cells show red (fail) or yellow (warn).

openpyxl reads rules but does not evaluate them; this reads the few forms ``Rule`` conditions
take (``ref="text"``, ``ref<>0``, ``ref>0``, ``AND(a,b)``, ``ISNUMBER(SEARCH("text",pieces))``) and
fails on any other, so a new form needs a line here, not a silent pass.
"""

from __future__ import annotations

import re
from typing import Any

from openpyxl.utils import column_index_from_string, range_boundaries

LEVELS = {"FFC7CE": "fail", "FFEB9C": "warn"}
_REF = re.compile(r"\$?([A-Z]{1,3})\$?(\d+)")


def coloured_cells(ws: Any) -> dict[str, str]:
    """``{"C2": "fail", ...}``: every cell a rule colours, by the level of its fill."""
    out: dict[str, str] = {}
    for cf in ws.conditional_formatting:
        for rule in cf.rules:
            fill = rule.dxf.fill
            rgb = (fill.bgColor.rgb if fill.bgColor is not None and fill.bgColor.rgb != "00000000"
                   else fill.fgColor.rgb)
            level = LEVELS[str(rgb)[-6:]]
            for rng in cf.sqref.ranges:
                min_col, min_row, max_col, max_row = range_boundaries(rng.coord)
                for row in range(min_row, max_row + 1):
                    for col in range(min_col, max_col + 1):
                        if _holds(rule.formula[0], ws, row - min_row):
                            out[ws.cell(row, col).coordinate] = level
    return out


def _value(ws: Any, ref: str, shift: int) -> Any:
    m = _REF.fullmatch(ref)
    assert m, ref
    v = ws.cell(int(m[2]) + shift, column_index_from_string(m[1])).value
    return "" if v is None else v


def _split_args(text: str) -> list[str]:
    parts, depth, quoted, cur = [], 0, False, ""
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if not quoted and ch == "(":
            depth += 1
        if not quoted and ch == ")":
            depth -= 1
        if not quoted and depth == 0 and ch in ",&":
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    return [*parts, cur]


def _text(piece: str, ws: Any, shift: int) -> str:
    if piece.startswith('"'):
        return piece[1:-1].replace('""', '"')
    return str(_value(ws, piece, shift))


def _holds(formula: str, ws: Any, shift: int) -> bool:
    if formula.startswith("AND(") and formula.endswith(")"):
        return all(_holds(a, ws, shift) for a in _split_args(formula[4:-1]))
    m = re.fullmatch(r'ISNUMBER\(SEARCH\(("(?:[^"]|"")*"),(.*)\)\)', formula)
    if m:
        needle = _text(m[1], ws, shift)
        hay = "".join(_text(p, ws, shift) for p in m[2].split("&"))
        return needle.lower() in hay.lower()
    m = re.fullmatch(r'(\$?[A-Z]+\d+)=("(?:[^"]|"")*")', formula)
    if m:
        return str(_value(ws, m[1], shift)) == _text(m[2], ws, shift)
    m = re.fullmatch(r"(\$?[A-Z]+\d+)(<>|>)0", formula)
    if m:
        v = _value(ws, m[1], shift)
        return isinstance(v, (int, float)) and (v != 0 if m[2] == "<>" else v > 0)
    raise AssertionError(f"a conditional-format formula this helper does not read: {formula}")
