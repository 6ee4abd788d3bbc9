"""Every tensor pair of a compare, and which matching made them (names, a mapping, order).

Steps are aligned first (``align``), then each aligned step's entries are matched (``match``).
The matching is decided once, before any tensor is read:

* a mapping given (``-mf``/``mapping:``) is used, its vars read from the target dump;
* else, when names pair at least half of the golden entries of the first aligned step, names
  (with the order fallback for the rest);
* else every registered mapping (``llmflow.mappings``) whose ``detect`` block fits the target
  dump is tried on that step, and the one pairing the most entries is used, "chosen
  automatically": an ATB dump against a torch one needs no ``-mf atb-llama``.

``Pairing.matching`` says which, for the output and the summary.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from llmflow.compare.align import align_dumps
from llmflow.compare.mappings import Mapping, load_mapping
from llmflow.compare.match import Pair, comparable, entry_levels, match_step
from llmflow.compare.shards import join_ranks, slice_world
from llmflow.errors import UserError
from llmflow.formats.base import DumpReader, Entry
from llmflow.results.compare import Matching, TensorParallel

log = logging.getLogger("llmflow.compare")
NAME_SHARE = 0.5  # names that pair at least this share of golden entries need no mapping


@dataclass
class Pairing:
    """The pairs to compute (step, rank, execution order), the steps without a partner, and how
    tensors were matched."""

    pairs: list[Pair]
    missing: list[dict[str, Any]]
    matching: Matching
    mapping: Mapping | None = None
    missing_rows: int = 0  # golden entries in steps the target lacks


def _index(reader: DumpReader) -> dict[tuple[int, int], list[Entry]]:
    idx: dict[tuple[int, int], list[Entry]] = defaultdict(list)
    for e in reader.entries():
        idx[(e.rank, e.step)].append(e)
    return idx


def plan_pairs(golden: DumpReader, target: DumpReader, *, step_pairs: list[dict[str, int]] | None = None,
               steps: list[int] | None = None, prefill_offset: int = 0, warmup: int = 0,
               rank: int | None = None, levels: list[str] | None = None, mapping: str | None = None,
               base_dir: str = ".") -> Pairing:
    """Align the steps (unless ``step_pairs`` are given), decide the matching, pair every step."""
    missing: list[dict[str, Any]] = []
    if step_pairs is None:
        aligned = align_dumps(golden, target, prefill_offset=prefill_offset, warmup=warmup, steps=steps)
        step_pairs, missing = aligned["pairs"], aligned["missing"]
    else:
        wanted = set(steps) if steps is not None else None
        step_pairs = [p for p in step_pairs if wanted is None or p["golden_step"] in wanted]
        paired = {int(p["golden_step"]) for p in step_pairs}
        missing = [{"side": "target", "golden_step": s, "target_step": None} for s in golden.steps()
                   if s not in paired and (wanted is None or s in wanted)]
    g_idx, t_idx = _index(golden), _index(target)
    g_ranks, t_ranks = sorted({r for r, _ in g_idx}), sorted({r for r, _ in t_idx})
    ranks = sorted(set(g_ranks) | set(t_ranks))
    g_world, t_world = world_of(golden, g_ranks), world_of(target, t_ranks)
    _check_worlds(g_world, t_world, rank)
    # a tensor-parallel target against a one-device golden: the golden's rank pairs with the
    # target's first, and the other ranks' shards (those of every rank of its world, a rank
    # whose folder is lost holding none) join those pairs (shards.py)
    sharded = rank is None and g_world == 1 and t_world > 1 and bool(t_ranks)
    if sharded:
        g_idx = {(t_ranks[0], s): es for (_, s), es in g_idx.items()}
        ranks = [t_ranks[0]]
    if rank is not None:
        lacking = [side for side, held in (("golden", g_ranks), ("target", t_ranks)) if rank not in held]
        if lacking:  # (a side without it would leave every row of the other unpaired)
            raise UserError(f"compare: -r {rank}: the " + " and the ".join(
                f"{side} dump holds rank{'s' if len(held) > 1 else ''} {', '.join(map(str, held)) or 'none'}"
                for side, held in (("golden", g_ranks), ("target", t_ranks)) if side in lacking))
        ranks = [rank]
    chosen, matching = _choose(golden, target, g_idx, t_idx, step_pairs, ranks, levels, mapping, base_dir)
    matched: list[tuple[int, list[Pair]]] = []
    for sp in step_pairs:
        gs, ts = int(sp["golden_step"]), int(sp["target_step"])
        for r in ranks:
            matched.append((ts, match_step(g_idx.get((r, gs), ()), t_idx.get((r, ts), ()), golden_step=gs,
                                           target_step=ts, rank=r, mapping=chosen, levels=levels)))
    if rank is None and g_world == 1 and len(t_ranks) == 1 and not recorded_world(target):
        # one rank of a target that records no world size (msprobe): its tensors may be one
        # rank's shards of a tensor-parallel run whose other ranks are not here
        found = slice_world(p for _, step in matched for p in step)
        if found is not None:
            sharded, t_world = True, found
            log.warning("compare: the target's tensors are 1/%d slices of the golden's along one dimension: "
                        "read as rank %d of a tensor-parallel run of %d ranks whose other ranks are missing",
                        found, t_ranks[0], found)
    pairs: list[Pair] = []
    joins: Counter[str] = Counter()
    for ts, step in matched:
        if sharded:
            others = {o: t_idx.get((o, ts), ()) for o in sorted(set(range(t_world)) | set(t_ranks))
                      if o != t_ranks[0]}
            step, counts = join_ranks(step, others, chosen.shards if chosen else (), levels)
            joins.update(counts)
        pairs.extend(step)
    matching.rows = dict(Counter(p.match for p in pairs if not p.unmatched))
    if sharded:
        matching.tensor_parallel = TensorParallel(ranks=t_world, joined=dict(joins))
    lacking = {int(m["golden_step"]) for m in missing if m.get("side") == "target"}
    wanted_levels = set(levels) if levels else None
    missing_rows = sum(1 for (r, s), es in g_idx.items() if s in lacking and r in ranks for e in es
                       if comparable(e) and _in_levels(e, wanted_levels))
    return Pairing(pairs, missing, matching, chosen, missing_rows)


def recorded_world(reader: DumpReader) -> int | None:
    """The world size a dump records (llmflow's ``rank.json``), None where its format records none."""
    get = getattr(reader, "world_size", None)
    world = get() if callable(get) else None
    return world if type(world) is int and world > 0 else None


def world_of(reader: DumpReader, ranks: list[int]) -> int:
    """How many ranks the run that made a dump had: the world size it records, else (several rank
    folders) the highest rank's number + 1, else 1."""
    return recorded_world(reader) or (max(ranks) + 1 if len(ranks) > 1 else 1)


def _check_worlds(g_world: int, t_world: int, rank: int | None) -> None:
    """Refuse (bad input) what cannot pair: two tensor-parallel dumps of different world sizes
    (their shards are slices of different widths), or ``-r`` on a tensor-parallel target against a
    one-device golden (one rank's shards are slices of the golden's tensors)."""
    if g_world > 1 and t_world > 1 and g_world != t_world:
        raise UserError(f"compare: the golden dump is a tensor-parallel run of world size {g_world} and the "
                        f"target of world size {t_world}: their ranks' shards are slices of different widths "
                        "and never pair; compare each against a one-device golden dump")
    if rank is not None and g_world == 1 and t_world > 1:
        raise UserError(f"compare: -r {rank}: the target is a tensor-parallel run of {t_world} ranks and the "
                        "golden of one device: a rank's shards are slices of the golden's tensors; run the "
                        "compare without -r: it joins the ranks' shards and names a rank whose shard "
                        "stands out")


def _in_levels(e: Entry, wanted: set[str] | None) -> bool:
    lv = entry_levels(e)
    return bool(lv) and (wanted is None or bool(set(lv) & wanted))


def _trial(g: list[Entry], t: list[Entry], mapping: Mapping | None, levels: list[str] | None) -> int:
    """Golden entries of one step that pair by name (and through ``mapping``), no order fallback."""
    pairs = match_step(g, t, golden_step=0, target_step=0, rank=0, mapping=mapping, levels=levels,
                       order_fallback=False)
    return sum(1 for p in pairs if not p.unmatched)


def _choose(golden: DumpReader, target: DumpReader, g_idx: dict, t_idx: dict,
            step_pairs: list[dict[str, int]], ranks: list[int], levels: list[str] | None, ref: str | None,
            base_dir: str) -> tuple[Mapping | None, Matching]:
    """The mapping to use (None: names) and the ``matching`` block describing the choice."""
    if ref:
        m = load_mapping(ref, base_dir).bind(target)
        return m, Matching(method="mapping", mapping=m.name, chosen="given", vars=m.variables,
                           why=_vars_text(m))
    trial = next(((g_idx.get((r, int(sp["golden_step"]))), t_idx.get((r, int(sp["target_step"]))))
                  for sp in step_pairs for r in ranks
                  if g_idx.get((r, int(sp["golden_step"]))) and t_idx.get((r, int(sp["target_step"])))), None)
    names = Matching(method="name", mapping=None, chosen=None)
    if trial is None:
        return None, names
    g, t = trial
    total = sum(1 for e in g if comparable(e) and _in_levels(e, set(levels) if levels else None))
    by_name = _trial(g, t, None, levels)
    if total == 0 or by_name >= NAME_SHARE * total:
        return None, names
    best: tuple[int, Mapping] | None = None
    for m in _candidates(target):
        n = _trial(g, t, m, levels)
        if n > by_name and (best is None or n > best[0]):
            best = (n, m)
    if best is None:
        return None, names
    m = best[1]
    types = ", ".join((m.detect or {}).get("target_types") or [])
    why = f"the target is an {(m.detect or {}).get('target_format') or 'fitting'} dump"
    why += f" with {types} ops" if types else ""
    why += f"; names paired {by_name} of {total} golden entries, the mapping {best[0]}"
    if m.variables:
        why += "; " + _vars_text(m)
    return m, Matching(method="mapping", mapping=m.name, chosen="automatically", vars=m.variables, why=why)


def _vars_text(m: Mapping) -> str:
    return ", ".join(f"{k} {v} (from its {m.var_sources.get(k, 'default')})" for k, v in m.variables.items())


def _candidates(target: DumpReader) -> list[Mapping]:
    """Registered mappings whose ``detect`` fits the target, vars bound; a broken one is skipped."""
    from llmflow.plugins import find_group

    out = []
    for name in sorted(find_group("llmflow.mappings")):
        try:
            m = load_mapping(name)
        except UserError as exc:
            log.warning("compare: mapping %s not considered: %s", name, exc)
            continue
        if m.detects(target):
            out.append(m.bind(target))
    return out


def matching_text(matching: Matching) -> str:
    """One line: ``mapping atb-llama (chosen automatically: ...); 96 rows by mapping, 2 by order``."""
    if matching.method == "mapping":
        how = "given (-mf)" if matching.chosen == "given" else "chosen automatically"
        head = f"mapping {matching.mapping} ({how}"
        head += f": {matching.why})" if matching.why else ")"
    else:
        head = "by name"
    counts = ", ".join(f"{n} by {how}" for how, n in sorted(matching.rows.items(), key=lambda kv: -kv[1]))
    text = f"{head}; rows paired {counts}" if counts else head
    tp = matching.tensor_parallel
    if tp:
        joined = ", ".join(f"{n} {how}" for how, n in sorted(tp.joined.items(), key=lambda kv: -kv[1]))
        text += f"; the target's {tp.ranks} tensor-parallel ranks joined: {joined or 'none'}"
    return text
