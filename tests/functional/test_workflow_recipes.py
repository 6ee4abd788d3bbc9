"""The recipes end to end through the workflow engine, on a tiny Llama (fast)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from llmflow.workflow.runner import run_workflow

REPO = Path(__file__).resolve().parents[2]
TINY = "tiny-llama:layers=4,seed=1"


def _summary(run_dir: Path) -> dict:
    """summary.json, checked against its published schema (what other tools rely on)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    schema = json.loads((Path(__file__).resolve().parents[2] / "schemas" / "summary.schema.json").read_text())
    jsonschema.validate(summary, schema)
    return summary


def test_llama2_bisect_names_an_injected_fault(tmp_path):
    sets = [f"golden_model={TINY}", f"target_model={TINY}", "max_new_tokens=6",
            "target_patch=../plugins/example_faults.py:wrong_act_layer_2"]
    run_workflow(REPO / "workflows" / "llama2_bisect.yaml", set_params=sets, run_dir=tmp_path / "run")
    s = _summary(tmp_path / "run")
    assert all(v["status"] == "done" for v in s["stages"].values()), s["stages"]
    assert s["status"] == "failed" and s["outcome"]["status"] == "fail"  # the fault found
    v = s["verdict"]
    assert v["first_bad_layer"] == "model.layers.2"
    assert v["first_bad_module"] == "model.layers.2.mlp.act_fn"
    assert v["first_bad_op"] == "model.layers.2.mlp.act_fn/relu.0"
    assert set(v["texts"]) == {"golden", "target"} and v["cost"]["bytes_dumped"] > 0
    html = Path(s["report"]["html"]).read_text()
    assert "model.layers.2.mlp.act_fn" in html and "<svg" in html and "compare:" in html
    verdict = json.loads((tmp_path / "run" / "bisect" / "verdict.json").read_text())
    assert verdict["candidates"][0]["name"].startswith("model.layers.2.mlp")


def test_compare_dumps_recipe_on_existing_dumps(tmp_path):
    sets = [f"golden_model={TINY}", f"target_model={TINY}", "max_new_tokens=3"]
    run_workflow(REPO / "workflows" / "llama2_bisect.yaml", set_params=sets, run_dir=tmp_path / "bisect",
                 only=["seed", "dump-golden", "dump-npu"])
    g, t = tmp_path / "bisect" / "dump-golden" / "dump", tmp_path / "bisect" / "dump-npu" / "dump"
    run_workflow(REPO / "workflows" / "compare_dumps.yaml",
                 set_params=[f"golden_dump={g}", f"target_dump={t}"], run_dir=tmp_path / "cmp")
    s = _summary(tmp_path / "cmp")
    assert s["status"] == "passed", {k: v.get("error") for k, v in s["stages"].items()}
    html = Path(s["report"]["html"]).read_text()
    assert "compare:" in html and "<table" in html


def test_badcase_bisect_bisects_the_worst_prompt(tmp_path):
    """badcase ranks the prompts; both dumps then run on the worst one and the bisect finds the fault."""
    sets = [f"golden_model={TINY}", f"target_model={TINY}", "max_new_tokens=4", "badcase_tokens=4",
            "target_patch=../plugins/example_faults.py:wrong_act_layer_2",
            "prompts=[a short one, a somewhat longer prompt with more words in it]"]
    run_workflow(REPO / "workflows" / "badcase_bisect.yaml", set_params=sets, run_dir=tmp_path / "run")
    s = _summary(tmp_path / "run")
    assert all(v["status"] == "done" for v in s["stages"].values()), s["stages"]
    assert s["status"] == "failed" and s["outcome"]["status"] == "fail"  # the fault found
    ranking = json.loads((tmp_path / "run" / "badcase" / "ranking.json").read_text())
    worst = ranking[0]["prompt"]
    assert ranking[0]["max_kl"] >= ranking[1]["max_kl"]
    generation = json.loads(Path(s["stages"]["dump-golden"]["outputs"]["generation_file"]).read_text())
    assert generation["prompt"] == worst
    assert s["verdict"]["first_bad_module"] == "model.layers.2.mlp.act_fn"


def test_compare_dumps_page_charts_the_first_failing_tensor_over_the_steps(tmp_path):
    """Dumps made elsewhere (here by the bisect recipe's dump stages, a fault in layer 2's
    activation), compared the user's way with ``llmflow run compare_dumps``: no verdict, so the
    page's panel shows the compare's first failing tensor, with its error at every step."""
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from bisect_helpers import find, parse_dom
    from workflow_helpers import llmflow

    sets = [f"golden_model={TINY}", f"target_model={TINY}", "max_new_tokens=3",
            "target_patch=../plugins/example_faults.py:wrong_act_layer_2"]
    run_workflow(REPO / "workflows" / "llama2_bisect.yaml", set_params=sets, run_dir=tmp_path / "bisect",
                 only=["seed", "dump-golden", "dump-npu"])
    g, t = tmp_path / "bisect" / "dump-golden" / "dump", tmp_path / "bisect" / "dump-npu" / "dump"
    proc = llmflow("run", "compare_dumps", "--run-dir", str(tmp_path / "cmp"), "--set", f"golden_dump={g}",
                   "--set", f"target_dump={t}")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    dom = parse_dom((tmp_path / "cmp" / "report" / "report.html").read_text(encoding="utf-8"))
    (heading,) = [h for h in find(dom, "h2") if h.within("section", id="op-panel")]
    assert heading.text == "The first failing tensor in detail"
    (name,) = [c.text for c in find(dom, "code", "opname") if c.within("section", id="op-panel")]
    assert name.startswith("model.layers.2"), name
    (chart,) = [f for f in find(dom, "figure") if f.within("section", id="op-panel")
                and f.text.startswith(f"raw error of {name}'s output per step")]
    steps = {b.text.split(":")[0] for b in find(dom, "title") if b.within("section", id="op-panel")
             and b.text.startswith("step ")}
    assert len(steps) >= 3, (chart.text, steps)  # the prompt's step and the decode steps
