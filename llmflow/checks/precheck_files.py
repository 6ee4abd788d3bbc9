"""What a precheck writes, shared by ``llmflow precheck`` and the ``precheck`` stage.

``run_precheck(dump, out_dir, options)`` checks the dump (``precheck.precheck``) and writes into
``out_dir``:

  precheck.csv   every call, worst first (ratio = error / benchmark error), formula-safe
  precheck.xlsx  the same, failing and warning cells marked, plus a sheet of counts per API
  precheck.json  status, headline, first failing call in model order, counts per API, totals,
                 the calls perturbation flags, and the repro folders
  repro/NNN_<call>/  with ``repro=True``: one folder per failing call (``repro.write_repro``); with
                 ``repro_calls``: also one per call named there (its ``name`` or ``record`` as in
                 the table, at every step it runs), ``"all"``: every call that replays; at most
                 ``MAX_REPROS``, the ones left out counted. precheck.json lists the folders
                 (``repros``) and the requested calls that got none, with the reason
                 (``repros_missing``)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmflow.checks.precheck import COLUMNS, OpCall, PrecheckOptions, call_status, precheck
from llmflow.checks.references import resolve
from llmflow.checks.repro import folder_name, write_repro
from llmflow.formats import open_dump
from llmflow.formats.base import DumpReader

TABLES = {kind: f"precheck.{kind}" for kind in ("csv", "xlsx", "json")}
REPRO_DIR = "repro"
OUTPUT_NAMES = (*TABLES.values(), REPRO_DIR)  # everything it may write in out_dir
MAX_REPROS = 50  # repro folders written at most (the worst calls are first in the table anyway)
ALL = "all"  # repro_calls: every call that replays (it has an implementation: not random, not unknown)


def count_calls(reader: DumpReader) -> int:
    """How many API calls the dump holds (the progress bar's total)."""
    return len({(e.rank, e.step, e.name) for e in reader.entries() if e.level == "api" and e.step >= 0})


def run_precheck(dump: str | Path, out_dir: Path, options: PrecheckOptions, *, repro: bool = False,
                 repro_calls: Sequence[str] = (),
                 progress: Callable[[str, float | None], Any] | None = None) -> dict[str, Any]:
    """Precheck ``dump`` and write the files above; returns the result with ``files`` added.
    ``progress(description, total)`` returns a task with ``advance()``."""
    from llmflow.report.tables import equals_rule, write_csv, write_xlsx

    reader = open_dump(dump)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = progress("precheck", count_calls(reader)) if progress else None
    repros: list[dict[str, Any]] = []
    requested = set(repro_calls)
    missing: dict[str, str] = {}  # a requested call -> why it has no repro folder
    left_out = 0

    def on_call(call: OpCall, rows: list[dict[str, Any]]) -> None:
        nonlocal left_out
        if task is not None:
            task.advance()
        asked = requested & {call.name, call.record}
        status = call_status(rows)
        every = ALL in requested and rows[0].get("implementation")
        if not ((repro and status == "fail") or asked or every):
            return
        if call.reason is not None:  # (only a requested call gets here)
            note(asked, f"not replayable: {call.reason}")
            return
        fn, implementation = resolve(call.api, call.args, options.references, call.function)
        if fn is None:
            note(asked, implementation)
            return
        if len(repros) >= MAX_REPROS:
            left_out += 1
            note(asked, f"more than {MAX_REPROS} repro folders asked for")
            return
        if implementation != "reference":
            implementation = rows[0].get("implementation") or implementation
        folder = out_dir / REPRO_DIR / folder_name(len(repros), call.name)
        script = str(write_repro(call, fn, implementation, folder, options.fail_ratio).relative_to(out_dir))
        for row in rows:
            row["repro"] = script
        repros.append({"name": call.name, "step": call.step, "status": status, "script": script})
        missing.update(dict.fromkeys(asked, ""))  # (written, at one step at least)

    def note(names: set[str], why: str) -> None:
        for name in names:
            missing.setdefault(name, why)

    result = precheck(reader, options, on_call=on_call)
    for name in requested - {ALL} - set(missing):
        missing[name] = "no call of this name or record in the dump"
    repros_missing = [{"name": n, "why": why} for n, why in sorted(missing.items()) if why]
    columns = [*COLUMNS, "repro"] if repro or requested else list(COLUMNS)
    files = {kind: out_dir / name for kind, name in TABLES.items()}
    write_csv(result["rows"], files["csv"], columns=columns)
    counts = [{"api": api, **{k: c.get(k, 0) for k in ("pass", "warn", "fail", "not checked")}}
              for api, c in result["counts"].items()]
    write_xlsx({"calls": result["rows"], "per api": counts}, files["xlsx"],
               columns={"calls": columns, "per api": ["api", "pass", "warn", "fail", "not checked"]},
               rules=[equals_rule("status", level, level) for level in ("fail", "warn")])
    summary = {k: result[k] for k in ("status", "headline", "first_fail", "counts", "totals", "perturbed")}
    summary["dump"] = str(reader.path)
    summary["problems"] = reader.problems()
    summary["repros"] = repros
    summary["repros_missing"] = repros_missing
    summary["repros_left_out"] = left_out
    files["json"].write_text(json.dumps(_finite(summary), indent=1, default=str), encoding="utf-8")
    result["files"] = {k: str(v) for k, v in files.items()}
    result["repros"] = repros
    result["repros_missing"] = repros_missing
    return result


def _finite(value: Any) -> Any:
    """JSON without NaN/Infinity (strict parsers refuse them): those numbers become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
