"""Compare two tensor files (``llmflow compare -gp a.safetensors -mp b.safetensors``).

Supported: ``.safetensors`` (one tensor, or several), ``.npy`` and ``.npz`` (never pickled
objects) and ``.pt``/``.pth``/``.bin`` read with ``torch.load(weights_only=True)`` (a tensor, or
dicts, lists and tuples of tensors, nested: each tensor named by its path, ``layers.0.weight``).
Files of several tensors pair them by name (each side's extra names listed as unmatched); two
files of one tensor each pair those whatever their names. Nothing is unpickled beyond what
``weights_only`` allows: a file that holds other pickled objects is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmflow.compare.algorithms import load_algorithms, run_algorithm
from llmflow.compare.metrics import compare_tensors, judge
from llmflow.dtypes import dtype_name
from llmflow.errors import UserError
from llmflow.formats._safe import refused_pickle

SUFFIXES = (".safetensors", ".npy", ".npz", ".pt", ".pth", ".bin")


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Key -> tensor of one file (a single tensor has the key ``""``)."""
    p = Path(path)
    suffix = p.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            return dict(load_file(str(p)))
        if suffix == ".npy":
            import numpy as np

            return {"": torch.from_numpy(np.load(p, allow_pickle=False))}
        if suffix == ".npz":
            import numpy as np

            with np.load(p, allow_pickle=False) as archive:
                return {str(k): torch.from_numpy(archive[k]) for k in archive.files}
        if suffix in (".pt", ".pth", ".bin"):
            obj = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(obj, torch.Tensor):
                return {"": obj}
            found: dict[str, torch.Tensor] = {}
            other = _flatten(obj, "", found)
            if found and other is None:
                return found
            what = other or type(obj).__name__
            raise UserError(f"{p}: expected a tensor or dicts/lists of tensors, found {what}")
    except UserError:
        raise
    except Exception as exc:  # numpy/safetensors/torch each raise their own error types
        refused = refused_pickle(p, exc)
        if refused:
            raise UserError(refused) from exc
        raise UserError(f"{p}: cannot read tensor file: {type(exc).__name__}: {exc}") from exc
    raise UserError(f"{p}: unsupported tensor file (expected one of {', '.join(SUFFIXES)})")


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> str | None:
    """Tensors of nested dicts/lists/tuples into ``out`` by dotted path; the first thing that is
    none of those (described), or None."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
        return None
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return f"{type(obj).__name__} at {prefix or 'the top level'}"
    for k, v in items:
        bad = _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
        if bad:
            return bad
    return None


def compare_files(golden: str | Path, target: str | Path, *, algorithms: list[str] | None = None,
                  thresholds: dict | None = None, target_dtype: str | None = None,
                  base_dir: str | Path = ".", kl: bool = True) -> list[dict[str, Any]]:
    """One row per tensor: a single tensor each, or the keys both files share (others unmatched);
    without ``kl`` no KL divergence (a tensor file has no logits level)."""
    g_all, t_all = load_tensors(golden), load_tensors(target)
    if len(g_all) == 1 and len(t_all) == 1:
        keys = [(next(iter(g_all)), next(iter(t_all)))]
    else:
        keys = [(k, k) for k in g_all if k in t_all]
    algs = load_algorithms(algorithms or [], base_dir)
    rows: list[dict[str, Any]] = []
    for gk, tk in keys:
        g, t = g_all[gk], t_all[tk]
        row: dict[str, Any] = {"name": gk or Path(golden).name,
                               "golden_dtype": dtype_name(g.dtype),
                               "target_dtype": dtype_name(t.dtype),
                               "golden_shape": list(g.shape), "target_shape": list(t.shape)}
        row.update(compare_tensors(g, t, kl=kl))
        gf, tf = g.float(), t.float()
        for name, func in algs.items():
            row.update(run_algorithm(name, func, gf, tf) if gf.shape == tf.shape else
                       {name: None, f"{name}_message": "skipped: shape mismatch"})
        j = judge(row, target_dtype or row["target_dtype"], thresholds)
        row.update(verdict=j.verdict, code=j.code, reason=j.reason)
        rows.append(row)
    if not (len(g_all) == 1 and len(t_all) == 1):
        for side, mine, other in (("golden", g_all, t_all), ("target", t_all, g_all)):
            rows += [{"name": k, "verdict": "unmatched", "code": f"unmatched_{side}",
                      "reason": f"unmatched {side}"} for k in mine if k not in other]
    return rows
