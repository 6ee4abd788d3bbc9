"""The ``compare`` block of summary.json, built row by row while the rows stream past.

Per level: row counts per verdict and per problem code, how rows were matched, unmatched counts,
the first failing (and first warning) row in execution order and the ten worst rows by cosine
similarity. Rows marked ``diverged`` (a step after the first differing token: the two sides ran on
different inputs, ``llmflow.compare.divergence``) are counted, never chosen as first or worst.
For the logits level also the greedy-token agreement and the first step whose top-1 token differs.
Every count comes from the rows' ``code`` (``llmflow.compare.codes``).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from llmflow.compare.codes import VERDICT_OF_VALUE, Code

KEEP = ("step", "target_step", "rank", "order", "name", "target_name", "kind", "index", "verdict", "code",
        "reason",
        "cosine_similarity", "relative_euclidean_distance", "max_absolute_error", "kl_divergence",
        "norm_rel_diff", "diverged")
WORST = 10
_UNMATCHED_GOLDEN, _UNMATCHED_TARGET = Code.UNMATCHED_GOLDEN.value, Code.UNMATCHED_TARGET.value


def brief(row: dict[str, Any]) -> dict[str, Any]:
    """The columns of a row worth repeating in the summary (JSON-safe: NaN -> None)."""
    out = {}
    for k in KEEP:
        if k in row:
            v = row[k]
            out[k] = None if isinstance(v, float) and not math.isfinite(v) else v
    return out


class SummaryBuilder:
    """Accumulates rows (in execution order) into the summary dict."""

    def __init__(self) -> None:
        self.levels: dict[str, dict[str, Any]] = {}
        self._worst: dict[str, list[tuple[float, int, dict[str, Any]]]] = {}
        self._seq = 0
        self._logits_steps: dict[int, bool] = {}
        self._kl: list[float] = []
        self.totals = {"pass": 0, "warn": 0, "fail": 0, "unmatched": 0}
        self.codes: dict[str, int] = {}

    def _level(self, level: str) -> dict[str, Any]:
        if level not in self.levels:
            self.levels[level] = {"rows": 0, "counts": {"pass": 0, "warn": 0, "fail": 0, "unmatched": 0},
                                  "codes": {}, "match": {}, "unmatched_golden": 0, "unmatched_target": 0,
                                  "diverged": 0, "first_fail": None, "first_warn": None}
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
            s["rows"] += 1
            s["counts"][v] += 1
            s["codes"][code] = s["codes"].get(code, 0) + 1
            if code == _UNMATCHED_GOLDEN:
                s["unmatched_golden"] += 1
            elif code == _UNMATCHED_TARGET:
                s["unmatched_target"] += 1
            else:
                how = row.get("match", "")
                s["match"][how] = s["match"].get(how, 0) + 1
            if row.get("diverged"):  # inputs differ: its error is not the kernels' alone
                s["diverged"] += 1
                continue
            if v == "fail" and s["first_fail"] is None:
                s["first_fail"] = brief(row)
            if v == "warn" and s["first_warn"] is None:
                s["first_warn"] = brief(row)
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

    def result(self, **extra: Any) -> dict[str, Any]:
        """The summary dict; ``extra`` keys (paths, timings, missing steps ...) are merged in."""
        for level, heap in self._worst.items():
            # worst (lowest cosine) first; ties: the earlier row first
            ranked = sorted(heap, key=lambda x: (x[0], x[1]), reverse=True)
            self.levels[level]["worst"] = [b for _, _, b in ranked]
        totals = dict(self.totals)
        verdict = "fail" if totals["fail"] else "warn" if totals["warn"] else "pass"
        rank = {lv: i for i, lv in enumerate(("logits", "layer", "module", "api", "save"))}
        levels = dict(sorted(self.levels.items(), key=lambda kv: rank.get(kv[0], len(rank))))
        out: dict[str, Any] = {"verdict": verdict, "counts": totals, "codes": dict(self.codes),
                               "levels": levels}
        if self._logits_steps:
            steps = sorted(self._logits_steps)
            mismatched = [s for s in steps if not self._logits_steps[s]]
            out["logits"] = {
                "steps": len(steps),
                "top1_agreement": sum(self._logits_steps.values()) / len(steps),
                "first_token_mismatch_step": mismatched[0] if mismatched else None,
                "mean_kl_divergence": sum(self._kl) / len(self._kl) if self._kl else None,
            }
        out.update(extra)
        return out


def finish(result: dict[str, Any]) -> dict[str, Any]:
    """Add the compare's conclusion to a summary holding ``counts``, ``coverage`` and ``problems``:
    ``state`` (complete / incomplete), ``verdict`` and ``outcome`` ({status, headline}).

    Rows that fail make it fail; a compare whose rows mostly found no partner fails too (it did
    not compare); a dump whose reader reports problems can never pass (inconclusive).
    """
    counts, pairs = result["counts"], result.get("pairs", 0)
    coverage = result.get("coverage") or {}
    problems = {side: p for side, p in (result.get("problems") or {}).items() if p}
    incomplete = coverage.get("state") == "incomplete"
    if counts["fail"]:
        fails = [s["first_fail"] for s in result["levels"].values() if s.get("first_fail")]
        first = min(fails, key=lambda r: (r["step"], r["rank"], r.get("order") or 0), default=None)
        token = (result.get("divergence") or {}).get("first_differing_token")
        where = f"; first: {first['name']} (step {first['step']}, {first.get('code')})" if first else \
            f"; all after the texts part at token {token}" if token is not None else ""
        status, headline = "fail", f"{counts['fail']} of {pairs} rows fail{where}"
        if incomplete:
            headline += "; and the compare is incomplete"
    elif incomplete:
        status, headline = "fail", str(coverage["headline"])
    elif problems:
        side, items = next(iter(problems.items()))
        more = sum(map(len, problems.values())) - 1
        status = "inconclusive"
        headline = f"the {side} dump cannot be trusted: {items[0]}" + (f" (+{more} more)" if more else "")
    else:
        status = "pass"
        headline = f"{pairs} rows, {counts['warn']} warn, {counts['unmatched']} unmatched"
    result["state"] = coverage.get("state", "complete")
    result["verdict"] = status if status != "pass" else ("warn" if counts["warn"] else "pass")
    result["outcome"] = {"status": status, "headline": headline}
    return result


def report_lines(summary: dict[str, Any]) -> list[str]:
    """What a person reads about a compare besides its table: how rows were matched, the dtype
    that judged, the dumps' problems, what did not pair, the steps without a partner."""
    from llmflow.compare.pairing import matching_text

    lines = [f"matching: {matching_text(summary.get('matching') or {})}"]
    token = (summary.get("divergence") or {}).get("first_differing_token")
    if token is not None:
        per_level = ", ".join(f"{s['diverged']} {lv}" for lv, s in (summary.get("levels") or {}).items()
                              if s.get("diverged"))
        lines.append(f"diverged: the texts part at token {token}; rows of later steps "
                     f"({per_level or 'none'}) ran on different inputs: marked diverged, never chosen "
                     "as first or worst")
    lines += list((summary.get("levels_without_rows") or {}).values())
    judged = summary.get("judged_as") or {}
    dtype = judged.get("dtype") or "each tensor's own dtype"
    lines.append(f"judged at {dtype}: {judged.get('source', '')}")
    for side, items in (summary.get("problems") or {}).items():
        lines += [f"{side} dump problem: {p}" for p in items]
    coverage = summary.get("coverage") or {}
    skipped = coverage.get("not_in_target") or {}
    if skipped:
        lines.append("not compared (the target dump has none, or the mapping does not map them): "
                     + ", ".join(f"{n} golden {what} rows" for what, n in skipped.items()))
    if coverage.get("golden_only"):
        lines.append(f"golden only: {coverage['golden_only']} rows with no target counterpart "
                     "(a fused engine op, or a narrower target dump)")
    if coverage.get("state") == "incomplete":
        lines.append(str(coverage.get("headline")))
    missing: dict[str, list] = {}
    for m in summary.get("missing_steps") or []:  # one line per side, not one per step
        step = m.get("golden_step", m.get("target_step"))
        missing.setdefault(m.get("side", "?"), []).append(step)
    for side, steps in missing.items():
        shown = ", ".join(map(str, steps[:10])) + (f" ... ({len(steps)} in all)" if len(steps) > 10 else "")
        other = "golden" if side == "target" else "target"
        lines.append(f"{other} steps with no {side} step: {shown}")
    return lines
