"""What is in a dump, and what one of its tensors holds: the library behind ``llmflow inspect``.

``summarize(reader)``: format, steps, ranks, and per level the entries, names and data kinds.
``find_entries(reader, query, ...)``: the entries named ``query`` (a module path, ``logits``, an
API name) or stored where ``query`` points (a locator from a compare row's
``golden_data_path``/``target_data_path``: ``rank0/data/000003.safetensors:1234``, an msit
``.pth`` or ATB ``.bin`` path, relative to the dump or absolute).
``describe(reader, entry)``: its dtype, shape, locator, recorded statistics and, when it has data,
the statistics of the loaded tensor (one read) and the tensor itself.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

from llmflow.errors import UserError
from llmflow.formats import locator, locator_prefix
from llmflow.formats.base import DumpReader, Entry


def _span(values: list[int]) -> str:
    if not values:
        return "none"
    return f"{values[0]}..{values[-1]} ({len(values)})" if len(values) > 1 else str(values[0])


def summarize(reader: DumpReader) -> dict[str, Any]:
    """The dump at a glance: format, steps, ranks, problems, and per level its counts."""
    entries = reader.entries()
    levels: dict[str, dict[str, Any]] = {}
    names: dict[str, list[str]] = defaultdict(list)
    seen: dict[str, set[str]] = defaultdict(set)
    for e in entries:
        d = levels.setdefault(e.level, {"entries": 0, "names": 0, "steps": set(), "tensors": 0,
                                        "statistics_only": 0, "values": 0, "kinds": Counter()})
        d["entries"] += 1
        d["steps"].add(e.step)
        d["kinds"][e.kind] += 1
        if e.has_data:
            d["tensors"] += 1
        elif e.dtype is not None:
            d["statistics_only"] += 1
        else:
            d["values"] += 1
        if e.name not in seen[e.level]:
            seen[e.level].add(e.name)
            names[e.level].append(e.name)
    for level, d in levels.items():
        d["names"] = len(seen[level])
        d["steps"] = _span(sorted(d["steps"]))
        d["kinds"] = dict(d["kinds"])
        d["first_names"] = names[level][:5]
    return {"path": str(reader.path), "format": reader.format, "entries": len(entries),
            "steps": reader.steps(), "ranks": reader.ranks(), "levels": levels,
            "problems": list(reader.problems())}


def _as_locator(query: str, reader: DumpReader) -> set[str]:
    """The locator spellings ``query`` may be: as given, without the reader's prefix, and an
    absolute path made relative to the dump (``file`` or ``file:key``)."""
    prefix = locator_prefix(reader)
    path, sep, key = query.rpartition(":") if ":" in query.rpartition("/")[2] else (query, "", "")
    out = {query, query.removeprefix(prefix)}
    p = Path(path)
    if p.is_absolute():
        try:
            rel = p.resolve().relative_to(Path(reader.path).resolve()).as_posix() + sep + key
        except (ValueError, OSError):
            return out
        out |= {rel, rel.removeprefix(prefix)}
    return out


def find_entries(reader: DumpReader, query: str, *, step: int | None = None, index: str | None = None,
                 kind: str | None = None, rank: int | None = None) -> list[Entry]:
    """Entries named ``query`` or stored at the locator ``query``, filtered; UserError when none."""
    import difflib

    entries = reader.entries()
    found = [e for e in entries if e.name == query]
    if not found:
        wanted, prefix = _as_locator(query, reader), locator_prefix(reader)
        found = [e for e in entries
                 if e.has_data and (e.key in wanted or locator(reader, e, prefix) in wanted
                                    or Path(e.key).name == query)]
    if not found and (native := reader.native_names(query)):  # (the dump's own tool's name)
        found = [e for e in entries if e.name in native]
    if not found:
        close = difflib.get_close_matches(query, sorted({e.name for e in entries}), n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise UserError(f"{reader.path}: no entry named or stored at {query!r}{hint}")
    filters = {"step": step, "index": index, "kind": kind, "rank": rank}
    kept = [e for e in found if all(v is None or getattr(e, k) == v for k, v in filters.items())]
    if not kept:
        have = ", ".join(f"step {e.step} {e.kind} {e.index}" for e in found[:8])
        asked = ", ".join(f"{k} {v}" for k, v in filters.items() if v is not None)
        raise UserError(f"{reader.path}: {query!r} has no entry with {asked} "
                        f"(it has: {have}{' ...' if len(found) > 8 else ''})")
    return kept


def tensor_stats(x: torch.Tensor) -> dict[str, Any]:
    """max, min, mean, std, L2 norm (over the finite elements), NaN/Inf/zero counts of a tensor."""
    flat = x.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    v = flat.to(torch.float64)
    finite = v[torch.isfinite(v)]
    out: dict[str, Any] = {"numel": flat.numel(), "nan": int(torch.isnan(v).sum()),
                           "inf": int(torch.isinf(v).sum()), "zeros": int((v == 0).sum())}
    if finite.numel():
        out.update(max=float(finite.max()), min=float(finite.min()), mean=float(finite.mean()),
                   std=float(finite.std()) if finite.numel() > 1 else 0.0,
                   norm=float(torch.linalg.vector_norm(finite)))
    else:
        out.update({k: math.nan for k in ("max", "min", "mean", "std", "norm")})
    return out


def describe(reader: DumpReader, entry: Entry, *, load: bool = True) -> dict[str, Any]:
    """One entry: identity, dtype, shape, locator (and its file), recorded statistics, and with
    ``load`` the loaded tensor's statistics and the tensor (``"tensor"``) itself."""
    loc = locator(reader, entry)
    file = loc.rpartition(":")[0] if ":" in loc.rpartition("/")[2] else loc
    out: dict[str, Any] = {
        "name": entry.name, "step": entry.step, "rank": entry.rank, "kind": entry.kind, "index": entry.index,
        "level": entry.level, "module_type": entry.module_type, "dtype": entry.dtype,
        "shape": list(entry.shape) if entry.shape is not None else None, "locator": loc or None,
        "file": str(Path(reader.path) / file) if file else None,
        "recorded": dict(entry.stats) if entry.stats else None, "has_data": entry.has_data,
        "value": entry.value, "pytype": entry.pytype,
    }
    if load and entry.has_data:
        t = reader.load(entry)
        out["stats"] = tensor_stats(t)
        out["tensor"] = t
    return out
