"""The bisect from the target's dump at a decode step: an attention reads the target's KV cache,
which no dump holds, so the golden attention is run on the target's recorded inputs of every step
0..t with a DynamicCache of its own; its output at step t against the recorded one is the
attention's own error at t. A decode-kernel fault is named at a decode step on several families,
a clean port passes, the golden replayed on its own dump is exact, and a dump without an earlier
step's inputs says which step is missing. A side input (rotary tables, mask) changed on its way into
the attention is read from the dumps: the attention is named where its layer was given another."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from example_faults import faulty_module  # noqa: E402
from workflow_helpers import REPO, llmflow  # noqa: E402

from llmflow.dump.config import DumpConfig  # noqa: E402
from llmflow.dump.run import dump_run  # noqa: E402
from llmflow.formats import open_dump  # noqa: E402
from llmflow.localize.bisect import run_bisect  # noqa: E402
from llmflow.localize.options import BisectInputs  # noqa: E402
from llmflow.localize.target_dump import replay_target_dump  # noqa: E402
from llmflow.models import load_model  # noqa: E402
from llmflow.results.verdict import Verdict  # noqa: E402

# init=0.2: attention peaked enough that a decode-kernel fault moves the numbers, as in a trained model
SIZE = "layers=4,hidden=64,intermediate=128,seed=3,init=0.2"
PROMPT = [256, 104, 101, 108, 108, 111]
NEW_TOKENS = 5
WORKFLOW = REPO / "workflows" / "dump_bisect.yaml"
#: the decode-only faults that change what the attention computes from the inputs it receives
KERNEL_FAULTS = ("decode_attn_scale", "decode_softmax_scale")


def spec(family: str) -> str:
    return f"tiny-{family}:{SIZE}"


def attention(name: str, _module: object) -> bool:
    return name.endswith("self_attn")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """(family, name, patch, dtype, token_range) -> a module-mode dump with every module's inputs
    (tensor_part 2) of that model, made once."""
    made: dict[tuple, Path] = {}

    def dump(family: str, name: str, patch: str | None = None, dtype: str = "bfloat16",
             token_range: str | list[int] = "all") -> Path:
        key = (family, name, patch, dtype, str(token_range))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{name}")
            model = load_model(spec(family), dtype=dtype, patch=patch, base_dir=REPO)
            dump_run(model, PROMPT, NEW_TOKENS, DumpConfig(dump_path=str(out), token_range=token_range))
            made[key] = out
        return made[key]
    return dump


def golden(dumps: Callable[..., Path], family: str) -> Path:
    return dumps(family, "golden", dtype="float32")


def faulty(dumps: Callable[..., Path], family: str, fault: str) -> Path:
    return dumps(family, fault, patch=f"plugins/example_faults.py:{fault}_layer_1")


def bisect(dumps: Callable[..., Path], family: str, target: Path, **kwargs) -> Verdict:
    inp = BisectInputs(golden_dump=golden(dumps, family), target_dump=target,
                       golden_spec={"model": spec(family)}, isolate="target_dump", **kwargs)
    return run_bisect(inp, log=lambda _m: None)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("fault", KERNEL_FAULTS)
def test_a_decode_kernel_fault_names_the_attention_at_a_decode_step(dumps, family: str, fault: str) -> None:
    verdict = bisect(dumps, family, faulty(dumps, family, fault))
    want = faulty_module(load_model(spec(family)).model, fault, 1)
    step = verdict.replay.step
    assert verdict.status == "fail" and verdict.first_bad_module == want, verdict.headline
    assert step > 0 and f"decode step {step}" in verdict.headline, verdict.headline
    top = verdict.candidates[0]
    assert top.name == want and top.replayable and top.source == f"target dump, steps 0..{step}"
    assert top.score > 10 and f"target dump, steps 0..{step}, filling a KV cache" in verdict.diagnosis
    # the same module in the other layers was replayed the same way: the peers the score compares with
    peers = [c for c in verdict.candidates if c.name.endswith("self_attn") and c.name != want]
    assert peers and all(c.replayable and c.source == top.source for c in peers)


#: decode-only faults that change what the attention receives (a pre-hook): recorded as its inputs,
#: so the attention replayed on them reproduces them
INPUT_FAULTS = ("decode_rope_shift", "decode_mask_oldest")


def layer_mask_is_a_tensor(target: Path, step: int) -> bool:
    """Whether layer 1 was given its attention mask as a tensor at ``step`` (a family whose decode
    step passes none has its attention handed one the mask fault makes up)."""
    return any(e.name == "model.layers.1" and e.index == "kw:attention_mask" and e.is_tensor
               for e in open_dump(target).entries() if e.step == step and e.kind == "input")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3", "llama4"])  # (llama4: complex angles)
@pytest.mark.parametrize("fault", INPUT_FAULTS)
def test_a_side_input_changed_on_its_way_names_the_module_it_enters(dumps, family: str, fault: str) -> None:
    """The rotary tables or the mask a layer hands its attention changed at decode steps: the
    attention is named where the layer was given the input it changed (read from the dumps: the
    golden's attention is handed its layer's very tensor); a mask the layer was not given as a
    tensor leaves the layer replayed whole as the lead, never "no fault"."""
    target = faulty(dumps, family, fault)
    verdict = bisect(dumps, family, target)
    found = verdict.handed_down
    if fault == "decode_mask_oldest" and not layer_mask_is_a_tensor(target, 1):
        assert verdict.status == "inconclusive" and found is None, verdict.headline
        reason = verdict.inconclusive.reason
        assert reason.startswith("model.layers.1, replayed whole from the target dump, has "), reason
        assert "none of its modules' own error stands out" in reason
        assert "isolate: target_model" in verdict.inconclusive.next
        return
    want = "kw:position_embeddings" if fault == "decode_rope_shift" else "kw:attention_mask"
    headline = verdict.headline
    assert verdict.status == "fail" and verdict.first_bad_module == "model.layers.1.self_attn", headline
    assert verdict.first_bad_layer == "model.layers.1" and verdict.inconclusive is None
    assert found is not None and found.enclosing == "model.layers.1" and found.input.startswith(want), found
    assert found.step == 1 and (found.difference is None or found.difference > found.limit > 0)
    assert headline.startswith(f"model.layers.1.self_attn is handed a changed {want[3:]}"), headline
    assert "at decode step 1" in headline and "the golden's passes it on unchanged" in headline


# (llama4: its qk_norm is called twice a step, on the queries and on the keys)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "llama4"])
@pytest.mark.parametrize("replay_step", [0, 1, 2, 4])
def test_a_clean_ports_layers_replayed_whole_do_not_stand_out(dumps, family: str, replay_step: int) -> None:
    verdict = bisect(dumps, family, dumps(family, "clean"), replay_step=replay_step)
    assert verdict.status == "pass" and verdict.inconclusive is None, verdict.headline
    assert verdict.handed_down is None  # its bf16 side inputs are handed on as the golden's are


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_clean_port_replays_the_decode_attention_and_names_nothing(dumps, family: str) -> None:
    verdict = bisect(dumps, family, dumps(family, "clean"), replay_step=2)
    assert verdict.status == "pass" and verdict.first_bad_module is None, verdict.headline
    assert verdict.replay.not_replayable == 0
    replayed = [c for c in verdict.candidates if c.name.endswith("self_attn")]
    assert replayed and all(c.source == "target dump, steps 0..2" and c.error < 0.05 for c in replayed)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_golden_on_its_own_dump_has_no_own_error_at_decode_steps(dumps, family: str) -> None:
    """The golden's fp32 dump as the target: each attention run over steps 0..t on its own recorded
    inputs gives, at every decode step, what the golden's generation recorded, bit for bit."""
    model = load_model(spec(family))
    reader = open_dump(golden(dumps, family))
    for step in range(1, NEW_TOKENS):
        rows = list(replay_target_dump(model, reader, reader, golden_step=step, target_step=step,
                                       select=attention))
        assert len(rows) == 4 and all(r["replayable"] for r in rows), rows
        assert all(r["rel_l2"] == 0.0 and r["max_abs"] == 0.0 for r in rows), (step, rows)
        assert all(r["source"] == f"target dump, steps 0..{step}" for r in rows)


def test_a_dump_without_an_earlier_steps_inputs_says_which_step(dumps) -> None:
    model = load_model(spec("llama"))
    fault = "plugins/example_faults.py:decode_attn_scale_layer_1"
    target = open_dump(dumps("llama", "steps_0_3", patch=fault, token_range=[0, 3]))
    rows = list(replay_target_dump(model, open_dump(golden(dumps, "llama")), target, golden_step=3,
                                   target_step=3, select=attention))
    assert len(rows) == 4 and not any(r["replayable"] for r in rows)
    assert all("KV cache (DynamicCache)" in r["reason"] and "every step 0..3" in r["reason"]
               and "no inputs at step 1" in r["reason"] for r in rows), rows[0]["reason"]


def test_a_cache_kind_other_than_dynamic_stays_not_replayable(dumps) -> None:
    """The fp8-cache fault hands its layer's attention a cache wrapper of its own at decode steps: a
    private DynamicCache cannot stand for it, so that attention is reported, the others replayed."""
    verdict = bisect(dumps, "llama", faulty(dumps, "llama", "decode_cache_fp8"), replay_step=2)
    attn = {c.name: c for c in verdict.candidates if c.name.endswith("self_attn")}
    lossy = attn["model.layers.1.self_attn"]
    assert not lossy.replayable and "(_LossyCache)" in lossy.reason and "only a DynamicCache" in lossy.reason
    assert verdict.replay.not_replayable == 1  # that attention alone; the other layers' among the ranked
    others = [c for n, c in attn.items() if n != "model.layers.1.self_attn"]
    assert others and all(c.replayable and c.source == "target dump, steps 0..2" for c in others)


def test_dump_bisect_names_a_decode_fault_the_users_way(tmp_path: Path, dumps) -> None:
    target = faulty(dumps, "llama", "decode_softmax_scale")
    run_dir = tmp_path / "run"
    proc = llmflow("run", str(WORKFLOW), "--run-dir", str(run_dir), "--set",
                   f"golden_dump={golden(dumps, 'llama')}", "--set", f"target_dump={target}",
                   "--set", f"golden_model={spec('llama')}", timeout=300)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith("FAILED") and "model.layers.1.self_attn is the fault" in last, last
    assert "decode step" in last, last
    verdict = json.loads((run_dir / "bisect" / "verdict.json").read_text())
    assert verdict["isolation"] == "target_dump" and verdict["replay"]["step"] > 0
    assert verdict["candidates"][0]["source"] == f"target dump, steps 0..{verdict['replay']['step']}"


def test_dump_bisect_names_a_changed_side_input_the_users_way(tmp_path: Path, dumps) -> None:
    """A rotary shift a hook puts into what layer 1's attention receives: exit 1, the attention and
    the input named in the last line, the verdict's handed_down block in verdict.json."""
    target = faulty(dumps, "qwen2", "decode_rope_shift")
    run_dir = tmp_path / "run"
    proc = llmflow("run", str(WORKFLOW), "--run-dir", str(run_dir), "--set",
                   f"golden_dump={golden(dumps, 'qwen2')}", "--set", f"target_dump={target}",
                   "--set", f"golden_model={spec('qwen2')}", timeout=300)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last.startswith("FAILED: model.layers.1.self_attn is handed a changed position_embeddings"), last
    verdict = json.loads((run_dir / "bisect" / "verdict.json").read_text())
    assert verdict["handed_down"]["enclosing"] == "model.layers.1" and verdict["handed_down"]["step"] == 1
    assert verdict["first_bad_module"] == "model.layers.1.self_attn"


def test_dump_bisect_says_inconclusive_naming_the_layer_the_users_way(tmp_path: Path, dumps) -> None:
    """The oldest cached positions masked where layer 1 was given no mask tensor: no input to read
    the change from, so exit 3, the layer named, and a next: line saying which bisect sees it."""
    target = faulty(dumps, "llama", "decode_mask_oldest")
    assert not layer_mask_is_a_tensor(target, 1)
    proc = llmflow("run", str(WORKFLOW), "--run-dir", str(tmp_path / "run"), "--set",
                   f"golden_dump={golden(dumps, 'llama')}", "--set", f"target_dump={target}",
                   "--set", f"golden_model={spec('llama')}", timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1].startswith("INCONCLUSIVE: model.layers.1, replayed whole from the target"), lines[-1]
    assert any(line.startswith("next:") and "isolate: target_model" in line for line in lines)


def test_a_streamed_golden_gives_the_attention_the_same_own_error(tmp_path: Path, dumps) -> None:
    """A golden stored as a Hugging Face directory, streamed: the attention's layer is read while it
    runs over the steps; its own error is the whole golden's, bit for bit."""
    load_model(spec("llama")).model.save_pretrained(tmp_path / "golden_hf")
    target = faulty(dumps, "llama", "decode_softmax_scale")
    errors = {}
    for weights in ("whole", "streamed"):
        inp = BisectInputs(golden_dump=golden(dumps, "llama"), target_dump=target, isolate="target_dump",
                           golden_spec={"model": str(tmp_path / "golden_hf")}, golden_weights=weights)
        verdict = run_bisect(inp, log=lambda _m: None)
        assert verdict.cost.model_runs.golden_weights == weights
        assert verdict.first_bad_module == "model.layers.1.self_attn" and verdict.replay.step > 0
        errors[weights] = verdict.candidates[0].error
    assert errors["streamed"] == errors["whole"]
