"""Rows after the first differing token ran on different inputs: the compare marks them diverged
and never picks one as the first failing row, the worst row or the reason for the headline, in
the library call and in ``llmflow compare`` (a subprocess, the user's way)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from path_helpers import checkout_path

from llmflow.compare.divergence import divergence, first_mismatch
from llmflow.compare.run import CompareOptions, compare_dumps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import model_items, reader, write_dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = range(5)


def _dumps(tmp: Path, golden_ids: list[int] | None, target_ids: list[int] | None,
           broken_from: int = 3) -> tuple[Path, Path]:
    """Golden and target as the dump stage lays them out (``<stage>/dump`` beside
    ``<stage>/generation.json``); the target's layers differ wildly from step ``broken_from`` on,
    as a target running on other tokens does."""
    wild = lambda i, x: -x  # noqa: E731
    out = []
    for side, ids in (("golden", golden_ids), ("target", target_ids)):
        items = {s: model_items(seed=s, dtype=torch.float32 if side == "golden" else torch.bfloat16,
                                fault=wild if side == "target" and s >= broken_from else None) for s in STEPS}
        dump = write_dump(tmp / side / "dump", items)
        if ids is not None:
            (tmp / side / "generation.json").write_text(json.dumps({"prompt": "p", "output_ids": ids}))
        out.append(dump)
    return out[0], out[1]


def _csv(path: str) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_first_mismatch_and_the_generation_record(tmp_path: Path) -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1 and first_mismatch([1, 2, 3], [1, 2]) == 2
    g, t = _dumps(tmp_path, [1, 2, 3, 4, 5], [1, 2, 9, 9, 9])
    assert divergence(g, t).first_differing_token == 2
    # a generation.json that is not the dump stage's (no integer output_ids) is not trusted
    (tmp_path / "target" / "generation.json").write_text(json.dumps({"output_ids": ["a"]}))
    assert divergence(g, t) is None


def test_rows_after_the_texts_part_are_diverged_never_first_or_worst(tmp_path: Path) -> None:
    g, t = _dumps(tmp_path, [1, 2, 3, 4, 5], [1, 2, 9, 9, 9])  # the texts part at token 2
    res = compare_dumps(reader(g), reader(t), tmp_path / "out", CompareOptions(target_dtype="bfloat16"))
    s = res["summary"]
    assert s.divergence.first_differing_token == 2
    layer = _csv(res["csv"]["layer"])
    assert {r["step"] for r in layer if r["diverged"] == "True"} == {"3", "4"}
    assert {r["step"] for r in layer if r["diverged"] == "False"} == {"0", "1", "2"}
    # every failing row is after the texts part: none is the first failing row, none the worst
    assert s.counts["fail"] > 0 and all(r["verdict"] != "fail" for r in layer if r["diverged"] == "False")
    for level in ("layer", "module"):
        lv = s.levels[level]
        assert lv.first_fail is None and lv.diverged == sum(
            1 for r in _csv(res["csv"][level]) if r["diverged"] == "True")
        assert lv.worst and all(w.step <= 2 for w in lv.worst)
    assert s.outcome.headline.endswith("all after the texts part at token 2")
    assert json.loads(Path(res["summary_file"]).read_text())["levels"]["layer"]["first_fail"] is None


def test_a_fault_before_the_texts_part_is_the_first_failing_row(tmp_path: Path) -> None:
    g, t = _dumps(tmp_path, [1, 2, 3, 4, 5], [1, 2, 3, 9, 9], broken_from=1)  # texts part at token 3
    res = compare_dumps(reader(g), reader(t), tmp_path / "out", CompareOptions(target_dtype="bfloat16"))
    first = res["summary"].levels["layer"].first_fail
    assert (first.step, first.name, first.diverged) == (1, "model.layers.0", False)
    # without generation records nothing is marked: the same rows, no diverged column values
    plain, plain_t = _dumps(tmp_path / "plain", None, None)
    res = compare_dumps(reader(plain), reader(plain_t), tmp_path / "out2",
                        CompareOptions(target_dtype="bfloat16"))
    assert res["summary"].divergence is None
    assert {r["diverged"] for r in _csv(res["csv"]["layer"])} == {""}
    assert res["summary"].levels["layer"].first_fail.step == 3
    assert res["summary"].levels["layer"].first_fail.diverged is None  # not known without the records


def test_cli_compare_says_where_the_texts_part(tmp_path: Path) -> None:
    g, t = _dumps(tmp_path, [1, 2, 3, 4, 5], [1, 2, 9, 9, 9])
    done = subprocess.run([sys.executable, "-m", "llmflow", "compare", "-gp", str(g), "-mp", str(t), "-o",
                           str(tmp_path / "out"), "--workers", "1"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": checkout_path(REPO), "NO_COLOR": "1",
                                            "COLUMNS": "200"})
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("diverged: the texts part at token 2;") for line in lines), done.stdout
    assert lines[-1].startswith("FAILED") and lines[-1].endswith("all after the texts part at token 2")
