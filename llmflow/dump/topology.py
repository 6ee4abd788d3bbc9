"""The module tree of a model, as recorded in a dump's topology.json.

Each node is ``{"name", "type", "children": [...], "params": {full param name: shape}}`` with the
root named ``""``. Only a module's own parameters are listed at its node (``recurse=False``), so
each parameter appears once. The per-step execution order is written by the dump writer to
``rank{R}/order.jsonl`` and merged in by the reader as ``"execution": {rank: {step: [names]}}``.
"""

from __future__ import annotations

from typing import Any

import torch


def module_tree(model: torch.nn.Module) -> dict[str, Any]:
    """The nested module tree of ``model``."""

    def node(name: str, module: torch.nn.Module) -> dict[str, Any]:
        prefix = f"{name}." if name else ""
        return {
            "name": name,
            "type": type(module).__name__,
            "params": {prefix + p: list(v.shape) for p, v in module.named_parameters(recurse=False)},
            "children": [node(prefix + child, m) for child, m in module.named_children()],
        }

    return node("", model)
