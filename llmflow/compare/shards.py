"""A tensor-parallel target against a single-device golden: each rank's shard joined into the
tensor the golden holds.

A target run on N ranks (``torch.distributed``: Megatron, vLLM, MindIE) is dumped per rank
(``rank0/`` .. ``rank{N-1}/``, as llmflow, msit and msprobe write it); the golden has one rank. The
rank-0 entries are paired with the golden by name (or a mapping) as usual; every other rank's
entry of the same name, kind and index joins that pair, and the pair is compared on the joined
tensor. How the shards join comes from the shapes:

* a shard whose shape equals the golden's except one dimension, where N shards add up to the
  golden's size, is a slice of a **column-parallel** output: the shards are concatenated along
  that dimension (``concat:D``), and the row names the rank whose slice's own error stands out;
* shards with the golden's own shape are **replicated** (after an all-reduce, or computed the same
  on every rank): compared once when the ranks agree bit for bit; when they do not, each copy is
  compared and the row keeps the worst, naming its rank;
* a row-parallel module's partial products (before its all-reduce) also have the golden's shape,
  but only their **sum** is the golden's tensor: shapes cannot tell them from replicated copies,
  so a mapping file says so (``shards: [{target: "model.layers.*.mlp.down_proj/linear.*",
  merge: sum}]``), as it may override any rule.

A pair whose entry some rank lacks while the ranks that hold it hold slices (a rank folder lost,
a data file cut short) cannot be joined: it is a ``LostShards`` pair, a row of lost data (a
``load_error``), never a shape mismatch of a slice against the whole tensor. Where the ranks that
hold it hold the golden's whole shape (the logits only rank 0 gathers) the copies held are compared.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from llmflow.compare.mappings import CONCAT, REPLICATED, SUM, ShardRule
from llmflow.compare.match import Pair, comparable, entry_levels
from llmflow.formats.base import Entry

# a shard "stands out" when its own error is this many times the median of the other shards':
# the rank with a wrong kernel or a corrupt shard, not a rank that is merely a little worse
STANDS_OUT = 4.0

# a row of several target tensors (a sharded target's ranks in rank order, or a many-to-one
# mapping's terms) lists their names (``target_name``) and locators (``target_data_path``) joined
# by this; a sharded pair's ``shards`` column starts with how the ranks joined (``shards_label``),
# which a reader of the rows (the report's op panel) parses back with ``label_join`` to join the
# same tensors
PARTS_JOIN = "+"
_LABEL = re.compile(r"(\d+) ranks, (concat:\d+|sum|replicated)(?:;|$)")
_WORST_COPY = re.compile(r"; the ranks' copies differ, the worst is rank (\d+)'s")


def shards_label(ranks: int, merge: str) -> str:
    """The head of a joined pair's ``shards`` column: how many ranks, joined how."""
    return f"{ranks} ranks, {merge}"


def worst_copy_note(rank: int) -> str:
    """What a replicated pair's ``shards`` column adds when the ranks' copies differ (the row
    compares the worst copy)."""
    return f"; the ranks' copies differ, the worst is rank {rank}'s"


def label_join(label: object) -> tuple[int, str, int | None] | None:
    """From a row's ``shards`` column: the number of ranks, the merge, and for replicated copies
    that differ the rank whose copy the row compared; None when the row joined no ranks."""
    m = _LABEL.match(label) if isinstance(label, str) else None
    if m is None:
        return None
    worst = _WORST_COPY.search(label)
    return int(m.group(1)), m.group(2), int(worst.group(1)) if worst else None


def merge_of(golden_shape: Sequence[int] | None, shard_shapes: Sequence[Sequence[int] | None],
             name: str = "", rules: Iterable[ShardRule] = ()) -> str | None:
    """How shards of these shapes join into the golden's tensor (``concat:D``, ``sum``,
    ``replicated``), or None when they cannot (the row is then a shape mismatch). A rule of the
    mapping file applies where the shapes allow it (a row-parallel linear's ``sum`` fits its
    output, not its sharded input)."""
    if golden_shape is None or any(s is None for s in shard_shapes):
        return None
    g = tuple(golden_shape)
    shapes = [tuple(s) for s in shard_shapes]  # type: ignore[arg-type]
    if all(s == g for s in shapes):
        by_shape = REPLICATED
    elif any(s != shapes[0] for s in shapes) or len(shapes[0]) != len(g):
        by_shape = None
    else:
        differ = [d for d in range(len(g)) if shapes[0][d] != g[d]]
        ok = len(differ) == 1 and shapes[0][differ[0]] * len(shapes) == g[differ[0]]
        by_shape = f"{CONCAT}:{differ[0] % len(g)}" if ok else None
    for rule in rules:
        if rule.pattern.fullmatch(name):
            if rule.merge in (SUM, REPLICATED) and by_shape == REPLICATED:
                return rule.merge
            if rule.merge.startswith(CONCAT) and by_shape is not None and by_shape != REPLICATED and \
                    int(rule.merge.partition(":")[2]) % len(g) == int(by_shape.partition(":")[2]):
                return by_shape
    return by_shape


def rule_merge(name: str, rules: Iterable[ShardRule]) -> str | None:
    """The merge of the first ``shards`` rule matching this target name, None where none does."""
    return next((rule.merge for rule in rules if rule.pattern.fullmatch(name)), None)


def joined_shape(merge: str, shapes: Sequence[Sequence[int]]) -> list[int]:
    out = list(shapes[0])
    if merge.startswith(CONCAT):
        d = int(merge.partition(":")[2])
        out[d] = sum(s[d] for s in shapes)
    return out


@dataclass
class LostShards(Pair):
    """A pair whose target entry is a slice some ranks lack: the joined tensor cannot be built, so
    its row is lost data (``targets``: the shards the other ranks hold)."""

    lost_ranks: tuple[int, ...] = field(default=())


def lost_reason(p: LostShards) -> str:
    """The row's reason: which ranks lack the shard, and which hold it."""
    lost = ", ".join(map(str, p.lost_ranks))
    held = ", ".join(str(t.rank) for t in p.targets)
    return (f"not compared: rank{'s' if len(p.lost_ranks) > 1 else ''} {lost} of the tensor-parallel target "
            f"hold{'' if len(p.lost_ranks) > 1 else 's'} no shard of it (rank {held} hold"
            f"{'' if len(p.targets) > 1 else 's'} a slice): a rank folder or data file lost, the "
            "joined tensor cannot be built")


def slice_world(pairs: Iterable[Pair]) -> int | None:
    """The world size N when a one-rank target's tensors look like one rank's shards of a
    tensor-parallel run: every pair whose shapes differ has the target's shape a 1/N slice of the
    golden's along one dimension (the same N for all), and tensors of a golden shape that is sliced
    are whole in other pairs (what stays replicated over the ranks); None otherwise."""
    worlds: set[int] = set()
    sliced: set[tuple[int, ...]] = set()
    whole: set[tuple[int, ...]] = set()
    for p in pairs:
        if p.unmatched or len(p.targets) != 1 or p.golden is None:
            continue
        g, t = p.golden.shape, p.targets[0].shape
        if g is None or t is None:
            continue
        g, t = tuple(g), tuple(t)
        if g == t:
            whole.add(g)
            continue
        differ = [d for d in range(len(g)) if len(g) == len(t) and g[d] != t[d]]
        if len(differ) != 1 or t[differ[0]] <= 0 or g[differ[0]] % t[differ[0]]:
            return None
        worlds.add(g[differ[0]] // t[differ[0]])
        sliced.add(g)
    return worlds.pop() if len(worlds) == 1 and sliced & whole else None


_PAIR_FIELDS = tuple(f for f in Pair.__dataclass_fields__ if f != "targets")


def join_ranks(pairs: list[Pair], others: dict[int, Sequence[Entry]], rules: Iterable[ShardRule] = (),
               levels: Iterable[str] | None = None) -> tuple[list[Pair], dict[str, int]]:
    """``pairs`` (golden against the target's first rank) with every other rank's entry of the same
    name, kind and index joined in; the other ranks' entries no pair took are unmatched-target
    pairs. Also the count of pairs per merge rule."""
    rules = list(rules)
    queues: dict[int, dict[tuple[str, str, str], deque[Entry]]] = {}
    for r, entries in others.items():
        q: dict[tuple[str, str, str], deque[Entry]] = defaultdict(deque)
        for e in entries:
            q[(e.name, e.kind, e.index)].append(e)
        queues[r] = q
    out: list[Pair] = []
    counts: dict[str, int] = defaultdict(int)
    for p in pairs:
        if p.golden is None or len(p.targets) != 1:
            out.append(p)
            continue
        t = p.targets[0]
        key = (t.name, t.kind, t.index)
        shards = [t]
        for r in sorted(queues):
            q = queues[r].get(key)
            if q:
                shards.append(q.popleft())
        if len(shards) < len(queues) + 1:
            if p.golden.shape is not None and all(
                    s.shape is not None and tuple(s.shape) == tuple(p.golden.shape) for s in shards):
                counts["whole on fewer ranks"] += 1  # (rank 0's logits: compared as held)
                out.append(p if len(shards) == 1 else replace(p, targets=tuple(shards), merge=REPLICATED))
                continue
            held = {s.rank for s in shards}
            counts["missing on a rank"] += 1
            out.append(LostShards(**{f: getattr(p, f) for f in _PAIR_FIELDS}, targets=tuple(shards),
                                  lost_ranks=tuple(r for r in sorted({t.rank, *queues}) if r not in held)))
            continue
        merge = merge_of(p.golden.shape, [s.shape for s in shards], t.name, rules)
        if merge is None:
            counts["shapes do not join"] += 1
            out.append(p)
            continue
        counts[merge.partition(":")[0]] += 1
        out.append(replace(p, targets=tuple(shards), merge=merge))
    wanted = set(levels) if levels else None
    golden_step = pairs[0].golden_step if pairs else None
    for r in sorted(queues):
        leftover = sorted((e for q in queues[r].values() for e in q), key=lambda e: e.order)
        for e in leftover:
            lv = tuple(x for x in entry_levels(e) if wanted is None or x in wanted)
            if comparable(e) and lv:
                out.append(Pair(lv, None, (e,), "unmatched target",
                                e.step if golden_step is None else golden_step, e.step, r))
    return out, dict(counts)


def joined_stats(merge: str, stats: list[dict[str, float] | None], shards: Sequence[Entry]
                 ) -> dict[str, float] | None:
    """Statistics of the joined tensor from each shard's (statistics-only dumps): exact for
    concatenated slices; a replicated tensor's are rank 0's; a sum's cannot be derived."""
    if any(s is None for s in stats) or merge == SUM:
        return None
    if merge == REPLICATED:
        return stats[0]
    sizes = [math.prod(e.shape or ()) for e in shards]
    total = sum(sizes) or 1
    parts: list[dict[str, float]] = stats  # type: ignore[assignment]
    return {"max": max(s["max"] for s in parts), "min": min(s["min"] for s in parts),
            "mean": sum(s["mean"] * n for s, n in zip(parts, sizes, strict=True)) / total,
            "norm": math.sqrt(sum(s["norm"] ** 2 for s in parts)),
            "nan": sum(s.get("nan") or 0 for s in parts), "inf": sum(s.get("inf") or 0 for s in parts)}


def join_tensors(merge: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The target tensor the golden holds, from its shards."""
    if merge.startswith(CONCAT):
        return torch.cat(shards, dim=int(merge.partition(":")[2]))
    if merge == SUM:
        total = shards[0].float()
        for s in shards[1:]:
            total = total + s.float()
        return total
    return shards[0]


def shard_errors(golden: torch.Tensor, merge: str, shards: list[torch.Tensor]) -> list[float]:
    """Each shard's own relative distance to its slice of the golden (concat), or each replicated
    copy's to the whole golden; empty for partial sums (no shard has an error of its own)."""
    if merge == SUM:
        return []
    g = golden.double()
    if merge.startswith(CONCAT):
        parts = torch.split(g, [s.shape[int(merge.partition(":")[2])] for s in shards],
                            dim=int(merge.partition(":")[2]))
    else:
        parts = [g] * len(shards)
    out = []
    for gp, s in zip(parts, shards, strict=True):
        gp = gp.reshape(-1)
        diff = float(torch.linalg.vector_norm(gp - s.double().reshape(-1)))
        ref = float(torch.linalg.vector_norm(gp))
        out.append(diff / ref if ref > 0 else (0.0 if diff == 0 else math.inf))
    return out


def share_errors(shares: tuple[list[torch.Tensor], torch.Tensor], partials: list[torch.Tensor]
                 ) -> tuple[list[float], list[float]]:
    """Each rank's partial product's distance to its share of the golden output, relative to the
    share and absolute (``shares``: the shares and the module's response to zero input, its bias,
    which one rank or none adds before the sum: each rank is measured against its share with or
    without it, whichever is nearer)."""
    parts, bias = shares
    relative, absolute = [], []
    for share, partial in zip(parts, partials, strict=True):
        p = partial.double().reshape(share.shape)
        diff = min(float(torch.linalg.vector_norm(p - share)),
                   float(torch.linalg.vector_norm(p - share - bias)))
        ref = float(torch.linalg.vector_norm(share))
        relative.append(diff / ref if ref > 0 else (0.0 if diff == 0 else math.inf))
        absolute.append(diff)
    return relative, absolute


#: copies of the golden's shape that differ between the ranks, each far from the golden, whose sum
#: is within this fraction of the worst copy's distance, are partial products left unreduced (a
#: missing all-reduce, or a tensor dumped before its all-reduce); a fault in one rank's copy, or
#: rounding, never sums to the golden
UNREDUCED_MATCH = 0.1


def unreduced(golden: torch.Tensor, copies: list[torch.Tensor], worst: float) -> float | None:
    """The relative distance of the copies' sum to the golden where they are partial products
    (``UNREDUCED_MATCH`` of ``worst``, the worst copy's own distance), else None."""
    if len(copies) < 2:
        return None
    summed = shard_errors(golden, REPLICATED, [join_tensors(SUM, copies)])[0]
    return summed if summed < UNREDUCED_MATCH * worst else None


def standout(errors: list[float], ranks: list[int]) -> tuple[int, float, float] | None:
    """``(rank, its error, the others' median)`` when one shard's error stands out (``STANDS_OUT``)."""
    if len(errors) < 2:
        return None
    worst = max(range(len(errors)), key=lambda i: (math.isnan(errors[i]), errors[i]))
    rest = sorted(e for i, e in enumerate(errors) if i != worst)
    median = rest[len(rest) // 2] if len(rest) % 2 else (rest[len(rest) // 2 - 1] + rest[len(rest) // 2]) / 2
    e = errors[worst]
    if math.isnan(e) or e > STANDS_OUT * median and e > 0:
        return ranks[worst], e, median
    return None
