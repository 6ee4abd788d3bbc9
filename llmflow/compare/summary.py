"""The ``compare`` block of summary.json, built row by row while the rows stream past.

Per level: row counts per verdict, how rows were matched, unmatched counts, the first failing
(and first warning) row in execution order and the ten worst rows by cosine similarity. For the
logits level also the greedy-token agreement and the first step whose top-1 token differs.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

KEEP = ("step", "target_step", "rank", "name", "target_name", "kind", "index", "verdict", "reason",
        "cosine_similarity", "relative_euclidean_distance", "max_absolute_error", "kl_divergence",
        "norm_rel_diff")
WORST = 10


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

    def _level(self, level: str) -> dict[str, Any]:
        if level not in self.levels:
            self.levels[level] = {"rows": 0, "counts": {"pass": 0, "warn": 0, "fail": 0, "unmatched": 0},
                                  "match": {}, "unmatched_golden": 0, "unmatched_target": 0,
                                  "first_fail": None, "first_warn": None}
            self._worst[level] = []
        return self.levels[level]

    def add(self, levels: tuple[str, ...], row: dict[str, Any]) -> None:
        self._seq += 1
        v = row.get("verdict", "")
        # per row, not per level: a layer row is also a module row
        self.totals[v] = self.totals.get(v, 0) + 1
        for level in levels:
            s = self._level(level)
            s["rows"] += 1
            s["counts"][v] = s["counts"].get(v, 0) + 1
            how = row.get("match", "")
            if how == "unmatched golden":
                s["unmatched_golden"] += 1
            elif how == "unmatched target":
                s["unmatched_target"] += 1
            else:
                s["match"][how] = s["match"].get(how, 0) + 1
            if v == "fail" and s["first_fail"] is None:
                s["first_fail"] = brief(row)
            if v == "warn" and s["first_warn"] is None:
                s["first_warn"] = brief(row)
            cos = row.get("cosine_similarity")
            if isinstance(cos, (int, float)) and math.isfinite(cos):
                heap = self._worst[level]
                item = (-cos, -self._seq, brief(row))
                if len(heap) < WORST:
                    heapq.heappush(heap, item)
                elif item > heap[0]:
                    heapq.heapreplace(heap, item)
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
        out: dict[str, Any] = {"verdict": verdict, "counts": totals, "levels": levels}
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
