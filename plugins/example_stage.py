"""An example stage plugin: ``checksum``, the sha256 of every file under a directory.

Use it from a workflow without installing anything::

    stages:
      sums:
        uses: ../plugins/example_stage.py:ChecksumStage    # relative to the workflow file
        with: {dir: "${stages.dump.outputs.dump_dir}"}

or register it for every workflow from your own package's pyproject.toml::

    [project.entry-points."llmflow.stages"]
    checksum = "my_package.example_stage:ChecksumStage"

A stage is a ``Stage`` subclass with a ``type``, a ``version`` (bump it when results change), a
JSON Schema of its parameters (``with:``), the outputs it returns and a ``run(ctx)`` that writes
only under ``ctx.out_dir``. ``llmflow stages ../plugins/example_stage.py:ChecksumStage`` shows it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar

from llmflow.errors import UserError
from llmflow.stages.base import Stage, StageContext


class ChecksumStage(Stage):
    """sha256 of every file under a directory (e.g. a dump), with file and byte counts."""

    type: ClassVar[str] = "checksum"
    version: ClassVar[str] = "1"
    params_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["dir"],
        "properties": {
            "dir": {
                "type": "string",
                "description": "Directory to checksum (relative to the workflow file).",
            },
            "pattern": {"type": "string", "default": "**/*", "description": "Glob of the files to include."},
        },
    }
    outputs: ClassVar[dict[str, str]] = {
        "manifest_file": "JSON: relative path -> {sha256, bytes}",
        "files": "number of files",
        "bytes": "total size in bytes",
        "digest": "sha256 over the manifest: one value that changes when any file does",
    }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        root = ctx.resolve_path(ctx.params["dir"])
        if not root.is_dir():
            raise UserError(f"checksum: dir {ctx.params['dir']!r}: no such directory ({root})")
        files = sorted(p for p in root.glob(ctx.params.get("pattern", "**/*")) if p.is_file())
        task = ctx.task(f"hashing {len(files)} files", total=len(files))
        manifest: dict[str, dict[str, Any]] = {}
        for path in files:
            manifest[path.relative_to(root).as_posix()] = {
                "sha256": _sha256(path),
                "bytes": path.stat().st_size,
            }
            task.advance()
        text = json.dumps(manifest, indent=2, sort_keys=True)
        out = ctx.out_dir / "checksums.json"
        out.write_text(text + "\n", encoding="utf-8")
        total = sum(m["bytes"] for m in manifest.values())
        ctx.log(f"{len(manifest)} files, {total} bytes under {root}")
        ctx.summary["checksum"] = {"dir": str(root), "files": len(manifest), "bytes": total}
        return {
            "manifest_file": str(out),
            "files": len(manifest),
            "bytes": total,
            "digest": hashlib.sha256(text.encode()).hexdigest(),
        }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
