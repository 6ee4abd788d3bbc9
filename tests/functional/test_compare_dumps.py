"""compare_dumps end to end on synthetic llmflow dumps: verdicts, executors, algorithms, safety."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import openpyxl
import pytest
import torch

from llmflow.compare import engine
from llmflow.compare.run import CompareOptions, compare_dumps
from llmflow.results.compare import MissingStep

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import as_dump, model_items, reader, write_dump  # noqa: E402
from xlsx_rules import coloured_cells  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "plugins" / "example_algorithm.py")


def rows(path: str | Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def scale_layer(bad: int, factor: float = 1.5):
    return lambda i, x: x * factor if i == bad else x


def test_bf16_target_passes_and_a_fault_is_the_first_failing_layer(tmp_path: Path) -> None:
    g = as_dump(tmp_path, "golden")
    ok = as_dump(tmp_path, "bf16", dtype=torch.bfloat16)
    res = compare_dumps(reader(g), reader(ok), tmp_path / "ok", CompareOptions(target_dtype="bfloat16"))
    s = res["summary"]
    assert s.verdict == "pass" and s.counts["fail"] == 0 and s.counts["pass"] == s.pairs == 28
    assert set(res["csv"]) == {"logits", "layer", "module"}
    assert s.logits.first_token_mismatch_step is None and s.logits.top1_agreement == 1.0

    bad = as_dump(tmp_path, "bad", dtype=torch.bfloat16, fault=scale_layer(2))
    res = compare_dumps(reader(g), reader(bad), tmp_path / "bad", CompareOptions(target_dtype="bfloat16"))
    layer = rows(res["csv"]["layer"])
    assert [r["verdict"] for r in layer if r["step"] == "0"] == ["pass", "pass", "fail", "fail"]
    first = res["summary"].levels["layer"].first_fail
    assert (first.name, first.step) == ("model.layers.2", 0)
    summary = json.loads(Path(res["summary_file"]).read_text())
    assert (
        summary["verdict"] == "fail" and summary["levels"]["layer"]["first_fail"]["name"] == "model.layers.2"
    )
    # the xlsx opens on the summary, then one sheet per level; in a failing row the rules colour
    # the metric that tripped and the verdict red, the rest not; numbers are numbers
    wb = openpyxl.load_workbook(res["xlsx"])
    assert wb.sheetnames == ["summary", "logits", "layer", "module"]
    ws = wb["layer"]
    header = [c.value for c in ws[1]]
    col = {name: i for i, name in enumerate(header)}
    assert ws.freeze_panes == f"{openpyxl.utils.get_column_letter(col['name'] + 2)}2"
    fails = [r for r in ws.iter_rows(min_row=2) if r[col["verdict"]].value == "fail"]
    assert fails
    coloured = coloured_cells(ws)
    red = {header[i] for i, c in enumerate(fails[0]) if coloured.get(c.coordinate) == "fail"}
    tripped = {item.partition("=")[0] for item in fails[0][col["tripped"]].value.split(",")}
    # a scaled layer keeps its direction (cosine 1): the distance trips
    assert red == tripped | {"verdict"} and "relative_euclidean_distance" in tripped
    assert fails[0][col["code"]].value == "threshold_fail"
    reason = fails[0][col["reason"]].value
    assert reason.startswith("relative_euclidean_distance 0.") and "> fail 0.2 (bfloat16)" in reason
    for name in ("index", "step", "order", "numel"):
        assert isinstance(fails[0][col[name]].value, int), name
    # the summary sheet: the verdict, the headline, per level its counts and first failing row
    ws = wb["summary"]
    values = list(ws.iter_rows(values_only=True))
    head = values.index(tuple(c.value for c in ws[len(values) - 3]))  # the header: 3 levels below it
    notes = {r[0]: r[1] for r in values[:head - 1]}
    assert values[head - 1] == (None,) * len(values[0])  # a blank line between notes and table
    assert notes["verdict"] == "fail" and notes["headline"] == summary["outcome"]["headline"]
    table = values[head:]
    levels = {r[0]: dict(zip(table[0], r, strict=True)) for r in table[1:]}
    assert list(levels) == ["logits", "layer", "module"]
    layer = levels["layer"]
    counts = summary["levels"]["layer"]["counts"]
    assert (layer["pass"], layer["fail"], layer["verdict"]) == (counts["pass"], counts["fail"], "fail")
    assert (layer["first_fail_name"], layer["first_fail_step"]) == ("model.layers.2", 0)
    head += 1  # (counted from 1)
    fail_col = openpyxl.utils.get_column_letter(table[0].index("fail") + 1)
    assert coloured_cells(ws)[f"{fail_col}{head + 2}"] == "fail" and ws.freeze_panes == f"B{head + 1}"


def test_pool_and_dask_give_the_same_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g, t = as_dump(tmp_path, "g"), as_dump(tmp_path, "t", noise=1e-3)
    base = compare_dumps(reader(g), reader(t), tmp_path / "inline", CompareOptions(workers=1, xlsx=False))
    monkeypatch.setattr(engine, "POOL_START_SECONDS", 0.0)
    monkeypatch.setattr(engine, "CHUNK_PAIRS", 5)
    pool = compare_dumps(reader(g), reader(t), tmp_path / "pool", CompareOptions(workers=2, xlsx=False))
    from dask.distributed import Client, LocalCluster

    with LocalCluster(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            dask = compare_dumps(
                reader(g),
                reader(t),
                tmp_path / "dask",
                CompareOptions(executor="dask", client=client, xlsx=False),
            )
    for level in base["csv"]:
        ref = Path(base["csv"][level]).read_text()
        assert Path(pool["csv"][level]).read_text() == ref
        assert Path(dask["csv"][level]).read_text() == ref


def test_custom_algorithms_and_one_that_raises(tmp_path: Path) -> None:
    boom = tmp_path / "boom.py"
    boom.write_text("def boom(golden, target):\n    raise ValueError('no luck')\n")
    g, t = as_dump(tmp_path, "g", steps=[0]), as_dump(tmp_path, "t", steps=[0], noise=1e-3)
    res = compare_dumps(
        reader(g),
        reader(t),
        tmp_path / "out",
        CompareOptions(algorithms=[f"{EXAMPLE}:sign_flip_ratio", "boom.py:boom"], base_dir=str(tmp_path)),
    )
    for level, path in res["csv"].items():
        got = rows(path)
        assert {"sign_flip_ratio", "sign_flip_ratio_message", "boom", "boom_message"} <= set(got[0]), level
        for r in got:
            assert float(r["sign_flip_ratio"]) == 0.0
            assert r["boom_message"] == "error: ValueError: no luck" and r["verdict"] != "fail"
    wb = openpyxl.load_workbook(res["xlsx"], read_only=True)
    header = [c.value for c in next(wb["module"].iter_rows(max_row=1))]
    assert "sign_flip_ratio" in header and "boom_message" in header


def test_names_that_would_be_formulas(tmp_path: Path) -> None:
    evil = '=HYPERLINK("http://evil","x")'
    items = [
        (evil, "output", "0", "module", "@Evil", torch.ones(3)),
        ("+cmd", "output", "0", "module", None, torch.ones(3)),
    ]
    g = write_dump(tmp_path / "g", {0: items})
    t = write_dump(tmp_path / "t", {0: [(n, k, i, lv, mt, x * 2) for n, k, i, lv, mt, x in items]})
    res = compare_dumps(reader(g), reader(t), tmp_path / "out")
    got = rows(res["csv"]["module"])
    assert [r["name"] for r in got] == ["'" + evil, "'+cmd"] and got[0]["module_type"] == "'@Evil"
    assert [r["verdict"] for r in got] == ["fail", "fail"]
    ws = openpyxl.load_workbook(res["xlsx"])["module"]
    for row in ws.iter_rows():
        for c in row:
            assert c.data_type != "f"
            # the xlsx holds the name itself, as text with the quote prefix Excel never evaluates
            if isinstance(c.value, str) and c.value.startswith(("=", "+", "-", "@")):
                assert c.data_type == "s" and c.quotePrefix
    names = [ws.cell(r, 1 + [c.value for c in ws[1]].index("name")).value for r in (2, 3)]
    assert names == [evil, "+cmd"]


def test_unmatched_and_missing_steps_are_reported(tmp_path: Path) -> None:
    g = as_dump(tmp_path, "g", steps=[0, 1, 2])
    items = [it for it in model_items(seed=0) if it[0] != "model.layers.1.mlp"]
    items.append(("model.extra", "output", "0", "module", "Extra", torch.ones(2)))
    t = write_dump(tmp_path / "t", {0: items, 1: model_items(seed=1)})
    res = compare_dumps(reader(g), reader(t), tmp_path / "out")
    s = res["summary"]
    assert s.missing_steps == [MissingStep(side="target", golden_step=2, target_step=2)]
    module = s.levels["module"]
    assert module.unmatched_golden == 1 and module.unmatched_target == 1
    reasons = {
        (r["name"] or r["target_name"], r["reason"])
        for r in rows(res["csv"]["module"])
        if r["verdict"] == "unmatched"
    }
    assert reasons == {("model.layers.1.mlp", "unmatched golden"), ("model.extra", "unmatched target")}


def test_atb_named_target_through_the_mapping(tmp_path: Path) -> None:
    hf = model_items(n_layers=3, logits=False)
    rename = {"model.embed_tokens": "0_WordEmbedding"}
    for i in range(3):
        rename |= {
            f"model.layers.{i}": f"{i + 1}_DecoderLayer",
            f"model.layers.{i}.self_attn": f"{i + 1}_DecoderLayer.0_SelfAttention",
            f"model.layers.{i}.mlp": f"{i + 1}_DecoderLayer.1_Mlp",
        }
    g = write_dump(tmp_path / "hf", {0: hf, 1: hf})
    # ATB: the first folder holds prefill + first decode, so its folders are one fewer
    t = write_dump(
        tmp_path / "atb", {0: [(rename[n], k, i, lv, None, x.bfloat16()) for n, k, i, lv, _, x in hf]}
    )
    from llmflow.compare.align import align_dumps

    pairs = align_dumps(reader(g), reader(t), prefill_offset=1)["pairs"]
    assert pairs == [{"golden_step": 0, "target_step": 0}, {"golden_step": 1, "target_step": 0}]
    res = compare_dumps(
        reader(g),
        reader(t),
        tmp_path / "out",
        CompareOptions(pairs=pairs, mapping="atb-llama", levels=["layer"]),
    )
    got = rows(res["csv"]["layer"])
    assert [(r["name"], r["target_name"], r["match"]) for r in got[:3]] == [
        ("model.layers.0", "1_DecoderLayer", "mapping"),
        ("model.layers.1", "2_DecoderLayer", "mapping"),
        ("model.layers.2", "3_DecoderLayer", "mapping"),
    ]
    assert all(r["verdict"] == "pass" for r in got) and len(got) == 6


def test_statistics_only_dumps(tmp_path: Path) -> None:
    g = write_dump(tmp_path / "g", {0: model_items(logits=False)}, data_mode="statistics")
    t = write_dump(
        tmp_path / "t", {0: model_items(logits=False, fault=scale_layer(3, 2.0))}, data_mode="statistics"
    )
    res = compare_dumps(reader(g), reader(t), tmp_path / "out", CompareOptions(levels=["layer"]))
    got = rows(res["csv"]["layer"])
    assert "norm_rel_diff" in got[0] and "cosine_similarity" in got[0]
    assert [r["verdict"] for r in got] == ["pass", "pass", "pass", "fail"]
    # -st on full dumps: statistics computed from the tensors
    g2, t2 = as_dump(tmp_path, "g2", steps=[0]), as_dump(tmp_path, "t2", steps=[0], fault=scale_layer(3, 2.0))
    res = compare_dumps(
        reader(g2), reader(t2), tmp_path / "out2", CompareOptions(levels=["layer"], stats_only=True)
    )
    got = rows(res["csv"]["layer"])
    assert "cosine_similarity" not in got[0]
    assert [r["verdict"] for r in got] == ["pass", "pass", "pass", "fail"]


MEMORY_PROBE = r"""
import sys, threading, time
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from llmflow.compare.run import CompareOptions, compare_dumps
from llmflow.results.compare import MissingStep
from llmflow.formats.llmflow_dump import LlmflowDumpReader

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0

peak = [anon_kb()]
base = peak[0]
stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], anon_kb())
        time.sleep(0.005)
th = threading.Thread(target=sample, daemon=True)
th.start()
res = compare_dumps(LlmflowDumpReader(sys.argv[1]), LlmflowDumpReader(sys.argv[2]),
                    Path(sys.argv[1]).parent / "out", CompareOptions(workers=1, xlsx=False))
stop = True
th.join()
print(res["summary"].pairs, res["summary"].bytes, (peak[0] - base) // 1024)
"""


def test_thousand_pairs_in_bounded_memory(tmp_path: Path) -> None:
    n_steps, per_step, numel = 10, 100, 32 * 1024  # 1,000 pairs, 128 KiB per tensor, 256 MiB in all
    for side, scale in (("g", 1.0), ("t", 1.0001)):
        steps = {}
        for s in range(n_steps):
            gen = torch.Generator().manual_seed(s)
            steps[s] = [
                (
                    f"model.layers.{i}.mlp",
                    "output",
                    "0",
                    "module",
                    "LlamaMLP",
                    torch.randn(numel, generator=gen) * scale,
                )
                for i in range(per_step)
            ]
        write_dump(tmp_path / side, steps)
        del steps
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "g"), str(tmp_path / "t"), str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    pairs, nbytes, peak_mb = (int(x) for x in out.stdout.split())
    assert pairs == 1000 and nbytes == 1000 * 2 * numel * 4
    assert peak_mb < 64, f"compare of {nbytes >> 20} MiB grew the heap by {peak_mb} MiB"
