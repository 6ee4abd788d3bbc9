"""A dump whose index names one tensor twice cannot be trusted: the reader says which tensor, and
``llmflow compare`` never says PASSED on it, whichever copy of the row comes first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

from llmflow.formats.llmflow_dump import LlmflowDumpReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from dump_helpers import dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def compare_cli(golden: Path, target: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow.cli", "compare", "-gp", str(golden),
                           "-mp", str(target), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("golden")
    dump(tmp, new_tokens=2)
    return tmp / "dump"


def with_duplicate_row(src: Path, dst: Path, copy_first: bool) -> str:
    """A copy of dump ``src`` whose index names one module output twice: a copy of its row pointing
    at other bytes (another tensor's of the same shape and dtype), before or after the original.
    Returns the tensor's name."""
    shutil.copytree(src, dst)
    index = dst / "rank0" / "index.jsonl"
    lines = [json.loads(raw) for raw in index.read_text().splitlines()]
    fields = lines[0]["fields"]
    col = {f: i for i, f in enumerate(fields)}
    for line in lines:
        for i, row in enumerate(line["rows"]):
            if (row[col["level"]], row[col["kind"]], row[col["index"]], row[col["step"]]) == \
                    ("module", "output", "0", 1) and row[col["dtype"]]:
                like = (row[col["shape"]], row[col["dtype"]])
                other_key = next(r[col["key"]] for ln in lines for r in ln["rows"]
                                 if r[col["key"]] and r[col["key"]] != row[col["key"]]
                                 and (r[col["shape"]], r[col["dtype"]]) == like)
                twin = list(row)
                twin[col["key"]] = other_key  # a different claim about the same capture
                line["rows"][i:i + 1] = [twin, row] if copy_first else [row, twin]
                index.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
                meta = json.loads((dst / "rank0" / "rank.json").read_text())
                meta["entries"] += 1  # as a writer that wrote the row twice counts it
                (dst / "rank0" / "rank.json").write_text(json.dumps(meta))
                return row[col["name"]]
    raise AssertionError("no module output at step 1")


@pytest.mark.parametrize("copy_first", [True, False], ids=["copy-first", "copy-last"])
def test_a_tensor_indexed_twice_is_a_problem_and_the_compare_does_not_pass(
        tmp_path: Path, golden: Path, copy_first: bool) -> None:
    target = tmp_path / "target"
    name = with_duplicate_row(golden, target, copy_first)
    problems = LlmflowDumpReader(target).problems()
    assert len(problems) == 1 and name in problems[0] and "indexed twice" in problems[0], problems

    for g, t in ((golden, target), (target, golden)):  # the damaged dump on either side
        out = tmp_path / f"out-{g.name}"
        proc = compare_cli(g, t, out)
        last = proc.stdout.strip().splitlines()[-1]
        assert proc.returncode != 0 and not last.startswith("PASSED"), proc.stdout + proc.stderr
        summary = json.loads((out / "compare_summary.json").read_text())
        side = "golden" if g == target else "target"
        assert any(name in p for p in summary["problems"][side]), summary["problems"]


@pytest.mark.parametrize("lost", ["last-lines", "a-middle-line"])
def test_an_index_that_lost_whole_lines_is_a_problem_and_the_compare_does_not_pass(
        tmp_path: Path, golden: Path, lost: str) -> None:
    """A copy cut at the end of a line (or a line deleted by hand) leaves no torn line; the count
    the writer left in rank.json tells."""
    target = tmp_path / "target"
    shutil.copytree(golden, target)
    index = target / "rank0" / "index.jsonl"
    lines = index.read_text().splitlines(keepends=True)
    kept = lines[: len(lines) // 2] if lost == "last-lines" else lines[:1] + lines[2:]
    index.write_text("".join(kept))
    problems = LlmflowDumpReader(target).problems()
    assert len(problems) == 1 and "lines are missing" in problems[0], problems
    assert problems[0].startswith(f"{index}: ") and "its writer wrote" in problems[0]
    proc = compare_cli(golden, target, tmp_path / "out")
    assert proc.returncode != 0 and not proc.stdout.strip().splitlines()[-1].startswith("PASSED"), proc.stdout
    assert "lines are missing" in proc.stdout + proc.stderr


def test_a_module_called_twice_and_repeats_of_one_tensor_are_not_duplicates(golden: Path) -> None:
    reader = LlmflowDumpReader(golden)
    entries = reader.entries()
    keys = [e.key for e in entries if e.key]
    assert len(keys) > len(set(keys))  # repeats sharing the first capture's key are in this dump
    assert reader.problems() == []
