"""The bisect from the target's dump (isolate: target_dump): no target model is loaded, each
module's own error is its recorded output against the golden module run on its recorded inputs.

A tensor-parallel target (a Megatron-style TP=2 tiny Llama over gloo, dumped by the user's own
torchrun script) is bisected with workflows/dump_bisect.yaml: a column-parallel fault names its
module and rank, a row-parallel one its module and no rank, a clean port passes. A one-rank dump
of another family (qwen2) is bisected the same way, and a dump without module inputs is
inconclusive with what to dump next."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from llmflow.errors import UserError
from llmflow.localize.bisect import isolation_mode, run_bisect
from llmflow.localize.options import BisectInputs
from llmflow.results.codec import from_json, to_json
from llmflow.results.verdict import Verdict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import find, parse_dom  # noqa: E402
from tp_helpers import TP_FAULTS, TP_GOLDEN_MODEL, launch_tp  # noqa: E402
from workflow_helpers import REPO, llmflow  # noqa: E402

WORKFLOW = REPO / "workflows" / "dump_bisect.yaml"
QWEN2 = "tiny-qwen2:layers=3,hidden=64,heads=4,kv_heads=2,intermediate=128"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """golden/ (one process), clean/ and each fault of TP_FAULTS (two ranks, one launch), in module
    mode with every module's inputs and outputs, and each rank's weight shards."""
    out = tmp_path_factory.mktemp("tp-bisect")
    launch_tp(out, ["golden"], 1)
    launch_tp(out, ["clean", *(f"{name}={spec}" for name, spec in TP_FAULTS.items())], 2,
              options=("--dump-weight",))
    return out


def _dump(dumps: Path, name: str) -> str:
    return str(dumps / name / "llmflow_dump")


def _run(tmp_path: Path, golden: str, target: str, model: str, *extra: str):
    run_dir = tmp_path / "run"
    proc = llmflow("run", str(WORKFLOW), "--run-dir", str(run_dir), "--set", f"golden_dump={golden}",
                   "--set", f"target_dump={target}", "--set", f"golden_model={model}", *extra, timeout=300)
    verdict = json.loads((run_dir / "bisect" / "verdict.json").read_text()) \
        if (run_dir / "bisect" / "verdict.json").is_file() else None
    return proc, verdict


def _bisect(dumps: Path, name: str, **kwargs) -> Verdict:
    inp = BisectInputs(golden_dump=_dump(dumps, "golden"), target_dump=_dump(dumps, name),
                       golden_spec={"model": TP_GOLDEN_MODEL}, **kwargs)
    return run_bisect(inp, log=lambda _m: None)


def test_a_column_parallel_fault_names_its_module_and_rank_through_the_workflow(tmp_path: Path,
                                                                                 dumps: Path) -> None:
    proc, verdict = _run(tmp_path, _dump(dumps, "golden"), _dump(dumps, "mlp_rank1"), TP_GOLDEN_MODEL)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith("FAILED") and "model.layers.1.mlp.up_proj (rank 1's shard)" in last, last
    assert verdict["status"] == "fail" and verdict["isolation"] == "target_dump"
    assert verdict["first_bad_module"] == "model.layers.1.mlp.up_proj" and verdict["first_bad_rank"] == 1
    top = verdict["candidates"][0]
    assert top["sharding"] == "inputs whole, output concat:2" and top["shard_rank"] == 1
    assert top["rank_errors"][0] < 1e-6 < 0.1 < top["rank_errors"][1]
    # no target model: the op level, the own error per step and the cost estimate say why they did not run
    assert set(verdict["skipped"]) == {"op_level", "own_error_steps", "cost_estimate"}
    assert all("target model" in why for why in verdict["skipped"].values())
    assert verdict["first_bad_op"] is None and verdict["cost"]["model_runs"]["models_loaded_by_bisect"] == 1
    assert to_json(from_json(Verdict, verdict)) == verdict
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["verdict"]["first_bad_rank"] == 1
    html = (tmp_path / "run" / "report" / "report.html").read_text(encoding="utf-8")
    assert "first bad rank" in html and "the golden modules on the target dump&#39;s recorded inputs" in html
    # the op panel shows the module's output as the compare joined it from the two ranks' shards
    dom = parse_dom(html)
    (panel,) = find(dom, "section", id="op-panel")
    assert "model.layers.1.mlp.up_proj" in panel.text and "2 ranks joined" in panel.text, panel.text
    commands = [b.attrs["data-copy"] for b in find(dom, "button", "copy")
                if b.within("section", id="op-panel")]
    assert len(commands) == 3 and all("llmflow inspect" in c for c in commands)
    assert [c.split()[-1].split("/")[0] for c in commands[1:]] == ["rank0", "rank1"], commands


def test_a_clean_tp_port_passes_through_the_workflow(tmp_path: Path, dumps: Path) -> None:
    proc, verdict = _run(tmp_path, _dump(dumps, "golden"), _dump(dumps, "clean"), TP_GOLDEN_MODEL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED")
    assert verdict["status"] == "pass" and verdict["first_bad_rank"] is None
    assert verdict["replay"]["not_replayable"] == 0 and verdict["replay"]["replayed"] > 30


def test_an_attention_projection_fault_names_rank_0(dumps: Path) -> None:
    verdict = _bisect(dumps, "attn_rank0")
    assert verdict.status == "fail" and verdict.first_bad_module == "model.layers.2.self_attn.k_proj"
    assert verdict.first_bad_rank == 0 and "rank 0's shard" in verdict.headline


def test_a_row_parallel_fault_reduced_inside_is_named_to_its_rank_by_the_weight_shards(dumps: Path) -> None:
    """down_proj all-reduces inside itself: its output is one sum on both ranks, but each rank's
    dumped weight shard against its columns of the golden weight names rank 1."""
    verdict = _bisect(dumps, "row_rank1")
    assert verdict.status == "fail" and verdict.first_bad_module == "model.layers.0.mlp.down_proj"
    assert verdict.first_bad_rank == 1, verdict.diagnosis
    chosen = next(c for c in verdict.candidates if c.name == "model.layers.0.mlp.down_proj")
    assert chosen.sharding == "inputs concat:2, output replicated" and chosen.rank_note is None
    assert chosen.rank_errors[0] < 1e-6 and abs(chosen.rank_errors[1] - 0.5) < 1e-5, chosen.rank_errors
    assert "its weight shards (weight) in the target dump" in verdict.diagnosis, verdict.diagnosis
    clean = next(c for c in _bisect(dumps, "clean").candidates if c.name == "model.layers.0.mlp.down_proj")
    assert clean.shard_rank is None and "match the golden's on every rank" in clean.rank_note


@pytest.mark.parametrize(("fault", "step"), [("no_reduce", 0), ("no_reduce_decode", 1)])
def test_a_missing_all_reduce_is_named_at_the_module_whose_ranks_keep_partial_products(
        dumps: Path, fault: str, step: int) -> None:
    """o_proj of layer 1 never all-reduces (or only at the decode steps, where each rank's attention
    reads its own KV cache): each rank's self_attn output is its partial product. The container is
    named with the all-reduce at the first step that has it; layer 2's modules, which see another
    input on each rank and stand out too, are not."""
    verdict = _bisect(dumps, fault)
    assert verdict.status == "fail", verdict.headline
    assert verdict.first_bad_module == "model.layers.1.self_attn", verdict.headline
    assert verdict.replay.step == step and verdict.first_bad_rank is None and verdict.first_bad_op is None
    assert "the all-reduce of its output is missing" in verdict.headline, verdict.headline
    assert "their sum matches the golden's" in verdict.headline
    o_proj = next(c for c in verdict.candidates if c.name == "model.layers.1.self_attn.o_proj")
    assert o_proj.error < 1e-5  # its partial products are right: summed, they are the golden's output
    assert o_proj.sharding.startswith("inputs concat:2, output sum")


def test_a_decode_step_replays_each_ranks_attention_over_the_steps_before(dumps: Path) -> None:
    """At a decode step the k_proj fault is still found; each rank's attention container reads its
    own KV cache: the golden attention runs on that rank's recorded inputs of steps 0..2 with a
    cache of its own. Its output is all-reduced (the same on both ranks), so no rank stands out
    there, and layer 2's holds its k_proj's error."""
    verdict = _bisect(dumps, "attn_rank0", replay_step=2)
    assert verdict.replay.step == 2 and verdict.status == "fail"
    assert verdict.first_bad_module == "model.layers.2.self_attn.k_proj" and verdict.first_bad_rank == 0
    assert verdict.replay.not_replayable == 0
    attention = {c.name: c for c in verdict.candidates if c.name.endswith("self_attn")}
    assert len(attention) == 3, [c.name for c in verdict.candidates]
    for c in attention.values():
        assert c.replayable and c.source == "target dump, steps 0..2", c
        assert c.sharding == "inputs whole, output replicated" and c.shard_rank is None
        assert len(c.rank_errors) == 2 and c.rank_errors[0] == c.rank_errors[1]
    layer_1, layer_2 = attention["model.layers.1.self_attn"], attention["model.layers.2.self_attn"]
    assert layer_2.error > 1e-3 > 1e-6 > layer_1.error


def test_a_streamed_golden_runs_its_modules_one_at_a_time(tmp_path: Path, dumps: Path) -> None:
    """A golden stored as a Hugging Face directory is streamed: each module called alone on the
    target's inputs reads its layer's weights then; the verdict is the whole golden's."""
    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    from tp_llama import golden_model

    golden_model().save_pretrained(tmp_path / "golden_hf")
    inp = BisectInputs(golden_dump=_dump(dumps, "golden"), target_dump=_dump(dumps, "mlp_rank1"),
                       golden_spec={"model": str(tmp_path / "golden_hf")}, golden_weights="streamed")
    verdict = run_bisect(inp, log=lambda _m: None)
    assert verdict.cost.model_runs.golden_weights == "streamed"
    assert verdict.first_bad_module == "model.layers.1.mlp.up_proj" and verdict.first_bad_rank == 1


def test_a_golden_dump_of_the_decoder_layers_only_still_joins_row_parallel_inputs(tmp_path: Path,
                                                                                  dumps: Path) -> None:
    """The recipe's golden dump holds the decoder layers' inputs and outputs only: a row-parallel
    linear's sliced inputs are joined by the golden linear's in_features."""
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.models import load_model
    from llmflow.structure import resolve_module_classes

    golden = load_model(TP_GOLDEN_MODEL)
    layers = resolve_module_classes(golden.model, ["auto"])
    dump_run(golden, [256, 104, 101, 108, 108, 111], 4,
             DumpConfig(dump_path=str(tmp_path / "layers"), token_range="all", module_list=layers))
    inp = BisectInputs(golden_dump=tmp_path / "layers", target_dump=_dump(dumps, "row_rank1"),
                       golden_spec={"model": TP_GOLDEN_MODEL})
    verdict = run_bisect(inp, log=lambda _m: None)
    assert verdict.first_bad_module == "model.layers.0.mlp.down_proj" and verdict.first_bad_rank == 1
    assert verdict.replay.not_replayable == 0


def test_a_module_missing_on_one_rank_is_not_replayed_from_the_other(dumps: Path) -> None:
    from llmflow.formats import open_dump
    from llmflow.localize.target_dump import replay_module
    from llmflow.models import load_model

    target = open_dump(_dump(dumps, "clean"))
    name = "model.layers.0.mlp.up_proj"
    rank0 = [e for e in target.entries() if e.name == name and e.step == 0 and e.rank == 0]
    golden = load_model(TP_GOLDEN_MODEL)
    module = golden.model.get_submodule(name)
    whole = replay_module(name, module, {0: rank0, 1: [e for e in target.entries()
                                                       if e.name == name and e.step == 0 and e.rank == 1]},
                          target, golden, 0, {}, [0, 1])
    assert whole["replayable"] and whole["sharding"] == "inputs whole, output concat:2"
    alone = replay_module(name, module, {0: rank0}, target, golden, 0, {}, [0, 1])
    assert not alone["replayable"] and alone["reason"] == "not recorded on rank(s) 1"


@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj", "model.layers.2.self_attn.o_proj"])
def test_the_rounding_check_of_a_row_parallel_linear_joins_its_sliced_inputs(dumps: Path, name: str,
                                                                             step: int) -> None:
    """A row-parallel linear's inputs are sliced over the ranks: its golden rounding in bf16 is
    measured on the inputs joined (each rank's shard), as its replay joins them."""
    from llmflow.formats import open_dump
    from llmflow.localize.own_error import own_error
    from llmflow.localize.rounding import cast_copy
    from llmflow.localize.target_dump import golden_input_shapes, module_entries, rounding_of
    from llmflow.models import load_model

    target = open_dump(_dump(dumps, "clean"))
    by_rank = module_entries(target, step)[name]
    assert sorted(by_rank) == [0, 1]
    shapes = golden_input_shapes(open_dump(_dump(dumps, "golden")), step)
    golden = load_model(TP_GOLDEN_MODEL)
    module = golden.model.get_submodule(name)
    row = rounding_of(name, module, by_rank, target, golden, step, shapes, torch.bfloat16)
    shards = [target.load(next(e for e in by_rank[r] if e.kind == "input" and e.index == "0"))
              for r in (0, 1)]
    assert shards[0].shape[-1] == module.in_features // 2  # each rank holds half the features
    joined = torch.cat(shards, dim=-1)
    with torch.no_grad():
        cast = cast_copy(module, golden.device, torch.bfloat16)
        expected = own_error(module(joined), cast(joined.bfloat16()))
    assert row is not None and row["replayable"] and row["rel_l2"] > 0
    assert row["rel_l2"] == pytest.approx(expected["rel_l2"], rel=1e-6)


def test_isolation_mode_choice_and_bad_values() -> None:
    class Ranks:
        def __init__(self, n: int):
            self.n = n

        def ranks(self) -> list[int]:
            return list(range(self.n))

    spec = {"model": "tiny-llama"}

    def inputs(**kw) -> BisectInputs:
        return BisectInputs(golden_dump="g", target_dump="t", golden_spec=spec, **kw)

    assert isolation_mode(inputs(target_spec=spec), Ranks(2)) == "target_dump"
    assert isolation_mode(inputs(target_spec=spec), Ranks(1)) == "target_model"
    assert isolation_mode(inputs(), Ranks(1)) == "target_dump"
    with pytest.raises(UserError, match="isolate: target_model needs the target model"):
        isolation_mode(inputs(isolate="target_model"), Ranks(1))
    with pytest.raises(UserError, match="isolate: 'both'"):
        isolation_mode(inputs(isolate="both"), Ranks(1))


@pytest.fixture(scope="module")
def qwen2_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-device qwen2 golden (fp32) and a bf16 target whose layer-1 gate_proj is scaled, both
    dumped in module mode with every module's inputs; and the same target without inputs."""
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.models import load_model

    out = tmp_path_factory.mktemp("qwen2-dumps")
    ids = [256, 104, 101, 108, 108, 111]
    dump_run(load_model(QWEN2), ids, 3, DumpConfig(dump_path=str(out / "golden"), token_range="all"))
    dump_run(load_model(QWEN2, dtype="bfloat16"), ids, 3, DumpConfig(dump_path=str(out / "clean"),
                                                                      token_range="all", logits=False))
    target = load_model(QWEN2, dtype="bfloat16")
    with torch.no_grad():
        target.model.get_parameter("model.layers.1.mlp.gate_proj.weight").mul_(1.5)
    dump_run(target, ids, 3, DumpConfig(dump_path=str(out / "target"), token_range="all"))
    dump_run(target, ids, 3, DumpConfig(dump_path=str(out / "outputs_only"), token_range="all",
                                        tensor_part=1))
    # what llama2_bisect's dump-npu stage writes: the decoder layers' outputs, nothing inside them
    dump_run(target, ids, 3, DumpConfig(dump_path=str(out / "layers_only"), token_range="all",
                                        module_list=["Qwen2DecoderLayer"], tensor_part=1))
    return out


def test_a_one_rank_dump_of_another_family_names_its_module(tmp_path: Path, qwen2_dumps: Path) -> None:
    proc, verdict = _run(tmp_path, str(qwen2_dumps / "golden"), str(qwen2_dumps / "target"), QWEN2)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert verdict["first_bad_module"] == "model.layers.1.mlp.gate_proj", verdict["headline"]
    assert verdict["first_bad_rank"] is None and verdict["candidates"][0]["sharding"] is None
    assert verdict["replay"]["dtype"] == "bfloat16"


def test_a_target_dump_without_module_inputs_is_inconclusive(tmp_path: Path, qwen2_dumps: Path) -> None:
    proc, verdict = _run(tmp_path, str(qwen2_dumps / "golden"), str(qwen2_dumps / "outputs_only"), QWEN2)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1].startswith("INCONCLUSIVE") and "no module inputs" in lines[-1]
    assert any(line.startswith("next:") and "tensor_part 2" in line for line in lines), lines[-4:]
    assert verdict["status"] == "inconclusive"


def test_a_target_dump_of_the_decoder_layers_only_is_inconclusive(tmp_path: Path, qwen2_dumps: Path) -> None:
    """A recipe's own target dump (the layers' outputs only) given to dump_bisect: nothing inside a
    layer to isolate, said so, with the layer outputs it did find."""
    proc, verdict = _run(tmp_path, str(qwen2_dumps / "golden"), str(qwen2_dumps / "layers_only"), QWEN2)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith("INCONCLUSIVE") and "modules inside the decoder layers" in last, last
    assert "only 3 other module(s)" in last and verdict["status"] == "inconclusive", last  # the 3 layers


def test_a_golden_model_that_cannot_load_is_refused_in_one_line(tmp_path: Path, dumps: Path) -> None:
    # a file that is not there: named before any stage runs
    proc, verdict = _run(tmp_path, _dump(dumps, "golden"), _dump(dumps, "clean"),
                         str(tmp_path / "missing.py") + ":golden_model")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert last.startswith("FAILED: param golden_model: no such file") and "missing.py" in last, last
    assert verdict is None
    # a file whose callable is not there: named before any stage runs too (the file read, not run)
    (tmp_path / "golden.py").write_text("def other():\n    return None\n")
    proc, verdict = _run(tmp_path, _dump(dumps, "golden"), _dump(dumps, "clean"),
                         str(tmp_path / "golden.py") + ":golden_model")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert last.startswith(f"FAILED: param golden_model: {tmp_path / 'golden.py'}:golden_model: golden.py "
                           "defines no 'golden_model' (its functions: other)"), last
    assert verdict is None


@pytest.mark.parametrize("other", ["tiny-qwen2:layers=3,hidden=64,heads=4,kv_heads=2,intermediate=128,seed=7",
                                   "tiny-mistral:layers=3,hidden=64,heads=4,kv_heads=2,intermediate=128"])
def test_a_golden_model_that_did_not_make_the_golden_dump_is_refused(tmp_path: Path, qwen2_dumps: Path,
                                                                      other: str) -> None:
    """Every own error from a target dump is measured against the golden model: one that is not the
    dump's own (other weights, another family of the same shapes) would make every layer look alike
    and the faulty target pass. Its first layer, run on the golden dump's own inputs, must give the
    recorded output: otherwise exit 2 naming the field, and no verdict."""
    proc, verdict = _run(tmp_path, str(qwen2_dumps / "golden"), str(qwen2_dumps / "target"), other)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert last.startswith("FAILED") and "golden_model_spec" in last, last
    assert "does not reproduce the golden dump" in last and "model.layers.0" in last, last
    assert verdict is None


def test_a_dump_without_logits_says_the_tokens_were_not_compared(tmp_path: Path, qwen2_dumps: Path) -> None:
    """A target dumped without logits (logits=False, or a format that holds none): nothing is known
    of its tokens, so no first differing token is claimed, and a clean port's pass says the tokens
    were not compared instead of "the same tokens"."""
    proc, verdict = _run(tmp_path, str(qwen2_dumps / "golden"), str(qwen2_dumps / "clean"), QWEN2)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith("PASSED") and "the tokens were not compared" in last, last
    assert "target dump holds no logits" in last and "same tokens" not in last, last
    assert verdict["first_mismatch_token"] is None


def test_a_golden_model_that_differs_from_the_dump_in_a_later_layer_is_refused(tmp_path: Path,
                                                                                qwen2_dumps: Path) -> None:
    """A golden model that is the dump's own in its first layer but not in a later one (weights
    changed since the dump was made) would blame a clean target at that layer: the module about to
    be named is checked against the golden dump first, and the bisect refuses (exit 2) instead."""
    builder = tmp_path / "changed_golden.py"
    builder.write_text(
        "import torch\n"
        "from llmflow.models import load_model\n\n\n"
        "def build():\n"
        f"    loaded = load_model({QWEN2!r})\n"
        "    with torch.no_grad():\n"
        "        loaded.model.get_parameter('model.layers.2.mlp.down_proj.weight').mul_(1.5)\n"
        "    return loaded.model, loaded.tokenizer\n")
    proc, verdict = _run(tmp_path, str(qwen2_dumps / "golden"), str(qwen2_dumps / "clean"),
                         f"{builder}:build")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "does not reproduce the golden dump: model.layers.2" in last, last
    assert verdict is None


MOE = "tiny-qwen3-moe:layers=4,experts=16,top_k=2"
#: the prompt ("Tell me a story about a dragon.", bytes): layer 2 routes 3 of its 31 tokens to expert 3
MOE_IDS = list(b"Tell me a story about a dragon.")


def test_a_dump_of_an_moe_port_names_the_expert_few_tokens_reach(tmp_path: Path) -> None:
    """One expert of 16 (top 2) whose output weights are 1.5x, reached by 3 of the prompt's 31
    tokens in its layer: over every token its error is diluted; over its own tokens it is whole,
    and the golden experts run on the target dump's inputs name it."""
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.models import load_model

    dump_run(load_model(MOE), MOE_IDS, 2, DumpConfig(dump_path=str(tmp_path / "golden"), token_range="all"))
    target = load_model(MOE, dtype="bfloat16")
    with torch.no_grad():
        target.model.get_submodule("model.layers.2.mlp.experts").down_proj[3].mul_(1.5)
    dump_run(target, MOE_IDS, 2, DumpConfig(dump_path=str(tmp_path / "target"), token_range="all"))
    proc, verdict = _run(tmp_path, str(tmp_path / "golden"), str(tmp_path / "target"), MOE)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert verdict["first_bad_module"] == "model.layers.2.mlp.experts", verdict["headline"]
    top = verdict["candidates"][0]
    assert top["expert_worst"] == 3 and top["expert_rel"] > 3 * top["token_rel"], top
    assert "Its error is in the tokens routed to expert 3" in verdict["diagnosis"], verdict["diagnosis"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "deepseek-v3", "llama4"])
def test_a_dump_of_an_moe_port_names_the_expert_half_the_tokens_reach(tmp_path: Path, family: str) -> None:
    """Expert 1 of 4 (top 2) with output weights 1.5x, a bf16 target dumped the user's way: it
    reaches about half the prompt's tokens, so its tokens err only ~2x the average token; against
    the tokens it does not reach (bf16 rounding alone) they stand out, and the verdict names it,
    also where it speaks of a decode step (the prefill's tokens name the expert). Llama 4 hands its
    experts every token once per expert, unrouted copies zeroed: the rows name the expert."""
    from llmflow.dump.config import DumpConfig
    from llmflow.dump.run import dump_run
    from llmflow.models import load_model

    model = f"tiny-{family}:layers=4,hidden=64,intermediate=128,experts=4,top_k=2,seed=3"
    dump_run(load_model(model), MOE_IDS, 2, DumpConfig(dump_path=str(tmp_path / "golden"), token_range="all"))
    target = load_model(model, dtype="bfloat16", patch="plugins/example_faults.py:scale_expert_layer_2",
                        base_dir=REPO)
    dump_run(target, MOE_IDS, 2, DumpConfig(dump_path=str(tmp_path / "target"), token_range="all"))
    proc, verdict = _run(tmp_path, str(tmp_path / "golden"), str(tmp_path / "target"), model)
    experts = "model.layers.2.feed_forward.experts" if family == "llama4" else "model.layers.2.mlp.experts"
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert verdict["first_bad_module"] == experts, verdict["headline"]
    assert verdict["first_bad_expert"] == 1 and "(expert 1)" in verdict["headline"], verdict["headline"]
    top = verdict["candidates"][0]
    assert top["expert_worst"] == 1 and top["expert_median_rel"] > 3 * top["expert_rest_rel"], top
    assert "Its error is in the tokens routed to expert 1" in verdict["diagnosis"], verdict["diagnosis"]
    if family == "mixtral":  # its token at decode step 1 misses expert 1: asked to replay that step
        # alone, the bisect finds nothing there, yet the compare fails at the prefill: not a pass
        proc, verdict = _run(tmp_path / "decode", str(tmp_path / "golden"), str(tmp_path / "target"), model,
                             "--set", "replay_step=1")
        assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert verdict["status"] == "inconclusive", verdict["headline"]
        assert verdict["replay"]["steps_tried"] == [1], verdict["replay"]
        reason = verdict["inconclusive"]["reason"]
        assert "is at step 0, but step 1 was replayed" in reason, reason
        assert "replay_step: 0" in verdict["inconclusive"]["next"]
    if family != "qwen3-moe":  # (the family whose token at decode step 1 reaches expert 1)
        return
    # at a decode step its one token reaches two experts alike: the prefill's tokens name the expert
    proc, verdict = _run(tmp_path / "decode", str(tmp_path / "golden"), str(tmp_path / "target"), model,
                         "--set", "replay_step=1")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert verdict["replay"]["step"] == 1 and verdict["first_bad_module"] == "model.layers.2.mlp.experts"
    # (the experts' own row: the MLP holding them may rank above it on a CPU whose bf16 rounds so)
    named = next(c for c in verdict["candidates"] if c["name"] == "model.layers.2.mlp.experts")
    assert named.get("expert_worst") is None and named["prefill_expert"] == 1, named
    assert verdict["first_bad_expert"] == 1, verdict["headline"]
    assert "At the prefill its error is in the tokens routed to expert 1" in verdict["diagnosis"]
