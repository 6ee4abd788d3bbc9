"""A tensor-parallel target dumped by msprobe itself (mindstudio-probe's PrecisionDebugger on a
Megatron-style TP=2 tiny Llama under torchrun over gloo: ``step{N}/rank{R}`` folders as msprobe
writes them) against its one-process golden (``step{N}/proc{pid}``): the ranks' shards join into
the golden's tensors, a clean port passes with every tensor paired, a fault in rank 1's shard
of a column-parallel linear is named with its module and rank (by the compare, and by the
dump_bisect workflow's golden modules on the target's recorded inputs), the workflows' pages
show that module's output joined from the two ranks as the compare joined it, a fault in rank 1's
shard of a row-parallel linear (its output one sum on both ranks) is named with its rank from the
parameters msprobe dumps, and a row-parallel linear that skips its all-reduce is named at the
module whose ranks keep their partial products."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

pytest.importorskip("msprobe.pytorch", reason="mindstudio-probe is not installed (optional: "
                                              "pip install mindstudio-probe)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import find, parse_dom  # noqa: E402
from workflow_helpers import REPO, llmflow  # noqa: E402

SCRIPT = REPO / "tests" / "fixtures" / "tp_llama.py"
FAULT = "1:model.layers.1.mlp.up_proj.weight:1.5"
ROW_FAULT = "1:model.layers.0.mlp.down_proj.weight:1.5"  # row-parallel: all-reduced inside the linear


def _launch(out: Path, runs: list[str], nproc: int) -> None:
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [str(SCRIPT), str(out), *runs, "--tool", "msprobe"]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    launcher = launcher if nproc > 1 else []
    cmd = [sys.executable, *launcher, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp_msprobe")
    _launch(out, ["golden"], 1)
    _launch(out, ["clean", f"bad={FAULT}", "noreduce=noreduce:model.layers.1.self_attn.o_proj",
                  f"rowbad={ROW_FAULT}"], 2)
    return out


def test_msprobe_writes_rank_folders_and_a_clean_port_passes_with_every_tensor_paired(tmp_path, dumps):
    assert sorted(p.name for p in (dumps / "clean" / "step0").iterdir()) == ["rank0", "rank1"]
    proc = llmflow("compare", "-gp", str(dumps / "golden"), "-mp", str(dumps / "clean"), "-o",
                   str(tmp_path / "out"), "--no-xlsx")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED"), proc.stdout
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    joined = summary["matching"]["tensor_parallel"]
    assert joined["ranks"] == 2 and joined["joined"]["concat"] > 0 and joined["joined"]["replicated"] > 0
    assert summary["counts"]["unmatched"] == summary["counts"]["fail"] == 0 and summary["counts"]["pass"] > 0


def test_a_faulty_msprobe_shard_names_its_module_and_rank(tmp_path, dumps):
    proc = llmflow("compare", "-gp", str(dumps / "golden"), "-mp", str(dumps / "bad"), "-o",
                   str(tmp_path / "out"), "--no-xlsx")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("FAILED"), proc.stdout
    assert "model.layers.1.mlp.up_proj" in last
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    first = summary["levels"]["module"]["first_fail"]
    assert first["name"] == "model.layers.1.mlp.up_proj" and first["step"] == 0
    assert "rank 1's shard stands out" in first["reason"]


@pytest.fixture(scope="module")
def workflow_run(tmp_path_factory, dumps) -> Path:
    """The compare_dumps workflow on the faulty target: its run directory."""
    run_dir = tmp_path_factory.mktemp("compare_dumps") / "run"
    proc = llmflow("run", "compare_dumps", "--run-dir", str(run_dir),
                   "--set", f"golden_dump={dumps / 'golden'}", "--set", f"target_dump={dumps / 'bad'}")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "first: model.layers.1.mlp.up_proj" in proc.stdout.strip().splitlines()[-1]
    return run_dir


def test_the_compare_workflows_page_shows_the_first_failing_tensor_joined_from_the_ranks(workflow_run):
    dom = parse_dom((workflow_run / "report" / "report.html").read_text(encoding="utf-8"))
    (panel,) = find(dom, "section", id="op-panel")
    (heading,) = [h for h in find(dom, "h2") if h.within("section", id="op-panel")]
    assert heading.text == "The first failing tensor in detail"
    (name,) = [c for c in find(dom, "code", "opname") if c.within("section", id="op-panel")]
    assert name.text == "model.layers.1.mlp.up_proj"
    assert "the first failing compare row" in panel.text and "2 ranks joined" in panel.text
    assert "concat" in panel.text
    commands = [b.attrs["data-copy"] for b in find(dom, "button", "copy")
                if b.within("section", id="op-panel")]
    assert [c.split()[-1].split("/")[1] for c in commands[1:]] == ["rank0", "rank1"], commands


def test_inspect_shows_each_rank_of_a_joined_rows_locator_and_refuses_a_wrong_one(workflow_run, dumps):
    import csv

    with open(workflow_run / "compare" / "compare_module.csv", newline="", encoding="utf-8") as fh:
        row = next(r for r in csv.DictReader(fh) if r["name"] == "model.layers.1.mlp.up_proj"
                   and r["kind"] == "output")
    proc = llmflow("inspect", str(dumps / "bad"), row["target_data_path"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "part 1 of 2" in proc.stdout and "part 2 of 2" in proc.stdout
    assert "(step 0, rank 0," in proc.stdout and "(step 0, rank 1," in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED (2 tensors a compare row joins")
    wrong = row["target_data_path"].replace("rank1", "rank7")
    proc = llmflow("inspect", str(dumps / "bad"), wrong)
    assert proc.returncode == 2 and proc.stdout.strip().splitlines()[-1].startswith("FAILED")
    assert "rank7" in proc.stderr and "Traceback" not in proc.stderr


def _dump_bisect(run_dir: Path, dumps: Path, target: str) -> str:
    """``llmflow run dump_bisect`` on msprobe's golden and ``target`` dumps, which must fail (exit 1):
    its last line."""
    proc = llmflow("run", "dump_bisect", "--run-dir", str(run_dir),
                   "--set", f"golden_dump={dumps / 'golden'}", "--set", f"target_dump={dumps / target}",
                   "--set", f"golden_model={SCRIPT}:golden_model")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_dump_bisect_workflow_names_the_module_and_rank_of_msprobes_rank_folders(tmp_path, dumps):
    """The bisect without a target model, on msprobe's own rank folders: each golden module replayed
    on the target's recorded inputs names the column-parallel linear and the rank whose shard is
    wrong; the page's panel shows that module's output joined from both ranks."""
    run_dir = tmp_path / "run"
    last = _dump_bisect(run_dir, dumps, "bad")
    assert last.startswith("FAILED: model.layers.1.mlp.up_proj (rank 1's shard) is the fault"), last
    verdict = json.loads((run_dir / "bisect" / "verdict.json").read_text())
    assert verdict["isolation"] == "target_dump" and verdict["first_bad_rank"] == 1
    dom = parse_dom((run_dir / "report" / "report.html").read_text(encoding="utf-8"))
    (heading,) = [h for h in find(dom, "h2") if h.within("section", id="op-panel")]
    assert heading.text == "The chosen module's output in detail"
    (panel,) = find(dom, "section", id="op-panel")
    assert "model.layers.1.mlp.up_proj" in panel.text and "2 ranks joined" in panel.text


def test_the_dump_bisect_workflow_names_a_row_parallel_shards_rank_from_msprobes_parameters(tmp_path, dumps):
    """Rank 1's shard of a row-parallel down_proj is wrong and the linear all-reduces inside itself:
    its output is the same sum on both ranks, but msprobe dumps each module's parameters, and each
    rank's weight shard against its columns of the golden weight names rank 1."""
    run_dir = tmp_path / "run"
    last = _dump_bisect(run_dir, dumps, "rowbad")
    assert last.startswith("FAILED: model.layers.0.mlp.down_proj (rank 1's shard) is the fault"), last
    verdict = json.loads((run_dir / "bisect" / "verdict.json").read_text())
    assert verdict["first_bad_rank"] == 1
    assert "rank 1's shard differs from its slice of the golden's weight" in verdict["diagnosis"]


def test_the_dump_bisect_workflow_names_a_missing_all_reduce_in_msprobes_rank_folders(tmp_path, dumps):
    """layer 1's o_proj leaves its partial products unreduced on both ranks: the attention around it
    is named with the missing all-reduce, not the later modules that see another input per rank."""
    run_dir = tmp_path / "run"
    last = _dump_bisect(run_dir, dumps, "noreduce")
    assert last.startswith("FAILED: model.layers.1.self_attn is the fault: the all-reduce of its output is "
                           "missing"), last
    verdict = json.loads((run_dir / "bisect" / "verdict.json").read_text())
    assert verdict["first_bad_rank"] is None and verdict["first_bad_layer"] == "model.layers.1"
