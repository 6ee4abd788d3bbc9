"""What a compare row carries, for every dump format: each side's statistics (from the same read
as the metrics), a locator ``llmflow inspect`` opens, a problem code, and a reason naming what
tripped; and the first differing token decided the way greedy generate decides it."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from path_helpers import checkout_path
from safetensors.torch import save_file

from llmflow.cli import main
from llmflow.compare.run import CompareOptions, compare_dumps
from llmflow.dump import DumpConfig, dump_run
from llmflow.errors import UserError
from llmflow.formats import open_dump
from llmflow.formats.describe import find_entries, tensor_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import model_items, reader, write_dump  # noqa: E402
from dump_helpers import prompt_ids, tiny  # noqa: E402
from formats_helpers import capture, tiny_model, write_atb_from_capture, write_msit_from_capture  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _own_logging():
    yield
    logging.getLogger().handlers.clear()  # main() logs to the stderr pytest captured for one test


MSPROBE = textwrap.dedent("""
    import json, torch
    from llmflow.models import load_model
    from msprobe.pytorch import PrecisionDebugger
    model = load_model("tiny-llama:layers=2,hidden=64,seed=0").model.eval()
    cfg = {"task": "tensor", "dump_path": "dump", "rank": [], "step": [], "level": "L0", "seed": 1234,
           "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}
    json.dump(cfg, open("cfg.json", "w"))
    dbg = PrecisionDebugger(config_path="cfg.json")
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        for t in range(2):
            dbg.start(model=model)
            logits = model(ids, use_cache=False).logits
            dbg.stop()
            dbg.step()
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
""")


def make_dump(fmt: str, tmp: Path) -> Path:
    if fmt == "llmflow":
        path = tmp / "llmflow"
        dump_run(tiny(), prompt_ids("hello world"), 2, DumpConfig(dump_path=str(path), token_range="all"))
        return path
    if fmt == "msprobe":
        pytest.importorskip("msprobe.pytorch", reason="mindstudio-probe is not installed (optional)")
        (tmp / "run.py").write_text(MSPROBE)
        done = subprocess.run([sys.executable, "run.py"], cwd=tmp, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
        assert done.returncode == 0, done.stderr[-3000:]
        return tmp / "dump"
    tokens, types = capture(tiny_model(), steps=2)
    if fmt == "msit":
        return write_msit_from_capture(tmp / "msit", tokens, types)
    return write_atb_from_capture(tmp / "atb", tokens, two_models=False)


@pytest.mark.parametrize("fmt", ["llmflow", "msit", "atb", "msprobe"])
def test_rows_carry_statistics_and_locators_inspect_opens(tmp_path: Path, fmt: str) -> None:
    dump = make_dump(fmt, tmp_path)
    out = tmp_path / "out"
    assert main(["compare", "-gp", str(dump), "-mp", str(dump), "-o", str(out), "--no-xlsx"]) == 0
    summary = json.loads((out / "compare_summary.json").read_text())
    rows = [r for p in summary["csv"].values() for r in csv.DictReader(open(p))]
    assert rows and all(r["code"] == "ok" and r["verdict"] == "pass" for r in rows)
    r = open_dump(summary["golden_dump"])
    checked = 0
    for row in rows[:: max(1, len(rows) // 12)]:
        loc = row["golden_data_path"]
        assert loc and loc == row["target_data_path"], row
        # (an llmflow dump records a tensor passed on unchanged once: one locator, several entries)
        found = find_entries(r, loc)
        # (a head over every position shares its file with the logits entry of its last position)
        key = (row["name"], row["kind"], row["index"])
        entry = next((e for e in found if (e.name, e.kind, e.index) == key), None)
        assert entry is not None, (row, [(e.name, e.kind, e.index) for e in found])
        got = tensor_stats(r.load(entry))
        for s in ("max", "min", "norm"):
            assert float(row[f"golden_{s}"]) == pytest.approx(got[s], rel=1e-5, abs=1e-6), (loc, s)
            assert row[f"golden_{s}"] == row[f"target_{s}"]
        tolerance = 1e-5 * (abs(got["mean"]) + got["norm"] / got["numel"])
        assert abs(float(row["golden_mean"]) - got["mean"]) <= tolerance
        checked += 1
    assert checked >= 5
    # `llmflow inspect DUMP LOCATOR`, a user's way: the locator of a row, and its absolute file
    row = rows[-1]
    loc = row["golden_data_path"]
    for query in (loc, str(Path(summary["golden_dump"]) / loc)):
        done = subprocess.run([sys.executable, "-m", "llmflow.cli", "inspect", summary["golden_dump"], query],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
        lines = done.stdout.strip().splitlines()
        assert done.returncode == 0, done.stdout + done.stderr
        assert lines[-1].startswith(f"PASSED ({row['name']} {row['kind']} {row['index']}, step {row['step']}")
        assert f"locator {loc}" in done.stdout and "stats: numel=" in done.stdout and "tensor(" in done.stdout


def test_inspect_summarises_lists_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = make_dump("llmflow", tmp_path)
    assert main(["inspect", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "llmflow dump" in out and "  module: " in out and "  logits: 2 entries (2 output)" in out
    assert main(["inspect", str(dump), "model.layers.1.mlp"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "PASSED (4 entries listed)"  # in and out, 2 steps
    assert main(["inspect", str(dump), "model.layers.1.mlp", "--step", "1", "--kind", "output"]) == 0
    out = capsys.readouterr().out
    assert "dtype float32, shape [1, 1, 32]" in out  # a decode step: one position
    assert out.strip().splitlines()[-1] == "PASSED (model.layers.1.mlp output 0, step 1)"
    assert main(["inspect", str(dump), "model.layers.1.mpl"]) == 2
    err = capsys.readouterr().err
    assert "no entry named or stored at 'model.layers.1.mpl' (did you mean 'model.layers.1.mlp'" in err
    assert main(["inspect", str(dump), "logits", "--step", "7"]) == 2
    assert "'logits' has no entry with step 7 (it has: step 0 output 0" in capsys.readouterr().err


def test_inspect_of_a_damaged_dump_fails_and_a_closed_pipe_ends_it_quietly(tmp_path: Path) -> None:
    dump = make_dump("llmflow", tmp_path)
    data = sorted((dump / "rank0" / "data").glob("*.safetensors"))[0]  # step 0's
    data.write_bytes(data.read_bytes()[:64])  # as a copy cut short
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
    done = subprocess.run([sys.executable, "-m", "llmflow.cli", "inspect", str(dump)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"problem: {data}: truncated" in done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED: the dump cannot be trusted whole: 1 problem")
    # a user reading the first lines of a long print: no traceback when the reader goes
    save_file({"x": torch.randn(200, 500)}, tmp_path / "big.safetensors")  # more than a pipe holds
    shown = subprocess.run(f"{sys.executable} -m llmflow.cli inspect big.safetensors x --full | head -2; "
                           "echo exit=${PIPESTATUS[0]}", shell=True, executable="/bin/bash", cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, env=env)
    assert shown.stdout.splitlines()[1:] == ["  dtype float32, shape [200, 500]", "exit=141"], shown.stdout
    assert shown.stderr == ""
    save_file({f"t{i}": torch.zeros(2) for i in range(5000)}, tmp_path / "many.safetensors")  # a long listing
    listed = subprocess.run(f"{sys.executable} -m llmflow.cli inspect many.safetensors | head -1; "
                            "echo exit=${PIPESTATUS[0]}", shell=True, executable="/bin/bash", cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env=env)
    assert listed.stdout.splitlines()[-1] == "exit=141" and listed.stderr == "", listed.stderr
    # an entry asked for by name in the damaged dump: the damage is named, not the user's query
    query = [sys.executable, "-m", "llmflow.cli", "inspect", str(dump), "logits", "--step", "0"]
    asked = subprocess.run(query, capture_output=True, text=True, timeout=120, env=env)
    assert asked.returncode == 1, asked.stdout + asked.stderr
    assert f"problem: {data}: truncated" in asked.stdout
    assert "the dump cannot be trusted whole" in asked.stdout.strip().splitlines()[-1]


def test_codes_decide_verdicts_and_counts(tmp_path: Path) -> None:
    items = model_items(seed=0, logits=False)
    g = write_dump(tmp_path / "g", {0: items})
    bad = []
    for n, k, i, lv, mt, t in items:
        if n == "model.layers.1.mlp":
            t = t.clone()
            t[0, 0, 0] = float("nan")
        if n == "model.layers.2":
            t = t * 3
        if n == "model.layers.3.self_attn":
            t = t.reshape(-1)[:7]  # other element count: not comparable
        bad.append((n, k, i, lv, mt, t))
    bad.append(("model.extra", "output", "0", "module", None, torch.ones(3)))
    t = write_dump(tmp_path / "t", {0: bad})
    res = compare_dumps(reader(g), reader(t), tmp_path / "out", CompareOptions(xlsx=False))
    rows = {(r["name"] or r["target_name"]): r for r in csv.DictReader(open(res["csv"]["module"]))}
    assert (rows["model.layers.1.mlp"]["code"], rows["model.layers.1.mlp"]["verdict"]) == ("nan_inf", "fail")
    assert rows["model.layers.1.mlp"]["target_nan"] == "1" and rows["model.layers.1.mlp"]["golden_nan"] == "0"
    assert rows["model.layers.2"]["code"] == "threshold_fail"
    assert rows["model.layers.2"]["reason"].startswith("relative_euclidean_distance 2 > fail 0.01 (float32)")
    assert rows["model.layers.3.self_attn"]["code"] == "shape_mismatch"
    assert rows["model.extra"]["code"] == "unmatched_target" and rows["model.extra"]["verdict"] == "unmatched"
    assert rows["model.layers.0"]["code"] == "ok" and rows["model.layers.0"]["reason"] == ""
    s = res["summary"]
    assert s.codes["nan_inf"] == 1 and s.codes["shape_mismatch"] == 1
    assert s.codes["unmatched_target"] == 1
    assert s.counts["fail"] == sum(n for c, n in s.codes.items()
                                   if c in ("nan_inf", "threshold_fail", "shape_mismatch"))


def test_a_truncated_data_file_is_named_not_compared(tmp_path: Path) -> None:
    g = write_dump(tmp_path / "g", {0: model_items(seed=0, logits=False)})
    t = write_dump(tmp_path / "t", {0: model_items(seed=0, logits=False)})
    data = next((t / "rank0" / "data").glob("*.safetensors"))
    data.write_bytes(data.read_bytes()[:64])  # truncated after the index was written
    with pytest.raises(UserError, match=r"the target dump is damaged: .*000000\.safetensors: truncated"):
        compare_dumps(reader(g), reader(t), tmp_path / "out", CompareOptions(xlsx=False))
    assert not (tmp_path / "out").exists()


def test_an_unreadable_tensor_is_a_load_error_row(tmp_path: Path) -> None:
    g = write_dump(tmp_path / "g", {0: model_items(seed=0, logits=False)})
    t = write_dump(tmp_path / "t", {0: model_items(seed=0, logits=False)})
    target = reader(t)

    def unreadable(entry):
        raise OSError(f"I/O error reading {entry.key}")
    target.load = unreadable  # a disk error while the compare reads (the index and header are fine)
    res = compare_dumps(reader(g), target, tmp_path / "out", CompareOptions(xlsx=False))
    rows = list(csv.DictReader(open(res["csv"]["module"])))
    assert {r["code"] for r in rows} == {"load_error"} and all(r["verdict"] == "fail" for r in rows)
    assert res["summary"].codes == {"load_error": len(rows)}
    first = res["summary"].levels["module"].first_fail  # no metric: each is None in the summary
    assert first.code == "load_error" and first.cosine_similarity is None and first.norm_rel_diff is None


def test_top1_ties_are_decided_as_generate_decides_them(tmp_path: Path) -> None:
    """Two logits tie once rounded to bf16: generate takes the first (argmax); topk may return the
    other and would date the first differing token a step early."""
    gold = torch.randn(1, 50) * 0.1
    gold[0, 3], gold[0, 7] = 5.0, 4.999
    target = gold.bfloat16()
    assert target[0, 3] == target[0, 7]  # the tie
    g = write_dump(tmp_path / "g", {0: [("logits", "output", "0", "logits", None, gold)]})
    t = write_dump(tmp_path / "t", {0: [("logits", "output", "0", "logits", None, target)]})
    res = compare_dumps(reader(g), reader(t), tmp_path / "out", CompareOptions(xlsx=False))
    row = next(csv.DictReader(open(res["csv"]["logits"])))
    assert (row["golden_top1"], row["target_top1"], row["top1_match"]) == ("3", "3", "True")
    assert res["summary"].logits.first_token_mismatch_step is None
