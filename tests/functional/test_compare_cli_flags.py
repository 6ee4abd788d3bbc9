"""msit's flags of ``llmflow compare``, run the user's way (a subprocess): ``-w`` points to the
weight_check workflow, a level the dumps have no rows of says so, ``-l`` sets the log level, two
multi-tensor files pair by name into a compact table, the progress bar is up from the start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from path_helpers import checkout_path
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import as_dump  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def llmflow(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmflow", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO), "NO_COLOR": "1", **env})


def test_w_points_to_the_weight_check_workflow(tmp_path):
    for args in (["-w"], ["-gp", "a", "-mp", "b", "-w", "weights.safetensors"]):
        done = llmflow("compare", *args, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        (err,) = done.stderr.strip().splitlines()
        assert err.startswith("error: -w: weights are compared by the weight_check workflow: llmflow run "
                              "weight_check --set golden=")
        assert done.stdout.strip().splitlines()[-1] == "FAILED: -w: run the weight_check workflow"


def test_a_level_without_rows_says_so(tmp_path):
    g, t = as_dump(tmp_path, "g", steps=[0]), as_dump(tmp_path, "t", steps=[0])
    done = llmflow("compare", "-gp", str(g), "-mp", str(t), "-cl", "api", "-o", "out", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("error: compare: level api: the golden dump and the target dump have no "
                                   "api rows (only logits, layer, module)")
    assert not (tmp_path / "out").exists()
    # with a level that has rows, the compare runs and the empty one gets its line
    done = llmflow("compare", "-gp", str(g), "-mp", str(t), "-cl", "layer", "api", "-o", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "level api: the golden dump and the target dump have no api rows (only logits, layer, module)" \
        in done.stdout.splitlines()


def test_msprobe_users_flags_name_the_same_paths(tmp_path):
    """msprobe compare -tp TARGET -gp GOLDEN -o OUT, as msprobe users type it."""
    g, t = as_dump(tmp_path, "g", steps=[0]), as_dump(tmp_path, "t", steps=[0], noise=0.5)
    for flags in (["-tp", str(t), "-gp", str(g), "-o", "a"],):
        done = llmflow("compare", *flags, cwd=tmp_path)
        last = done.stdout.strip().splitlines()[-1]
        assert done.returncode == 1 and last.startswith("FAILED: "), done.stdout
        assert (tmp_path / flags[-1] / "compare_summary.json").is_file()


def test_l_sets_the_log_level(tmp_path):
    g, t = as_dump(tmp_path, "g", steps=[0]), as_dump(tmp_path, "t", steps=[0])
    debug = llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "a", "-l", "debug", cwd=tmp_path)
    assert debug.returncode == 0, debug.stdout + debug.stderr
    assert "DEBUG llmflow.compare: golden: " in debug.stderr and "entries indexed in" in debug.stderr
    assert "DEBUG llmflow.compare: paired: " in debug.stderr
    info = llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "b", cwd=tmp_path)
    assert info.returncode == 0 and "DEBUG" not in info.stderr and f"golden: {g}" in info.stdout
    quiet = llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "c", "-l", "error", cwd=tmp_path)
    assert quiet.returncode == 0 and "golden: " not in quiet.stdout and quiet.stderr == ""
    assert quiet.stdout.strip().splitlines()[-1].startswith("PASSED")


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "npz"])
def test_two_multi_tensor_files_pair_by_name_in_a_compact_table(tmp_path, fmt):
    gen = torch.Generator().manual_seed(0)
    golden = {f"layers.{i}.{w}": torch.randn(8, 4, generator=gen) for i in range(20) for w in ("q", "k")}
    golden["only_golden"] = torch.ones(2)
    target = {k: v.clone() for k, v in reversed(golden.items()) if k != "only_golden"}  # another order
    target["layers.7.k"] = -target["layers.7.k"]
    if fmt == "safetensors":
        save_file(golden, str(tmp_path / "g.safetensors"))
        save_file(target, str(tmp_path / "t.safetensors"))
    elif fmt == "pt":  # nested: named by path
        torch.save({"layers": [{w: golden[f"layers.{i}.{w}"] for w in "qk"} for i in range(20)],
                    "only_golden": golden["only_golden"]}, tmp_path / "g.pt")
        torch.save({"layers": [{w: target[f"layers.{i}.{w}"] for w in "qk"} for i in range(20)]},
                   tmp_path / "t.pt")
    else:
        np.savez(tmp_path / "g.npz", **{k: v.numpy() for k, v in golden.items()})
        np.savez(tmp_path / "t.npz", **{k: v.numpy() for k, v in target.items()})
    done = llmflow("compare", "-gp", f"g.{fmt}", "-mp", f"t.{fmt}", cwd=tmp_path, COLUMNS="160")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "FAILED: 1 of 40 tensors fail"
    assert "40 tensors paired by name" in done.stdout
    header = next(line for line in lines if "max abs err" in line)
    assert [c.strip() for c in header.strip("┃│ ").split("┃")][:6] == ["name", "shape", "dtype", "cosine",
                                                                    "max abs err", "verdict"]
    rows = {line.split("│")[1].strip(): line for line in lines if line.startswith("│")}
    rows.pop("", None)  # (a long reason wraps onto a line of its own)
    assert len(rows) == 41 and all(len(line) <= 160 for line in lines)  # one row per tensor
    assert "fail" in rows["layers.7.k"] and "-1" in rows["layers.7.k"] and "8x4" in rows["layers.7.k"]
    assert "pass" in rows["layers.3.q"] and "unmatched" in rows["only_golden"]


@pytest.mark.parametrize(("kept", "rc", "last"), [
    (1, 1, "FAILED: incomplete: 9 of 10 golden tensors have no tensor of their name in the target"),
    (0, 1, "FAILED: incomplete: 10 of 10 golden tensors have no tensor of their name in the target"),
    (8, 0, "PASSED (8 tensors, 2 golden only)"),
])
def test_two_tensor_files_that_pair_too_little_never_pass(tmp_path, kept, rc, last):
    golden = {f"w{i}": torch.full((4,), float(i)) for i in range(10)}
    target = {f"w{i}": golden[f"w{i}"].clone() for i in range(kept)} or {"other": torch.ones(4)}
    save_file(golden, str(tmp_path / "g.safetensors"))
    save_file(target, str(tmp_path / "t.safetensors"))
    done = llmflow("compare", "-gp", "g.safetensors", "-mp", "t.safetensors", cwd=tmp_path)
    assert done.returncode == rc and done.stdout.strip().splitlines()[-1] == last, done.stdout + done.stderr


@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_two_empty_tensor_files_compare_nothing_and_never_pass(tmp_path, suffix):
    for side in ("g", "t"):
        if suffix == "pt":
            torch.save(torch.zeros(0), tmp_path / f"{side}.pt")
        else:
            empty = {"a": torch.zeros(0, 4), "b": torch.zeros(2, 0)}
            save_file(empty, str(tmp_path / f"{side}.safetensors"))
    done = llmflow("compare", "-gp", f"g.{suffix}", "-mp", f"t.{suffix}", cwd=tmp_path)
    n = 1 if suffix == "pt" else 2
    said = f"INCONCLUSIVE: nothing compared: the {n} paired tensor(s) hold no elements on either side"
    assert done.returncode == 3 and done.stdout.strip().splitlines()[-1] == said, done.stdout


def test_two_tensor_files_with_o_say_nothing_is_written_there(tmp_path):
    save_file({"a": torch.ones(3)}, str(tmp_path / "g.safetensors"))
    save_file({"a": torch.ones(3)}, str(tmp_path / "t.safetensors"))
    done = llmflow("compare", "-gp", "g.safetensors", "-mp", "t.safetensors", "-o", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-2:] == ["-o out: nothing written there; two tensor files are compared on screen only",
                          "PASSED (1 tensors)"]
    assert not (tmp_path / "out").exists()


def test_limits_the_wrong_way_round_are_bad_input_naming_the_metric(tmp_path):
    """msit's habit of giving cosine as "warn below 0.9, fail below 0.5" written the other way
    round would fail every row that merely warns: refused, one line, before any work."""
    g = as_dump(tmp_path, "g", steps=[0])
    done = llmflow("compare", "-gp", "g", "-mp", "g", "-o", "out", "--thresholds",
                   '{"cosine_similarity": {"warn": 0.5, "fail": 0.9}}', cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == (
        "FAILED: --thresholds.cosine_similarity: warn 0.5 is below fail 0.9; higher is better for "
        "cosine_similarity, so warn >= fail")
    assert not (tmp_path / "out").exists() and g.is_dir()


def test_a_file_of_another_kind_is_one_line(tmp_path):
    torch.save({"a": torch.ones(2), "b": 3}, tmp_path / "g.pt")
    torch.save({"a": torch.ones(2)}, tmp_path / "t.pt")
    done = llmflow("compare", "-gp", "g.pt", "-mp", "t.pt", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "error: g.pt: expected a tensor or dicts/lists of tensors, found int at b"


@pytest.mark.parametrize(("part", "what"), [("rank0", "a folder"), ("rank0/data", "a folder"),
                                            ("rank0/index.jsonl", "a file")])
def test_a_folder_inside_a_dump_names_the_dump_and_the_rank_flag(tmp_path, part, what):
    g, t = as_dump(tmp_path, "g", steps=[0]), as_dump(tmp_path, "t", steps=[0])
    done = llmflow("compare", "-gp", str(g), "-mp", f"t/{part}", "-o", "out", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last == (f"FAILED: t/{part}: {what} inside the llmflow dump {t}: "
                    "give the dump itself (its ranks are read from it; compare takes one rank with "
                    "-r/--rank N)")
    assert not (tmp_path / "out").exists()
    # what it says works
    done = llmflow("compare", "-gp", str(g), "-mp", "t", "-r", "0", "-o", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_progress_bar_is_up_from_the_start(tmp_path):
    g, t = as_dump(tmp_path, "g", steps=[0, 1]), as_dump(tmp_path, "t", steps=[0, 1])
    done = llmflow("compare", "-gp", str(g), "-mp", str(t), "-o", "out", cwd=tmp_path,
                   TTY_INTERACTIVE="1", TTY_COMPATIBLE="1", COLUMNS="120")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # reading the indexes, pairing and comparing each have a bar, in that order
    assert 0 <= out.index("reading indexes") < out.index("pairing") < out.index("compare ")
    assert "2/2" in out  # the indexes bar counts the two dumps
    assert out.strip().splitlines()[-1].startswith("PASSED")


@pytest.mark.parametrize("command", ["compare", "run"])
@pytest.mark.parametrize("given", ["0", "-2", "two"])
def test_workers_below_one_or_not_a_number_are_bad_input(tmp_path, command, given):
    """``--workers 0`` would run nothing (or read as "all" somewhere else): refused before any work."""
    g = as_dump(tmp_path, "g", steps=[0])
    args = (["compare", "-gp", "g", "-mp", "g", "-o", "out"] if command == "compare"
            else ["run", str(REPO / "workflows" / "llama2_bisect.yaml"), "--run-dir", "out"])
    done = llmflow(*args, "--workers", given, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    why = "invalid int value: 'two'" if given == "two" else f"must be at least 1 (got {given})"
    assert done.stdout.strip().splitlines()[-1] == f"FAILED: llmflow {command}: argument --workers: {why}"
    assert not (tmp_path / "out").exists() and g.is_dir()
