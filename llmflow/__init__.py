"""llmflow: find where an LLM's numbers go wrong on new hardware.

The msit-compatible capture API is importable from the top level (one import line to switch)::

    from llmflow import DumpConfig, register_hook, seed_all, set_dump_path
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.9.25"

# name -> module that defines it; imported on first use so `import llmflow` stays cheap
_LAZY = {
    "DumpConfig": "llmflow.dump",
    "register_hook": "llmflow.dump",
    "set_dump_path": "llmflow.dump",
    "save": "llmflow.dump",
    "seed_all": "llmflow.seeding",
    "open_dump": "llmflow.formats",
    "load_model": "llmflow.models",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmflow' has no attribute {name!r}")
