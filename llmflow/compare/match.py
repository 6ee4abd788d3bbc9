"""Which golden tensor goes with which target tensor, within one aligned step and rank.

Tried in this order, each on what the previous ones left:

1. an op-mapping file (``mappings.py``): target names or module types rewritten to golden ones,
   with many-to-one rules (a sum of target tensors vs one golden tensor); rows ``match: mapping``;
2. the same name, kind and index on both sides (the same implementation); ``match: name``;
3. topology order: API calls one side records without their module (msprobe's L1) against the
   same API's calls in the other's modules, the k-th call of an API in the step with the k-th;
   then remaining module OUTPUTS walked in execution order on both sides and paired
   when shapes agree, module types are compatible and both lie in the same decoder layer (the
   layer's index, ``model.layers.7``, or its position among the layers, ``9_DecoderLayer`` being
   the eighth: never a module of one layer against a module of another); ``match: order``;
4. everything left is reported as ``unmatched golden`` / ``unmatched target`` rows.

Levels (``cmp_level``): ``logits`` (entries named "logits"), ``layer`` (decoder-layer outputs:
module paths ending in ``layers.N``, ``h.N``, ``blocks.N`` ..., output 0), ``module``, ``api``
and ``save``. A pair belongs to the golden entry's levels (a layer output is also a module row).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from llmflow.compare.levels import LEVELS  # noqa: F401  (re-exported)
from llmflow.compare.mappings import Mapping
from llmflow.dtypes import dtype_name
from llmflow.formats.base import Entry, api_of
from llmflow.structure import layer_index, layer_of_name

# an engine's op named like a decoder layer (ATB's 9_DecoderLayer): its layer is its position
# among such ops; numbered layers (model.layers.7) are structure.layer_index's
_NAMED_LAYER = re.compile(r"(?:^|[./])(\d+_[A-Za-z]*(?:Layer|Block)[A-Za-z]*)(?=$|[./])")
ORDER_LOOKAHEAD = 16  # how far the order fallback looks ahead for a shape match before giving up


@dataclass
class Pair:
    """One row to compute: a golden entry and the target entries (summed when several)."""

    levels: tuple[str, ...]
    golden: Entry | None
    targets: tuple[Entry, ...]
    match: str  # "name" | "mapping" | "order" | "unmatched golden" | "unmatched target"
    golden_step: int
    target_step: int
    rank: int
    rule: str = field(default="")
    # how several target entries join: "" the sum of a many-to-one mapping; for the ranks of a
    # tensor-parallel target "concat:D", "sum" or "replicated" (``shards.py``)
    merge: str = field(default="")

    @property
    def unmatched(self) -> bool:
        return self.golden is None or not self.targets

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data this pair reads (both sides)."""
        total = 0
        for e in ((self.golden,) if self.golden else ()) + self.targets:
            if e.has_data and e.shape is not None:
                total += math.prod(e.shape) * _itemsize(e.dtype)
        return total


@lru_cache(maxsize=256)  # a dump has a handful of dtype names; this runs twice per pair
def _itemsize(dtype: str | None) -> int:
    name = dtype_name(dtype or "")
    for key, size in (("float64", 8), ("int64", 8), ("complex64", 8), ("float32", 4), ("int32", 4),
                      ("float16", 2), ("bfloat16", 2), ("int16", 2), ("float8", 1), ("int8", 1),
                      ("uint8", 1), ("bool", 1)):
        if key in name:
            return size
    return 4


def entry_levels(e: Entry) -> tuple[str, ...]:
    """The compare levels an entry belongs to (weights belong to none: see weight-compare)."""
    if e.level == "logits" or (e.name == "logits" and e.level != "api"):
        return ("logits",)
    if e.level == "module":
        if e.kind == "output" and e.index == "0" and layer_of_name(e.name) == e.name:
            return ("layer", "module")
        return ("module",)
    if e.level in ("api", "save"):
        return (e.level,)
    return ()


def comparable(e: Entry) -> bool:
    """A tensor entry with data or statistics (non-tensor values like ``use_cache`` are skipped)."""
    return e.dtype is not None and e.step >= 0 and (e.has_data or bool(e.stats))


def layer_positions(entries: list[Entry]) -> dict[int, int | None]:
    """``id(entry)`` -> the decoder layer it lies in (None: outside the layers).

    With numbered layers (``model.layers.7``) the number; with layers named by op (ATB's
    ``9_DecoderLayer``) their position among the layers in execution order, 0 first: what
    ``model.layers.N`` counts.
    """
    keys: dict[int, tuple[str, int | None] | None] = {}
    for e in entries:
        index = layer_index(e.name)
        if index is not None:
            keys[id(e)] = ("indexed", index)
            continue
        m = _NAMED_LAYER.search(e.name)
        keys[id(e)] = ("named", m.group(1)) if m else None  # type: ignore[assignment]
    order: dict[str, int] = {}
    out: dict[int, int | None] = {}
    for e in entries:
        key = keys[id(e)]
        if key is None:
            out[id(e)] = None
        elif key[0] == "indexed":
            out[id(e)] = key[1]  # type: ignore[assignment]
        else:
            out[id(e)] = order.setdefault(key[1], len(order))  # type: ignore[arg-type]
    return out


def _types_agree(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return True
    a, b = a.lower().replace("_", ""), b.lower().replace("_", "")
    return a.endswith(b) or b.endswith(a)


def match_step(golden: Iterable[Entry], target: Iterable[Entry], *, golden_step: int, target_step: int,
               rank: int, mapping: Mapping | None = None, levels: Iterable[str] | None = None,
               order_fallback: bool = True) -> list[Pair]:
    """Pair the comparable entries of one golden step with those of its target step.

    Returns pairs in golden execution order, then unmatched target entries in target order.
    """
    wanted = set(levels) if levels else set(LEVELS)
    g_list = [e for e in golden if comparable(e) and entry_levels(e)]
    t_list = [e for e in target if comparable(e) and entry_levels(e)]
    g_by_key: dict[tuple[str, str, str], list[Entry]] = defaultdict(list)
    for e in g_list:
        g_by_key[(e.name, e.kind, e.index)].append(e)
    used_g: set[int] = set()
    used_t: set[int] = set()
    matched: list[Pair] = []

    def take(key: tuple[str, str, str]) -> Entry | None:
        for e in g_by_key.get(key, ()):
            if id(e) not in used_g:
                used_g.add(id(e))
                return e
        return None

    def add(g: Entry, ts: tuple[Entry, ...], how: str, rule: str = "") -> None:
        used_t.update(id(t) for t in ts)
        matched.append(Pair(entry_levels(g), g, ts, how, golden_step, target_step, rank, rule))

    if mapping is not None:
        _apply_mapping(mapping, t_list, take, add)
    for t in t_list:
        if id(t) not in used_t:
            g = take((t.name, t.kind, t.index))
            if g is not None:
                add(g, (t,), "name")
    if order_fallback:
        _pair_calls_without_modules(g_list, t_list, used_g, used_t, add)
        g_rest = [e for e in g_list if id(e) not in used_g and e.kind == "output" and e.level == "module"]
        t_rest = [e for e in t_list if id(e) not in used_t and e.kind == "output" and e.level == "module"]
        g_layer, t_layer = ((layer_positions(g_list), layer_positions(t_list)) if g_rest and t_rest
                            else ({}, {}))
        j = 0
        for g in g_rest:
            for k in range(j, min(j + ORDER_LOOKAHEAD, len(t_rest))):
                t = t_rest[k]
                if (t.shape == g.shape and g_layer[id(g)] == t_layer[id(t)]
                        and _types_agree(g.module_type, t.module_type)):
                    used_g.add(id(g))
                    add(g, (t,), "order")
                    j = k + 1
                    break
    order = {id(e): i for i, e in enumerate(g_list)}
    matched.sort(key=lambda p: order[id(p.golden)])
    out = [p for p in matched if set(p.levels) & wanted]
    for p in out:
        p.levels = tuple(lv for lv in p.levels if lv in wanted)
    for g in g_list:
        if id(g) not in used_g and set(entry_levels(g)) & wanted:
            lv = tuple(x for x in entry_levels(g) if x in wanted)
            out.append(Pair(lv, g, (), "unmatched golden", golden_step, target_step, rank))
    # keep unmatched pairs in execution order with the matched ones
    out.sort(key=lambda p: order[id(p.golden)])
    for t in t_list:
        if id(t) not in used_t and set(entry_levels(t)) & wanted:
            lv = tuple(x for x in entry_levels(t) if x in wanted)
            out.append(Pair(lv, None, (t,), "unmatched target", golden_step, target_step, rank))
    return out


def _pair_calls_without_modules(g_list: list[Entry], t_list: list[Entry], used_g: set[int], used_t: set[int],
                                add) -> None:
    """API calls a side records without their module (``/linear.3``: msprobe's L1 level has no
    construct.json parents) against the other side's calls of the same API, named inside their
    modules (``model.layers.0.mlp.up_proj/linear.0``: level mix, llmflow's API mode): the k-th
    call of an API in the step on one side is the k-th on the other, input and output by index,
    where shapes agree (``match: order``). Only where every call left on one side lacks its
    module: calls both sides name inside modules pair by name or through a mapping file."""
    def calls(entries: list[Entry], used: set[int]) -> list[Entry]:
        return [e for e in entries if id(e) not in used and e.level == "api"]

    g_rest, t_rest = calls(g_list, used_g), calls(t_list, used_t)
    unplaced = any(all(e.name.startswith("/") for e in side) for side in (g_rest, t_rest))
    if not g_rest or not t_rest or not unplaced:
        return

    def keyed(entries: list[Entry]) -> dict[tuple[str, int, str, str], Entry]:
        seen: dict[str, int] = {}  # api -> calls so far
        number: dict[str, int] = {}  # call name -> its number among the api's calls
        out: dict[tuple[str, int, str, str], Entry] = {}
        for e in entries:
            api = api_of(e.name)
            if e.name not in number:
                number[e.name] = seen.get(api, 0)
                seen[api] = number[e.name] + 1
            out.setdefault((api, number[e.name], e.kind, e.index), e)
        return out

    t_keyed = keyed(t_rest)
    for key, g in keyed(g_rest).items():
        t = t_keyed.get(key)
        if t is not None and t.shape == g.shape and id(t) not in used_t:
            used_g.add(id(g))
            add(g, (t,), "order")


def _apply_mapping(mapping: Mapping, t_list: list[Entry], take, add) -> None:
    """Pair target entries through the mapping's rules (first matching rule wins)."""
    occurrences: dict[tuple[int, tuple], int] = defaultdict(int)
    groups: dict[tuple[int, tuple, str, str], dict[int, Entry]] = {}
    for t in t_list:
        for ri, rule in enumerate(mapping.rules):
            if not rule.applies(t.kind, t.index, t.module_type):
                continue
            hit = None
            for pi in range(len(rule.patterns)):
                caps = rule.match_name(t.name, pi)
                if caps is not None:
                    hit = (pi, caps)
                    break
            if hit is None:
                continue
            pi, caps = hit
            cap_key = tuple(sorted(caps.items()))
            if len(rule.patterns) > 1:  # many-to-one: collect the parts, pair when all are there
                parts = groups.setdefault((ri, cap_key, t.kind, t.index), {})
                parts.setdefault(pi, t)
                if len(parts) == len(rule.patterns):
                    _pair_rule(rule, caps, 0, tuple(parts[i] for i in range(len(rule.patterns))), take, add,
                               mapping.variables)
                break
            # the i-th occurrence among targets that map to the same golden names (captures the
            # golden side does not use, like ATB's child index, do not separate occurrences)
            occ_key = (ri, tuple(sorted((k, v) for k, v in caps.items() if k in rule.golden_vars)),
                       t.kind, t.index)
            occ = occurrences[occ_key]
            occurrences[occ_key] += 1
            _pair_rule(rule, caps, occ, (t,), take, add, mapping.variables)
            break


def _pair_rule(rule, caps: dict[str, str], occurrence: int, ts: tuple[Entry, ...], take, add,
               variables: dict[str, int]) -> None:
    name = rule.golden_name(caps, occurrence, variables)
    if name is None:
        return
    t = ts[0]
    g = take((name, rule.golden_kind or t.kind, rule.golden_index or t.index))
    if g is not None:
        add(g, ts, "mapping", rule.where.rpartition(": ")[2])
