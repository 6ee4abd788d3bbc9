"""The import path of a test's subprocess: this checkout first, then the PYTHONPATH the tests run
under (an Ascend machine's CANN environment puts its Python packages there, and torch_npu needs
them), never one in place of the other."""

from __future__ import annotations

import os
from pathlib import Path


def checkout_path(root: Path | str) -> str:
    """``PYTHONPATH`` for a subprocess that imports llmflow from the checkout at ``root``."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
