"""Did a compare compare? A run whose rows mostly found no partner must not read as a pass.

Counted per golden entry (a row), before any tensor is read:

* paired: matched with a target entry (by name, a mapping or order);
* unpaired: unmatched where the target has rows of that level and kind in that step that found
  no partner either (the two sides name things differently: each such target row accounts for
  one golden row), or no entry of that level in that step at all (other token ranges: logits
  are dumped every step, modules only in the token_range), plus golden entries of steps the
  target has no step for;
* unpaired too: golden rows the target's rows of their step do not reach: before the first
  or after the last golden row that paired (a target dump cut short, or begun late), or in a
  decoder layer none of whose golden rows paired (a layer the target never dumped);
* golden only: the other unmatched rows, beside target rows that all paired: the target is
  coarser (an engine's fused op for several torch modules, inside the layers it covers);
* not in the target: a level or kind the target did not dump at all (golden inputs and outputs
  against target outputs only, as the bisect recipe dumps them), or a kind the mapping in use
  does not map (atb-llama maps outputs: an ATB op's inputs are not its torch module's).

The last two are listed, not counted against the compare.

The compare is *incomplete* (its verdict fail) when nothing paired, when more than half of the
counted golden rows are unpaired, when a level both dumps hold paired nothing, when a decoder
layer the golden dumped has no row in the target in a step both dumps hold (a compare that
never saw a layer cannot say the target matches there), when the target holds no row of a rank
the golden dumped, when the target dumped a level but not at every step the golden dumped it (a
token_range without the prefill: ``--steps`` picks the steps both hold), or when only the logits
paired while the golden holds other levels. ``assess`` also names the likely cause: different
naming (a mapping is needed), ranks or token ranges or steps, tensors the target did not dump, a
side with no usable data.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from llmflow.compare.align import steps_text
from llmflow.compare.pairing import Pairing
from llmflow.formats.base import DumpReader
from llmflow.results.compare import Coverage, LevelCoverage
from llmflow.structure import layer_of_name

UNPAIRED_SHARE = 0.5


def paired_too_little(paired: int, unpaired: int) -> bool:
    """Nothing paired, or more than ``UNPAIRED_SHARE`` of the golden rows counted found no partner
    (a dump compare's rows, two tensor files' tensors)."""
    return paired == 0 or unpaired > UNPAIRED_SHARE * (paired + unpaired)


def assess(pairing: Pairing, golden: DumpReader, target: DumpReader) -> Coverage:
    """The ``coverage`` block of the summary: state, counts per level, likely causes, headline."""
    pairs = pairing.pairs
    target_buckets = {(lv, t.kind) for p in pairs for t in p.targets for lv in p.levels}
    target_steps = {(lv, p.target_step) for p in pairs if p.targets for lv in p.levels}
    leftovers = Counter((lv, p.targets[0].kind, p.target_step) for p in pairs if p.golden is None
                        for lv in p.levels)
    mapped = {r.kind for r in pairing.mapping.rules} if pairing.mapping else {"any"}
    levels: dict[str, dict[str, int]] = {}
    not_in_target: Counter[str] = Counter()
    paired = unpaired = golden_only = 0
    lost = {"name": None, "target": None, "steps": set()}
    spans, layers_seen = _reach(pairs)
    target_ranks = set(target.ranks())
    ranks_lost: set[int] = set()  # golden ranks the target holds no row of
    layers_lost: dict[str, set[int]] = {}  # golden layers without a target row -> their steps
    steps_lost: dict[str, set[int]] = {}  # level -> golden steps with no target row of that level
    for p in pairs:
        if p.golden is None:
            lost["target"] = lost["target"] or p.targets[0].name
            continue
        verdicts = set()
        for lv in p.levels:
            d = levels.setdefault(lv, {"golden": 0, "paired": 0, "unpaired": 0, "golden_only": 0,
                                       "not_in_target": 0})
            d["golden"] += 1
            if not p.unmatched:
                how = "paired"
            elif (lv, p.golden.kind) not in target_buckets or not ({"any", p.golden.kind} & mapped):
                how = "not_in_target"
                not_in_target[f"{lv} {p.golden.kind}"] += 1
            elif target_ranks and p.rank not in target_ranks:
                how = "unpaired"
                ranks_lost.add(p.rank)
            elif (lv, p.target_step) not in target_steps:
                how = "unpaired"
                lost["steps"].add(p.golden_step)  # type: ignore[union-attr]
                steps_lost.setdefault(lv, set()).add(p.golden_step)
            elif leftovers[(lv, p.golden.kind, p.target_step)] > 0:
                leftovers[(lv, p.golden.kind, p.target_step)] -= 1
                how = "unpaired"
                lost["name"] = lost["name"] or p.golden.name
            elif (layer := _layer_not_reached(p, lv, layers_seen)) is not None:
                how = "unpaired"
                layers_lost.setdefault(layer, set()).add(p.golden_step)
            elif not _within(p, spans):
                how = "unpaired"
                lost["reach"] = lost.get("reach") or p.golden.name
            else:
                how = "golden_only"
            d[how] += 1
            verdicts.add(how)
        if "paired" in verdicts:
            paired += 1
        elif "unpaired" in verdicts:
            unpaired += 1
        elif "golden_only" in verdicts:
            golden_only += 1
    unpaired += pairing.missing_rows
    considered = paired + unpaired
    empty_levels = [lv for lv, d in levels.items() if d["unpaired"] and not d["paired"]]
    # only the logits paired while the golden holds other levels the target never dumped (a module
    # dump against an API one, a module_list that matched nothing): the model was not compared
    only_logits = [lv for lv, d in levels.items() if lv != "logits" and d["golden"]] \
        if paired and all(lv == "logits" for lv, d in levels.items() if d["paired"]) else []
    # a level the target dumped, but not at every golden step it holds (a token_range that left
    # out the prefill): those steps were never compared
    steps_not_in_target = {lv: sorted(steps) for lv, steps in steps_lost.items() if levels[lv]["paired"]}
    incomplete = (paired_too_little(paired, unpaired) or bool(empty_levels) or bool(layers_lost)
                  or bool(only_logits) or bool(steps_not_in_target) or bool(ranks_lost))
    out = Coverage(
        state="incomplete" if incomplete else "complete", paired=paired, unpaired=unpaired,
        considered=considered, golden_only=golden_only, missing_step_rows=pairing.missing_rows,
        levels={lv: LevelCoverage(**d) for lv, d in levels.items()}, levels_without_pairs=empty_levels,
        not_in_target=dict(not_in_target), causes=[], headline=None,
        layers_not_in_target=sorted(layers_lost, key=_layer_order), steps_not_in_target=steps_not_in_target,
        ranks_not_in_target=sorted(ranks_lost))
    if not incomplete:
        return out
    causes = _causes(pairing, golden, target, lost, not_in_target, layers_lost, ranks_lost)
    out.causes = causes
    where = ", ".join(f"{lv} {d['unpaired']}" for lv, d in levels.items() if d["unpaired"])
    if pairing.missing_rows:
        where = ", ".join(filter(None, [where, f"{pairing.missing_rows} in steps the target lacks"]))
    head = (f"incomplete: {unpaired} of {considered} golden rows found no partner ({where})"
            if considered else "incomplete: no golden row could pair with a target row")
    if empty_levels:
        head += f"; nothing paired at level {', '.join(empty_levels)}"
    if only_logits:
        head = (f"incomplete: only the logits paired; the target has no {', '.join(only_logits)} rows to "
                "pair with the golden's (dumped in another mode, or a module_list that matched nothing); "
                "-cl logits compares the logits alone")
    out.headline = head + (f"; likely: {'; '.join(causes)}" if causes else "")
    return out


def _reach(pairs: list[Any]) -> tuple[dict[tuple[int, int], tuple[int, int]], set[tuple[int, int, str]]]:
    """Where the target's rows reach, per (rank, golden step): the first and last golden order
    that paired, and the decoder layers with a paired golden row."""
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    layers: set[tuple[int, int, str]] = set()
    for p in pairs:
        if p.unmatched:
            continue
        key, order = (p.rank, p.golden_step), p.golden.order
        first, last = spans.get(key, (order, order))
        spans[key] = (min(first, order), max(last, order))
        layer = layer_of_name(p.golden.name)
        if layer is not None:
            layers.add((*key, layer))
    return spans, layers


def _layer_not_reached(p: Any, level: str, layers: set[tuple[int, int, str]]) -> str | None:
    """The decoder layer of golden row ``p`` when none of that layer's golden rows paired in its
    step (module paths only: an API row's name has no layer of its own to go by)."""
    if level not in ("module", "layer"):
        return None
    layer = layer_of_name(p.golden.name)
    return layer if layer is not None and (p.rank, p.golden_step, layer) not in layers else None


def _within(p: Any, spans: dict[tuple[int, int], tuple[int, int]]) -> bool:
    span = spans.get((p.rank, p.golden_step))
    return span is not None and span[0] <= p.golden.order <= span[1]


def _layer_order(layer: str) -> tuple[str, int]:
    head, _, index = layer.rpartition(".")
    return head, int(index) if index.isdigit() else -1


def _causes(pairing: Pairing, golden: DumpReader, target: DumpReader, lost: dict[str, Any],
            not_in_target: Counter[str], layers_lost: dict[str, set[int]], ranks_lost: set[int]) -> list[str]:
    causes = []
    g_ranks, t_ranks = golden.ranks(), target.ranks()
    common = sorted(set(g_ranks) & set(t_ranks))
    if ranks_lost and common:  # (each of their rows unpaired: said once, not as layers or names lost)
        causes.append(f"the target holds no rank {steps_text(sorted(ranks_lost))} (golden rank "
                      f"{steps_text(g_ranks)}, target rank {steps_text(t_ranks)}): compare a rank both hold "
                      f"(-r {common[0]}), or give the target's dump of every rank")
    if layers_lost:
        names = sorted(layers_lost, key=_layer_order)
        shown = ", ".join(names[:3]) + (f" ... ({len(names)} layers)" if len(names) > 3 else "")
        steps = sorted(set().union(*layers_lost.values()))
        causes.append(f"the target has no rows of golden layer{'s' if len(names) > 1 else ''} {shown} "
                      f"(steps {steps_text(steps)}): its dump stops early or covers fewer layers; dump the "
                      "same layers on both sides")
    elif lost.get("reach"):
        causes.append(f"the target's rows stop short of the golden's (from {lost['reach']!r}): its dump "
                      "stops early or covers less; dump the same modules on both sides")
    steps = set(lost["steps"]) | {int(m["golden_step"]) for m in pairing.missing if m.get("side") == "target"}
    if steps:
        causes.append(f"different token ranges / steps: golden steps {steps_text(list(steps))} have no "
                      "target step or no target entry of their level (target steps "
                      f"{steps_text(target.steps())}); "
                      "check token_range and --prefill-offset, or compare the steps both dumps hold "
                      "(--steps)")
    if (ranks_lost and not common) or (lost["name"] and lost["name"] == lost["target"] and g_ranks != t_ranks
                                       and not ranks_lost):  # (named alike, apart)
        causes.append(f"the dumps hold different ranks (golden rank {steps_text(g_ranks)}, target rank "
                      f"{steps_text(t_ranks)}): compare a rank both hold (-r N), or give each side its "
                      "dump's own folder, not one rank's folder")
    elif lost["name"] and lost["target"] and lost["name"] != lost["target"]:
        hint = "-mf FILE"
        if getattr(target, "format", "") == "atb" and not pairing.mapping:
            hint += "; -mf atb-llama for ATB Llama"
        causes.append(f"the dumps name their tensors differently (golden {lost['name']!r}, target "
                      f"{lost['target']!r}): an op-mapping file pairs them ({hint})")
    for side, reader in (("golden", golden), ("target", target)):
        tensors = [e for e in reader.entries() if e.dtype is not None and e.step >= 0]
        usable = sum(1 for e in tensors if e.stats)
        if tensors and usable < len(tensors) and not any(e.has_data for e in tensors):
            # (statistics compare as rows do: only entries with neither leave rows without data)
            causes.append(f"the {side} dump holds statistics only and {len(tensors) - usable} of its "
                          f"{len(tensors)} tensor entries have none")
    if not_in_target and not causes:
        kinds = ", ".join(f"{k} ({n})" for k, n in not_in_target.most_common(3))
        causes.append(f"the target dump has no {kinds} entries")
    return causes
