"""A fault every decoder layer shares (a kernel, scale or weight conversion each layer's copy uses)
is a fault, not rounding: no layer stands out from the others, but the module type's own error is
past what the target dtype's rounding gives a whole tensor and far above the typical module's.
Families x fault kinds through the bisect, the CLI the user's way, and the wording of a shared
error that stays under the fail limit (inconclusive, never "rounding")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from bisect_helpers import bisect_dumps, golden_maker, make_dumps  # noqa: E402
from example_faults import faulty_module  # noqa: E402

from llmflow.localize.conclude import StepReplay, shared_error  # noqa: E402
from llmflow.models import load_model  # noqa: E402
from llmflow.structure import module_type  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SIZE = "layers=4,hidden=64,intermediate=128,seed=3"
FAULTS = ["scale_down_proj", "wrong_act", "scale_attn_out"]


def spec(family: str) -> str:
    return f"tiny-{family}:{SIZE}"


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return golden_maker(tmp_path_factory, spec)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_a_fault_in_every_layer_is_named_by_its_module_type(family, fault, goldens, tmp_path):
    patch = f"plugins/example_faults.py:{fault}_every_layer"
    v = bisect_dumps(make_dumps(tmp_path, spec(family), patch=patch, golden_dir=goldens(family)),
                     estimate_cost=False)
    first = faulty_module(load_model(spec(family)).model, fault, 0)
    assert v["status"] == "fail", v["headline"]
    assert v["first_bad_module"] == first, v["headline"]
    assert v["first_bad_layer"] and first.startswith(v["first_bad_layer"] + ".")
    assert v["headline"].startswith(f"{module_type(first)} is the fault in every layer"), v["headline"]
    assert v["first_bad_op"] is None  # no op bisection was run for it: none is named


def test_the_cli_fails_a_fault_every_layer_shares(tmp_path):
    """The user's way: ``llmflow run llama2_bisect`` with the patch, exit 1 and the FAILED line."""
    model = spec("qwen2")
    run_dir = tmp_path / "runs" / "every"
    cmd = [sys.executable, "-m", "llmflow", "run", "llama2_bisect", "--run-dir", str(run_dir),
           "--progress", "plain", "--set", f"golden_model={model}", "--set", f"target_model={model}",
           "--set", "max_new_tokens=4", "--set",
           f"target_patch={REPO / 'plugins' / 'example_faults.py'}:scale_down_proj_every_layer"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED: model.layers.*.mlp.down_proj is the fault in every layer"), last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"]["status"] == "fail"
    assert summary["verdict"]["first_bad_module"] == "model.layers.0.mlp.down_proj"


def _step(errors: dict[str, float]) -> StepReplay:
    rows = [{"name": n, "rel_l2": e, "replayable": True} for n, e in errors.items()]
    return StepReplay(step=0, why="test", rows=rows)


def _layers(n: int, **per_type: float) -> dict[str, float]:
    return {f"model.layers.{i}.{t}": e for i in range(n) for t, e in per_type.items()}


def test_a_shared_error_names_the_innermost_module_type_and_judges_it_by_the_dtype():
    rounding = dict(q_proj=0.003, k_proj=0.003, mlp=0.005, act_fn=0.002, input_layernorm=0.001)
    errors = _layers(4, self_attn=0.21, **rounding) | _layers(4, **{"self_attn.o_proj": 0.2})
    found = shared_error(_step(errors), None, "bfloat16")
    assert found and found.fails and found.module_type == "model.layers.*.self_attn.o_proj"
    assert found.example == "model.layers.0.self_attn.o_proj" and found.layers == 4
    # one layer spared: the faulty copies alone are counted and the first of them is named
    spared = {f"model.layers.{i}.o_proj": 0.003 if i == 0 else 0.5 for i in range(4)}
    errors = _layers(4, **rounding) | spared
    found = shared_error(_step(errors), None, "bfloat16")
    assert found and found.fails and found.example == "model.layers.1.o_proj"
    assert found.faulty == [f"model.layers.{i}.o_proj" for i in (1, 2, 3)] and found.error == 0.5
    assert found.where().startswith("in 3 of 4 layers (model.layers.1.o_proj, ")
    # under the fail limit but past the warn limit: reported, never a fault
    found = shared_error(_step(_layers(4, o_proj=0.1, **rounding)), None, "bfloat16")
    assert found and not found.fails and found.limit == "warn"
    # the same error is rounding-sized for a looser dtype class, and nothing at all stands out here
    assert shared_error(_step(_layers(4, o_proj=0.1, **rounding)), None, "int4") is None
    assert shared_error(_step(_layers(4, **rounding)), None, "bfloat16") is None
    # every type beyond rounding alike (a golden model that is not the dump's own): never a fault
    found = shared_error(_step(_layers(4, q_proj=0.8, k_proj=0.7, mlp=0.9)), None, "bfloat16")
    assert found and not found.fails and found.typical is None
    # the decoder layers alone (a dump of the layers): too few types to say
    found = shared_error(_step({f"model.layers.{i}": 0.8 for i in range(4)}), None, "bfloat16")
    assert found and not found.fails


def test_what_the_attentions_write_to_their_kv_caches_is_judged_by_one_ops_rounding():
    """A cache write carries its projections' rounding in a correct port (~1.3x the typical module
    type's): a cache kept in fp8 in every layer (~9x) is a fault well under the whole-tensor limits."""
    rounding = dict(q_proj=0.003, k_proj=0.003, mlp=0.005, act_fn=0.002, input_layernorm=0.002)

    def with_cache(write: float) -> StepReplay:
        step = _step(_layers(4, **rounding, self_attn=0.006))
        for r in step.rows:
            if r["name"].endswith(".self_attn"):
                r["kv_cache_rel_l2"] = write
        return step

    found = shared_error(with_cache(0.026), None, "bfloat16")
    assert found and found.fails and found.kv_cache, found
    assert found.module_type == "model.layers.*.self_attn" and found.example == "model.layers.0.self_attn"
    assert "rounding of one bfloat16 op (0.016)" in found.limit_words("bfloat16")
    assert shared_error(with_cache(0.004), None, "bfloat16") is None  # its projections' rounding
    # past 4x the typical module type's but not 4x one op's rounding: not a cache fault
    assert shared_error(with_cache(0.014), None, "bfloat16") is None
