"""Side inputs a module is handed changed: read from the two dumps alone, no model run.

A decoder layer passes some of its keyword inputs on to its modules unchanged: the rotary
embeddings, the attention mask, the position ids, the cache position. In the golden's dump the
attention's ``position_embeddings`` is the very tensor its layer was given. Where the target's
module was handed something else than its enclosing module was given, the target changed it on the
way: the enclosing module's own code, or a hook or wrapper around the module (an off-by-one
position at decode, a mask cut at the wrong window, a cache position of another step).

The replay from a target dump cannot see this: the golden module is run on the target's recorded
inputs, the changed one among them, and agrees with the target's output. A layer replayed whole
sees it only as far as the change moves the layer's output, which a weak one (a position one off)
does too little for the ranking. The check here is direct instead: per keyword input, the target's
module against its enclosing module (``HANDED_DOWN_FLOORS`` times the dtype's ``OP_ERROR_FLOOR``
apart at least), where the golden's pair is equal. Only keyword inputs are checked: positional
ones are the data the enclosing module computes on (a norm's output, not its input), and the golden
pair being equal is what says the input is passed through.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace

import torch

from llmflow.compare.mappings import Mapping
from llmflow.dtypes import OP_ERROR_FLOOR, dtype_class
from llmflow.errors import DumpFormatError
from llmflow.formats.base import DumpReader, Entry
from llmflow.localize.calls import first_call
from llmflow.localize.target_dump import golden_names
from llmflow.results.verdict import HandedDown

#: a keyword input handed down changed by this many times the target dtype's OP_ERROR_FLOOR (a
#: relative L2 difference): a cast on the way (fp32 rotary tables handed on in bf16) stays ~1x
HANDED_DOWN_FLOORS = 10.0
#: statistics this close (relative) are taken as one tensor's before its data is read
_SAME_STATS = 1e-6
#: a tensor this large whose statistics match its enclosing module's is taken as unchanged unread (a
#: long prompt's prefill mask); a smaller one is read, as a mask cut at a shifted window keeps them
READ_UNCHANGED_STATS = 1 << 20
#: an additive mask's "masked" value: a dtype's lowest (fp16's -65504, fp32's -3.4e38) or -inf, which
#: a cast between them turns one into the other; at or below half fp16's lowest they are one value
_MASKED = -0.5 * 65504.0


def _enclosing(name: str, recorded: Iterable[str]) -> str | None:
    """The nearest module above ``name`` among ``recorded`` (by its dotted path), None where none is."""
    known = set(recorded)
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:cut])
        if parent in known:
            return parent
    return None


def _keyword_inputs(entries: list[Entry]) -> dict[str, Entry]:
    """The tensor keyword inputs of a module's first call at one step, by index."""
    return {e.index: e for e in first_call(entries)[0] if e.index.startswith("kw:") and e.is_tensor}


def _numel(e: Entry) -> int | None:
    return math.prod(e.shape) if e.shape is not None else None


def _stats_differ(a: Entry, b: Entry) -> bool:
    """Whether the recorded statistics already tell two tensors apart (False where either has none)."""
    if not a.stats or not b.stats:
        return False
    for key in ("max", "min", "mean", "norm"):
        x, y = a.stats.get(key), b.stats.get(key)
        known = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (x, y))
        if known and abs(x - y) > _SAME_STATS * max(abs(x), abs(y), 1e-30):
            return True
    return False


def difference(handed: torch.Tensor, given: torch.Tensor) -> float | None:
    """How far ``handed`` is from ``given``: the relative L2 distance of floating (and complex)
    tensors (inf where they differ in a non-finite value, or ``given`` is all zero and they
    differ), the share of elements that differ of integer and boolean ones; 0.0 where they are
    equal. An additive mask's "masked" values (``_MASKED``) are one value; a NaN in both places is
    no change. None for tensors of other sizes (a port that slices the input on the way: not
    comparable here)."""
    # complex angles (Llama 4's rotary) as their real and imaginary parts
    a, b = (torch.view_as_real(x.resolve_conj()).reshape(-1) if x.is_complex() else x.reshape(-1)
            for x in (handed, given))
    if a.numel() != b.numel():
        return None
    if not (a.is_floating_point() or b.is_floating_point()):
        return float((a != b).double().mean()) if a.numel() else 0.0
    a, b = (torch.where(x <= _MASKED, -math.inf, x.double()) for x in (a, b))
    changed = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
    if not bool(changed.any()):
        return 0.0
    if not bool((torch.isfinite(a) & torch.isfinite(b))[changed].all()):
        return math.inf
    norm = float(torch.linalg.vector_norm(torch.where(torch.isfinite(b), b, 0.0)))
    diff = float(torch.linalg.vector_norm(torch.where(changed, a - b, 0.0)))
    return diff / norm if norm > 0 else math.inf


def handed_down_limit(handed: torch.Tensor, given: torch.Tensor, dtype: str | None) -> float:
    """The difference a cast on the way stays within: ``HANDED_DOWN_FLOORS`` times the coarsest
    OP_ERROR_FLOOR of the two tensors' dtypes and the one the target ran in (``dtype``); 0.0 for
    integers and booleans, where any element changed is a change."""
    if not any(t.is_floating_point() or t.is_complex() for t in (handed, given)):
        return 0.0
    classes = {dtype_class(str(t.dtype)) for t in (handed, given)} | {dtype_class(dtype)}
    return HANDED_DOWN_FLOORS * max((OP_ERROR_FLOOR[c] for c in classes if c in OP_ERROR_FLOOR),
                                    default=OP_ERROR_FLOOR["float32"])


class _Pairs:
    """One dump's keyword inputs read in pairs (a module's and its enclosing module's), what a read
    could not load skipped (the dump's problems list it), the golden pairs' equality kept per step."""

    def __init__(self, reader: DumpReader):
        self.reader = reader
        self.equal: dict[tuple[str, str], bool] = {}

    def load(self, a: Entry, b: Entry) -> tuple[torch.Tensor, torch.Tensor] | None:
        try:
            return self.reader.load(a), self.reader.load(b)
        except (DumpFormatError, OSError, RuntimeError, ValueError):
            return None

    def unchanged(self, a: Entry, b: Entry) -> bool | None:
        """True: one tensor (one stored copy, or the same values); False: told apart; None: not
        comparable (no data, other sizes, unreadable)."""
        if a.key and a.key == b.key:
            return True
        if not (a.has_data and b.has_data) or _numel(a) != _numel(b):
            return None
        if _stats_differ(a, b):
            return False
        if a.stats and b.stats and (_numel(a) or 0) > READ_UNCHANGED_STATS:
            return True
        found = self.difference(a, b)
        return None if found is None else found <= OP_ERROR_FLOOR["float32"]

    def difference(self, a: Entry, b: Entry) -> float | None:
        loaded = self.load(a, b)
        return difference(*loaded) if loaded is not None else None

    def golden_equal(self, a: Entry, b: Entry) -> bool:
        key = (a.key or f"{a.name}/{a.rank}/{a.index}", b.key or f"{b.name}/{b.rank}/{b.index}")
        if key not in self.equal:
            self.equal[key] = self.unchanged(a, b) is True
        return self.equal[key]


def _by_step(reader: DumpReader, steps: Collection[int]) -> dict[int, dict[str, dict[int, list[Entry]]]]:
    """Step -> module name -> rank -> its entries, for ``steps`` (one read of the index)."""
    found: dict[int, dict[str, dict[int, list[Entry]]]] = {s: {} for s in steps}
    for e in reader.entries():
        if e.level == "module" and e.step in found:
            found[e.step].setdefault(e.name, {}).setdefault(e.rank, []).append(e)
    return found


def first_handed_down(golden_dump: DumpReader, target_dump: DumpReader, steps: Sequence[tuple[int, int]],
                      mapping: Mapping | None = None, dtype: str | None = None) -> HandedDown | None:
    """The first module handed a changed keyword input, over ``steps`` ((golden step, target step)
    pairs, in order): in the target's execution order within a step, over its ranks; None where
    none is. ``mapping``: the compare's, naming target modules the golden does not have;
    ``dtype``: the one the target ran in (``handed_down_limit``)."""
    golden = _by_step(golden_dump, {g for g, _t in steps})
    target = _by_step(target_dump, {t for _g, t in steps})
    pairs = (_Pairs(golden_dump), _Pairs(target_dump))
    for g_step, t_step in steps:
        if not golden[g_step] or not target[t_step]:
            continue
        names = golden_names(target_dump, t_step, golden[g_step], mapping, recorded=target[t_step])
        found = _handed_down_at(pairs, golden[g_step], target[t_step], names, dtype)
        if found is not None:
            return replace(found, step=g_step, target_step=t_step)
    return None


def _handed_down_at(pairs: tuple[_Pairs, _Pairs], golden: dict[str, dict[int, list[Entry]]],
                    target: dict[str, dict[int, list[Entry]]], golden_name: dict[str, str],
                    dtype: str | None) -> HandedDown | None:
    """The first module at one step whose keyword input differs from its enclosing module's of the
    same name in the target dump (``target``: its module entries there), where the golden dump's
    pair (``golden``) is equal. ``golden_name``: target module name -> the golden's."""
    golden_pairs, target_pairs = pairs
    for name, by_rank in target.items():
        parent = _enclosing(name, target)
        g_name, g_parent = golden_name.get(name), golden_name.get(parent or "")
        # (a mapping that names a module and its enclosing one alike has no pair to read)
        if parent is None or g_name not in golden or g_parent not in golden or g_name == g_parent:
            continue
        for rank, entries in sorted(by_rank.items()):
            handed, given = _keyword_inputs(entries), _keyword_inputs(target[parent].get(rank, []))
            g_rank = rank if rank in golden[g_name] and rank in golden[g_parent] else min(golden[g_name])
            g_handed = _keyword_inputs(golden[g_name].get(g_rank, []))
            g_given = _keyword_inputs(golden[g_parent].get(g_rank, []))
            for index, entry in handed.items():
                source, g_entry, g_source = given.get(index), g_handed.get(index), g_given.get(index)
                if source is None or g_entry is None or g_source is None:
                    continue
                if target_pairs.unchanged(entry, source) is not False:  # (the cheap test first)
                    continue
                if not golden_pairs.golden_equal(g_entry, g_source):  # the golden changes it: no pass-through
                    continue
                loaded = target_pairs.load(entry, source)
                found = difference(*loaded) if loaded is not None else None
                if found is None:
                    continue
                limit = handed_down_limit(loaded[0], loaded[1], dtype)
                if found > limit:
                    shape = list(entry.shape) if entry.shape is not None else None
                    return HandedDown(module=g_name, enclosing=g_parent, input=index, step=-1, target_step=-1,
                                      rank=rank, difference=found if math.isfinite(found) else None,
                                      limit=limit, shape=shape)
    return None
