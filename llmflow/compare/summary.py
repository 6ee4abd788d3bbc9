"""The ``compare`` block of summary.json (``CompareSummary``), built row by row while the rows stream past.

Per level: row counts per verdict and per problem code, how rows were matched, unmatched counts,
the first failing (and first warning) row in execution order and the ten worst rows by cosine
similarity. Rows marked ``diverged`` (a step after the first differing token: the two sides ran on
different inputs, ``llmflow.compare.divergence``) are counted, never chosen as first or worst.
For the logits level also the greedy-token agreement and the first step whose top-1 token differs.
Every count comes from the rows' ``code`` (``llmflow.compare.codes``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any

from llmflow.compare.codes import VERDICT_OF_VALUE, Code
from llmflow.results.compare import (
    CompareOutcome,
    CompareSummary,
    Coverage,
    Divergence,
    LevelSummary,
    LogitsAgreement,
    SummaryRow,
)

KEEP = tuple(f.name for f in dataclasses.fields(SummaryRow))
WORST = 10
_UNMATCHED_GOLDEN, _UNMATCHED_TARGET = Code.UNMATCHED_GOLDEN.value, Code.UNMATCHED_TARGET.value
_LEVEL_ORDER = {lv: i for i, lv in enumerate(("logits", "layer", "module", "api", "save"))}


def brief(row: dict[str, Any]) -> SummaryRow:
    """The columns of a row worth repeating in the summary (a NaN or Inf metric, or one the row
    lacks: None)."""
    kept = {}
    for k in KEEP:
        v = row.get(k)
        kept[k] = None if isinstance(v, float) and not math.isfinite(v) else v
    return SummaryRow(**kept)


class SummaryBuilder:
    """Accumulates rows (in execution order) into a ``CompareSummary``."""

    def __init__(self) -> None:
        self.levels: dict[str, LevelSummary] = {}
        self._worst: dict[str, list[tuple[float, int, SummaryRow]]] = {}
        self._seq = 0
        self._logits_steps: dict[int, bool] = {}
        self._kl: list[float] = []
        self.totals = {"pass": 0, "warn": 0, "fail": 0, "unmatched": 0}
        self.codes: dict[str, int] = {}

    def _level(self, level: str) -> LevelSummary:
        if level not in self.levels:
            self.levels[level] = LevelSummary(
                rows=0, counts={"pass": 0, "warn": 0, "fail": 0, "unmatched": 0}, codes={}, match={},
                unmatched_golden=0, unmatched_target=0, diverged=0, first_fail=None, first_warn=None)
            self._worst[level] = []
        return self.levels[level]

    def add(self, levels: tuple[str, ...], row: dict[str, Any]) -> None:
        self._seq += 1
        code = row["code"]
        v = VERDICT_OF_VALUE[code]  # (a KeyError for a row without a known code: a bug, not data)
        # per row, not per level: a layer row is also a module row
        self.totals[v] += 1
        self.codes[code] = self.codes.get(code, 0) + 1
        for level in levels:
            s = self._level(level)
            s.rows += 1
            s.counts[v] += 1
            s.codes[code] = s.codes.get(code, 0) + 1
            if code == _UNMATCHED_GOLDEN:
                s.unmatched_golden += 1
            elif code == _UNMATCHED_TARGET:
                s.unmatched_target += 1
            else:
                how = row.get("match", "")
                s.match[how] = s.match.get(how, 0) + 1
            if row.get("diverged"):  # inputs differ: its error is not the kernels' alone
                s.diverged += 1
                continue
            if v == "fail" and s.first_fail is None:
                s.first_fail = brief(row)
            if v == "warn" and s.first_warn is None:
                s.first_warn = brief(row)
            cos = row.get("cosine_similarity")
            if isinstance(cos, (int, float)) and math.isfinite(cos):
                heap = self._worst[level]
                key = (-cos, -self._seq)
                if len(heap) < WORST:
                    heapq.heappush(heap, (*key, brief(row)))
                elif key > heap[0][:2]:  # (the brief only for a row that gets in: most do not)
                    heapq.heapreplace(heap, (*key, brief(row)))
        if "logits" in levels and "top1_match" in row:
            step = int(row["step"])
            self._logits_steps[step] = self._logits_steps.get(step, True) and bool(row["top1_match"])
            kl = row.get("kl_divergence")
            if isinstance(kl, float) and math.isfinite(kl):
                self._kl.append(kl)

    def result(self, *, stats_only: bool = False, **fields: Any) -> CompareSummary:
        """The summary: the counts and rows seen, ``fields`` (the dumps, matching, coverage,
        paths, timings ...: every other field of ``CompareSummary``) and the conclusion
        (``stats_only``: the compare compared statistics only, ``-st``)."""
        for level, heap in self._worst.items():
            # worst (lowest cosine) first; ties: the earlier row first
            ranked = sorted(heap, key=lambda x: (x[0], x[1]), reverse=True)
            self.levels[level].worst = [b for _, _, b in ranked]
        levels = dict(sorted(self.levels.items(), key=lambda kv: _LEVEL_ORDER.get(kv[0], len(_LEVEL_ORDER))))
        logits = None
        if self._logits_steps:
            steps = sorted(self._logits_steps)
            mismatched = [s for s in steps if not self._logits_steps[s]]
            logits = LogitsAgreement(
                steps=len(steps), top1_agreement=sum(self._logits_steps.values()) / len(steps),
                first_token_mismatch_step=mismatched[0] if mismatched else None,
                mean_kl_divergence=sum(self._kl) / len(self._kl) if self._kl else None)
        counts = dict(self.totals)
        state, verdict, outcome = conclude(counts, fields["pairs"], levels, fields["coverage"],
                                           fields["problems"], fields["divergence"],
                                           fields.get("different_inputs"), codes=self.codes,
                                           mapping=fields.get("mapping"), stats_only=stats_only)
        return CompareSummary(verdict=verdict, counts=counts, codes=dict(self.codes), levels=levels,
                              logits=logits, **fields, state=state, outcome=outcome)


def conclude(counts: dict[str, int], pairs: int, levels: dict[str, LevelSummary], coverage: Coverage,
             problems: dict[str, list[str]], divergence: Divergence | None,
             different_inputs: str | None = None, *, codes: dict[str, int] | None = None,
             mapping: str | None = None, stats_only: bool = False) -> tuple[str, str, CompareOutcome]:
    """The compare's conclusion: ``state`` (complete / incomplete), ``verdict`` and ``outcome``.

    Rows that fail on what was compared make it fail; rows of lost data (``load_error``: a tensor
    that could not be read, a tensor-parallel shard a rank lacks) are damage, not a fault, and like
    a dump whose reader reports problems make a compare without other failing rows inconclusive
    (also when it lost so much that most rows found no partner); otherwise a compare whose rows
    mostly found no partner fails (it did not compare).

    A pass says how many golden tensors were compared and why the others were not (``codes``: the
    rows per problem code; ``mapping``: the op mapping in use), and, for a compare of statistics
    only (``stats_only``, ``-st``), that statistics can hide a fault the tensors show.
    """
    problems = {side: p for side, p in problems.items() if p}
    incomplete = coverage.state == "incomplete"
    lost = Code.LOAD_ERROR.value
    # every failing row of every level lost data (a row of several levels counts in each)
    only_damage = all(s.counts.get("fail", 0) == s.codes.get(lost, 0) for s in levels.values())
    damaged = [r for s in levels.values() for r in (s.first_fail,) if r is not None and r.code == lost]
    next_step = ""
    if different_inputs:
        # no row of two runs on different inputs says anything of the target's kernels
        status = "inconclusive"
        headline = f"the two runs were not given the same inputs: {different_inputs}"
        next_step = ("dump both sides from the same token ids (the same prompt, chat template, BOS token "
                     "and tokenizer), then compare again")
    elif counts["fail"] and not only_damage:
        # the first failing row that compared something (a level whose first is lost data: its
        # worst rows by cosine are compared rows)
        fails = [r for s in levels.values() for r in (s.first_fail, *s.worst)
                 if r is not None and r.verdict == "fail" and r.code != lost and not r.diverged]
        first = min(fails, key=lambda r: (r.step, r.rank, r.order or 0), default=None)
        token = divergence.first_differing_token if divergence else None
        where = f"; first: {first.name} (step {first.step}, {first.code})" if first else \
            f"; all after the texts part at token {token}" if token is not None else ""
        # counted per tensor pair (one golden tensor at one step with its target), as ``pairs``
        # is: a pair written to several level CSVs (a decoder layer's output is a layer and a
        # module row) counts once, so the CSVs' verdict columns may add up to more
        status, headline = "fail", f"{counts['fail']} of {pairs} tensor pairs fail{where}"
        if damaged or any(s.codes.get(lost) for s in levels.values()):
            headline += "; some rows could not be read (load_error: lost data, not judged)"
        if incomplete:
            headline += "; and the compare is incomplete"
    elif problems or counts["fail"]:  # (a damaged dump explains rows without a partner: it lost them)
        status, side, headline = "inconclusive", "", ""
        if problems:
            side, items = next(iter(problems.items()))
            more = sum(map(len, problems.values())) - 1
            headline = f"the {side} dump cannot be trusted: {items[0]}" + (f" (+{more} more)" if more else "")
        if counts["fail"]:
            first = min(damaged, key=lambda r: (r.step, r.rank, r.order or 0), default=None)
            lost_rows = (f"{counts['fail']} of {pairs} tensor pairs could not be compared (lost data)"
                         + (f", first: {first.name} (step {first.step}): {first.reason}" if first else ""))
            headline = f"{headline}; {lost_rows}" if problems else lost_rows
        what = f"{side} dump" if problems else "dump named above"
        next_step = (f"llmflow inspect the {what} to see "
                     "what it lost, then dump that side again with every rank's folder and data file whole "
                     "(a run that ended early, or files removed since)")
        if incomplete:
            headline += (f"; so the compare is incomplete ({coverage.unpaired} of {coverage.considered} "
                         "golden rows found no partner)")
    elif incomplete:
        status, headline = "fail", str(coverage.headline)
    else:
        status = "pass"
        headline = _passed(counts, pairs, coverage, codes or {}, mapping)
        if stats_only:
            headline = (f"statistics only: {headline}; statistics can hide a fault the tensors show: "
                        "compare without -st")
    verdict = status if status != "pass" else ("warn" if counts["warn"] else "pass")
    return coverage.state, verdict, CompareOutcome(status=status, headline=headline,
                                                   next=next_step if status == "inconclusive" else "")


def _passed(counts: dict[str, int], pairs: int, coverage: Coverage, codes: dict[str, int],
            mapping: str | None) -> str:
    """A passing compare's headline: the tensor pairs compared, and when golden tensors were left
    out, how many of the golden's and why (from ``coverage``: the kinds the target did not dump, the
    tensors with no target counterpart, those in steps the target lacks)."""
    compared = counts["pass"] + counts["warn"] + counts["fail"]
    alone = codes.get(_UNMATCHED_GOLDEN, 0)
    extra = codes.get(_UNMATCHED_TARGET, 0)
    if not alone and not coverage.missing_step_rows and not counts["unmatched"]:
        return f"{pairs} tensor pairs, {counts['warn']} warn, 0 unmatched"
    why: list[str] = []
    in_steps = coverage.missing_step_rows
    unpaired = max(coverage.unpaired - in_steps, 0)
    not_dumped = max(alone - coverage.golden_only - unpaired, 0)
    if not_dumped:
        kinds = sorted({k.rpartition(" ")[2] for k in coverage.not_in_target}) or ["tensor"]
        by = f" or mapping {mapping} does not map" if mapping else ""
        why.append(f"{not_dumped} golden {' and '.join(k + 's' for k in kinds)} the target did not dump{by}")
    if coverage.golden_only:
        why.append(f"{coverage.golden_only} golden tensors with no target counterpart (a fused engine op, "
                   "or a narrower target dump)")
    if unpaired:
        why.append(f"{unpaired} golden tensors that found no partner")
    if in_steps:
        why.append(f"{in_steps} golden tensors in steps the target lacks")
    if extra:
        why.append(f"{extra} target tensors with no golden partner")
    golden = compared + alone + in_steps
    head = f"{compared} tensor pairs" if compared == golden else \
        f"{compared} of {golden} golden tensors compared"
    return f"{head}, {counts['warn']} warn; " + "; ".join(why)


def report_lines(summary: CompareSummary) -> list[str]:
    """What a person reads about a compare besides its table: how rows were matched, the dtype
    that judged, the dumps' problems, what did not pair, the steps without a partner."""
    from llmflow.compare.pairing import matching_text

    lines = [f"matching: {matching_text(summary.matching)}"]
    token = summary.divergence.first_differing_token if summary.divergence else None
    if token is not None:
        per_level = ", ".join(f"{s.diverged} {lv}" for lv, s in summary.levels.items() if s.diverged)
        read = "" if summary.divergence.golden_file else f" ({summary.divergence.source})"
        lines.append(f"diverged: the texts part at token {token}{read}; rows of later steps "
                     f"({per_level or 'none'}) ran on different inputs: marked diverged, never chosen "
                     "as first or worst")
    lines += list(summary.levels_without_rows.values())
    if summary.kl == "logits" and summary.logits is None:
        lines.append("kl_divergence: none computed (--kl logits, and no row is at the logits level; "
                     "--kl all gives every row's)")
    dtype = summary.judged_as.dtype or "each tensor's own dtype"
    lines.append(f"judged at {dtype}: {summary.judged_as.source}")
    for side, items in summary.problems.items():
        lines += [f"{side} dump problem: {p}" for p in items]
    coverage = summary.coverage
    if coverage.not_in_target:
        lines.append("not compared (the target dump has none, or the mapping does not map them): "
                     + ", ".join(f"{n} golden {what} rows" for what, n in coverage.not_in_target.items()))
    if coverage.golden_only:
        lines.append(f"golden only: {coverage.golden_only} rows with no target counterpart "
                     "(a fused engine op, or a narrower target dump)")
    if coverage.state == "incomplete":
        lines.append(str(coverage.headline))
    missing: dict[str, list] = {}
    for m in summary.missing_steps:  # one line per side, not one per step
        step = m.golden_step if m.side == "target" else m.target_step
        missing.setdefault(m.side, []).append(step)
    for side, steps in missing.items():
        shown = ", ".join(map(str, steps[:10])) + (f" ... ({len(steps)} in all)" if len(steps) > 10 else "")
        other = "golden" if side == "target" else "target"
        lines.append(f"{other} steps with no {side} step: {shown}")
    return lines
