"""Did a compare compare? A run whose rows mostly found no partner must not read as a pass.

Counted per golden entry (a row), before any tensor is read:

* paired: matched with a target entry (by name, a mapping or order);
* unpaired: unmatched where the target has rows of that level and kind in that step that found
  no partner either (the two sides name things differently: each such target row accounts for
  one golden row), or no entry of that level in that step at all (other token ranges: logits
  are dumped every step, modules only in the token_range), plus golden entries of steps the
  target has no step for;
* golden only: the other unmatched rows, beside target rows that all paired: the target is
  coarser (an engine's fused op for several torch modules) or dumped less (a module_list);
* not in the target: a level or kind the target did not dump at all (golden inputs and outputs
  against target outputs only, as the bisect recipe dumps them), or a kind the mapping in use
  does not map (atb-llama maps outputs: an ATB op's inputs are not its torch module's).

The last two are listed, not counted against the compare.

The compare is *incomplete* (its verdict fail) when nothing paired, when more than half of the
counted golden rows are unpaired, or when a level both dumps hold paired nothing. ``assess``
also names the likely cause: different naming (a mapping is needed), different token ranges or
steps, tensors the target did not dump, a side with no usable data.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from llmflow.compare.pairing import Pairing
from llmflow.formats.base import DumpReader
from llmflow.results.compare import Coverage, LevelCoverage

UNPAIRED_SHARE = 0.5


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
            elif (lv, p.target_step) not in target_steps:
                how = "unpaired"
                lost["steps"].add(p.golden_step)  # type: ignore[union-attr]
            elif leftovers[(lv, p.golden.kind, p.target_step)] > 0:
                leftovers[(lv, p.golden.kind, p.target_step)] -= 1
                how = "unpaired"
                lost["name"] = lost["name"] or p.golden.name
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
    incomplete = paired == 0 or unpaired > UNPAIRED_SHARE * considered or bool(empty_levels)
    out = Coverage(
        state="incomplete" if incomplete else "complete", paired=paired, unpaired=unpaired,
        considered=considered, golden_only=golden_only, missing_step_rows=pairing.missing_rows,
        levels={lv: LevelCoverage(**d) for lv, d in levels.items()}, levels_without_pairs=empty_levels,
        not_in_target=dict(not_in_target), causes=[], headline=None)
    if not incomplete:
        return out
    causes = _causes(pairing, golden, target, lost, not_in_target)
    out.causes = causes
    where = ", ".join(f"{lv} {d['unpaired']}" for lv, d in levels.items() if d["unpaired"])
    if pairing.missing_rows:
        where = ", ".join(filter(None, [where, f"{pairing.missing_rows} in steps the target lacks"]))
    head = (f"incomplete: {unpaired} of {considered} golden rows found no partner ({where})"
            if considered else "incomplete: no golden row could pair with a target row")
    if empty_levels:
        head += f"; nothing paired at level {', '.join(empty_levels)}"
    out.headline = head + (f"; likely: {'; '.join(causes)}" if causes else "")
    return out


def _causes(pairing: Pairing, golden: DumpReader, target: DumpReader, lost: dict[str, Any],
            not_in_target: Counter[str]) -> list[str]:
    causes = []
    steps = set(lost["steps"]) | {int(m["golden_step"]) for m in pairing.missing if m.get("side") == "target"}
    if steps:
        causes.append(f"different token ranges / steps: golden steps {_span(list(steps))} have no target "
                      f"step or no target entry of their level (target steps {_span(target.steps())}); "
                      "check token_range, --steps, --prefill-offset")
    if lost["name"] and lost["target"]:
        hint = "-mf FILE"
        if getattr(target, "format", "") == "atb" and not pairing.mapping:
            hint += "; -mf atb-llama for ATB Llama"
        causes.append(f"the dumps name their tensors differently (golden {lost['name']!r}, target "
                      f"{lost['target']!r}): an op-mapping file pairs them ({hint})")
    for side, reader in (("golden", golden), ("target", target)):
        tensors = [e for e in reader.entries() if e.dtype is not None and e.step >= 0]
        if tensors and not any(e.has_data for e in tensors):
            usable = sum(1 for e in tensors if e.stats)
            causes.append(f"the {side} dump holds statistics only" + (
                f" and {len(tensors) - usable} of its {len(tensors)} tensor entries have none" if
                usable < len(tensors) else ": its rows compare statistics"))
    if not_in_target and not causes:
        kinds = ", ".join(f"{k} ({n})" for k, n in not_in_target.most_common(3))
        causes.append(f"the target dump has no {kinds} entries")
    return causes


def _span(steps: list[int]) -> str:
    steps = sorted(steps)
    if not steps:
        return "none"
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
