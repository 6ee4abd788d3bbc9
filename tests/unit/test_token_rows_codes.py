"""The bisect's logits rows (verdict.json ``token_rows``, the report's "Logits per step") say the
code and reason of the verdict they give, in the compare's words for the same logits."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch

from llmflow.compare.run import CompareOptions, compare_dumps
from llmflow.localize.tokens import token_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import reader, write_dump  # noqa: E402


def _logits(step: int) -> torch.Tensor:
    return torch.randn(1, 64, generator=torch.Generator().manual_seed(step))


def _dumps(tmp_path: Path) -> tuple[Path, Path]:
    """Three steps of logits: the target's the same at step 0, 5% off at step 1 (beyond bfloat16's
    warn limits, within its fail limits), negated at step 2."""
    noise = torch.randn(1, 64, generator=torch.Generator().manual_seed(99))
    off = _logits(1) + 0.05 * _logits(1).norm() * noise / noise.norm()
    golden = {s: [("logits", "output", "0", "logits", None, _logits(s))] for s in range(3)}
    target = {0: golden[0], 1: [("logits", "output", "0", "logits", None, off)],
              2: [("logits", "output", "0", "logits", None, -_logits(2))]}
    return write_dump(tmp_path / "golden", golden), write_dump(tmp_path / "target", target)


def test_each_row_says_the_code_and_reason_of_its_verdict(tmp_path):
    golden, target = _dumps(tmp_path)
    rows = token_rows(reader(golden), reader(target), golden_ids=[1, 2, 3], target_ids=[1, 2, 3],
                      target_dtype="bfloat16")
    said = {r.step: (r.verdict, r.code) for r in rows}
    assert said == {0: ("pass", "ok"), 1: ("warn", "threshold_warn"), 2: ("fail", "threshold_fail")}
    assert rows[0].reason == ""
    assert "relative_euclidean_distance" in rows[1].reason and "> warn 0.03 (bfloat16)" in rows[1].reason
    assert "< fail" in rows[2].reason
    # the compare's logits rows, judged at the same dtype, say the same
    done = compare_dumps(reader(golden), reader(target), tmp_path / "out",
                         CompareOptions(target_dtype="bfloat16", xlsx=False))
    with open(done["csv"]["logits"], newline="", encoding="utf-8") as fh:
        compared = {int(r["step"]): (r["verdict"], r["code"], r["reason"]) for r in csv.DictReader(fh)}
    assert {r.step: (r.verdict, r.code, r.reason) for r in rows} == compared
