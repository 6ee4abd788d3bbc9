"""``<run-dir>/summary.json``: the run at a glance, rewritten atomically whenever a stage changes.

Top-level keys: workflow, workflow_file, run_dir, params, status, outcome (the run's conclusion,
conclusion.py; null while running and when no stage set one), started, updated, stages (each with
its own ``outcome``); plus each stage's ``ctx.summary`` merged in, in execution order
(``verdict``, ``compare``, ...).
A stage may not overwrite those reserved keys. The shape is ``llmflow.results.summary.RunSummary``
(``schemas/summary.schema.json`` is generated from it); a typed block is set as its ``to_json``.
Written through the run's ``Redactor``: no secret value, no credential inside a URL.

A full disk must not leave the file saying "running" after the run ended: a write that fails is
retried once with the small form (the head, and each stage's type, status and error), and if even
that fails the run goes on and stderr says so once.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from typing import Any

from llmflow.atomic import atomic_write_json
from llmflow.redaction import Redactor
from llmflow.workflow.conclusion import Conclusion
from llmflow.workflow.model import Workflow
from llmflow.workflow.result import StageResult, now_iso

RESERVED = (
    "workflow", "workflow_file", "run_dir", "params", "status", "outcome", "started", "updated", "stages"
)

log = logging.getLogger("llmflow.workflow")


class SummaryWriter:
    """Builds summary.json from the live ``StageResult``s (kept in execution order)."""

    def __init__(self, path: Path, wf: Workflow, params: dict[str, Any], results: dict[str, StageResult],
                 redact: Redactor | None = None):
        self.path = path
        self.redact = redact or Redactor()
        self.head = {
            "workflow": wf.name,
            "workflow_file": str(wf.path),
            "run_dir": str(path.parent),
            "params": params,
            "started": now_iso(),
        }
        self.results = results
        self.data: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str]] = set()
        self._failed_to_write = False
        self._last_written: str | None = None

    def write(self, status: str, conclusion: Conclusion | None = None) -> dict[str, Any]:
        with self._lock:
            data: dict[str, Any] = {
                **self.head,
                "status": status,
                "outcome": conclusion.to_json() if conclusion else None,
                "updated": now_iso(),
                "stages": {sid: r.to_json() for sid, r in self.results.items()},
            }
            for sid, res in self.results.items():
                if res.status not in ("done", "cached"):
                    continue
                for key, value in res.summary.items():
                    if key in RESERVED:
                        if (sid, key) not in self._warned:
                            self._warned.add((sid, key))
                            log.warning("stage %s: summary key %r is reserved; ignored", sid, key)
                        continue
                    data[key] = value
            data = self.redact(data)  # (URL credentials, secret values in outputs and errors)
            self._write(data)
            self.data = data
            return data

    def _write(self, data: dict[str, Any]) -> None:
        try:
            atomic_write_json(self.path, data, indent=2, durable=True)
            self._last_written = data["status"]
            return
        except OSError:
            pass
        small = {**{k: data[k] for k in RESERVED if k != "params"},
                 "stages": {sid: {k: st[k] for k in ("type", "status", "error")}
                            for sid, st in data["stages"].items()}}
        try:
            atomic_write_json(self.path, small, indent=2, durable=True)
        except OSError as exc:
            if not self._failed_to_write:
                self._failed_to_write = True
                print(f"llmflow: cannot write {self.path} ({exc.strerror or exc}); it may still say "
                      f"status {self._last_written!r}", file=sys.stderr, flush=True)
            return
        self._last_written = data["status"]
