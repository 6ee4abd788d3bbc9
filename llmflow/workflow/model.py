"""The loaded workflow: what ``load_workflow`` returns and everything else reads.

A ``Workflow`` is the merged result of a file and its ``extends:``/``include:`` recipes, with a
``MarkMap`` pointing every key and value back at the file, line and column that defined it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmflow.workflow.marks import Mark, MarkMap


@dataclass
class StageSpec:
    """One entry of ``stages:``.

    ``base_dir``: directory of the file that defined ``uses`` (``file.py:Class`` refs are relative
    to it).
    """

    id: str
    uses: str
    with_: dict[str, Any]
    needs: list[str]
    description: str
    base_dir: Path


@dataclass
class Workflow:
    """A merged workflow. ``path``: the top file (absolute); ``display``: as the user named it."""

    path: Path
    display: str
    name: str
    description: str
    params: dict[str, dict[str, Any]]
    stages: dict[str, StageSpec]
    marks: MarkMap = field(default_factory=MarkMap)
    files: list[str] = field(default_factory=list)  # every file read, top first (display names)

    @property
    def directory(self) -> Path:
        """Directory of the top workflow file: stage paths (``ctx.resolve_path``) are relative to it."""
        return self.path.parent

    def mark(self, *path: Any) -> Mark | None:
        """Mark of the value at ``path`` (e.g. ``"stages", "x", "with", "seed"``)."""
        return self.marks.value(path)

    def key_mark(self, *path: Any) -> Mark | None:
        """Mark of the key naming ``path``."""
        return self.marks.key(path)
