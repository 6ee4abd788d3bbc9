"""``<run-dir>/summary.json``: the run at a glance, rewritten atomically whenever a stage changes.

Top-level keys: workflow, workflow_file, run_dir, params, status, outcome (the run's conclusion,
conclusion.py; null while running and when no stage set one), started, updated, stages (each with
its own ``outcome``); plus each stage's ``ctx.summary`` merged in, in execution order
(``verdict``, ``compare``, ...).
A stage may not overwrite those reserved keys. The shape is ``schemas/summary.schema.json``.
Written through the run's ``Redactor``: no secret value, no credential inside a URL.
"""

from __future__ import annotations

import logging
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
            atomic_write_json(self.path, data, indent=2, durable=True)
            self.data = data
            return data
