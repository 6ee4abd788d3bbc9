"""A port whose attention stores its keys into the KV cache wrong at the prefill, while its own
prefill output is computed right (the prefill's outputs match; the decode steps that read the cache
drift): the bisect measures what each attention writes into its cache at the prefill, from the
golden dump, as it does at a decode step, and names the cache write; a clean port is never blamed
for it. The user's patch scales layer 2's prefill keys x1.5 on their way into the cache. Run as a
user runs it (``llmflow run llama2_bisect``), in float32 so that no CPU's bf16 decides anything;
Llama, Qwen2 and Gemma-2 (sliding-window layers, soft-capped attention). Then the two golden
sources of the prefill one by one: the decoder layers' dumped inputs recomputed (the recipe's
dump), and every module dumped (the dumped attention run once more to have what it writes). A target known
by its dump alone holds no cache contents: there the attention is named at the first decode step,
its own error over the steps before from the target's recorded inputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import bisect_dumps, make_dumps, recipe_bisect_reusing_golden, user_dump  # noqa: E402

from llmflow.dump.memory import CacheSnapshot  # noqa: E402
from llmflow.formats import open_dump  # noqa: E402
from llmflow.localize.golden import golden_calls  # noqa: E402
from llmflow.localize.replay import is_branch, replay_modules  # noqa: E402
from llmflow.models import encode_prompt, load_model  # noqa: E402
from llmflow.structure import find_layer_stack  # noqa: E402

FAMILIES = ["llama", "qwen2", "gemma2"]
SIZE = "layers=4,init=0.2"
BAD = "model.layers.2.self_attn"
CACHE_WRITE = f"FAILED: {BAD} (the keys and values it writes to the KV cache) is the fault"

PATCH = '''
def prefill_keys_x15(model):
    """Layer 2's attention computes its prefill output right, then the keys it stored in its KV
    cache are scaled x1.5 there (the cache itself stays the model's own kind)."""
    def scale_stored_keys(module, args, kwargs, output):
        cache = kwargs.get("past_key_values")
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if cache is not None and hidden is not None and hidden.shape[1] > 1:  # the prefill
            cache.layers[module.layer_idx].keys.mul_(1.5)

    model.model.layers[2].self_attn.register_forward_hook(scale_stored_keys, with_kwargs=True)


def clean(model):
    """The port as shipped: nothing changed."""
'''


@pytest.fixture(scope="module")
def port(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("port") / "port.py"
    path.write_text(PATCH, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def golden_runs() -> dict[str, Path]:
    """family -> its first run dir: a later run starts from a copy (the golden's dump reused)."""
    return {}


def _bisect(tmp_path: Path, family: str, golden_runs: dict[str, Path], patch: str) -> tuple[int, str, dict]:
    return recipe_bisect_reusing_golden(tmp_path, family, SIZE, golden_runs,
                                        "target_dtype=float32", "max_new_tokens=4", f"target_patch={patch}")


@pytest.mark.parametrize("family", FAMILIES)
def test_keys_written_wrong_into_the_cache_at_the_prefill_are_the_attentions_fault(family, tmp_path,
                                                                                   golden_runs, port):
    rc, last, v = _bisect(tmp_path, family, golden_runs, f"{port}:prefill_keys_x15")
    assert rc == 1 and last.startswith(CACHE_WRITE), last
    assert "at the prefill (step 0)" in last, last
    assert v["first_bad_module"] == BAD and v["replay"]["step"] == 0, (v["first_bad_module"], v["replay"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_clean_port_is_not_blamed_for_its_prefill_cache_write(family, tmp_path, golden_runs, port):
    rc, last, v = _bisect(tmp_path, family, golden_runs, f"{port}:clean")
    assert rc == 0 and last.startswith("PASSED"), last
    assert v["first_bad_module"] is None and "KV cache" not in last, last


def _prefill_cache_rows(dumps: dict, patch: str | None) -> dict[str, dict]:
    """The target's attentions replayed on the golden's prefill calls (the bisect's dump source),
    by name."""
    golden = load_model(dumps["golden_spec"]["model"])
    target = load_model(dumps["golden_spec"]["model"], patch=patch)
    stack = find_layer_stack(target.model)
    calls = list(golden_calls(open_dump(dumps["golden_dump"]), 0, lambda: golden, stack=stack,
                              select=lambda n, m: is_branch(n, m, stack)))
    attentions = [c for c in calls if c.name.endswith(".self_attn")]
    assert len(attentions) == 4, [c.name for c in calls]
    for call in attentions:  # an empty cache to write into, and what the golden wrote there
        assert any(isinstance(v, CacheSnapshot) for v in call.kwargs.values()), call.kwargs.keys()
        assert call.cache_after is not None, call.name
    rows = replay_modules(target.model, attentions, device=torch.device("cpu"), dtype=torch.float32,
                          stack=stack)
    return {r["name"]: r for r in rows}


@pytest.mark.parametrize("golden_all", [False, True], ids=["layers-recomputed", "every-module-dumped"])
def test_the_prefill_cache_write_is_measured_from_either_golden_dump(golden_all, tmp_path, port):
    dumps = make_dumps(tmp_path, f"tiny-llama:{SIZE}", golden_all=golden_all, target_dtype="float32",
                       max_new_tokens=2)
    rows = _prefill_cache_rows(dumps, f"{port}:prefill_keys_x15")
    assert rows[BAD]["kv_cache_rel_l2"] > 0.2, rows[BAD]
    assert rows[BAD]["rel_l2"] < 1e-6, rows[BAD]  # its own prefill output is right
    others = [r["kv_cache_rel_l2"] for n, r in rows.items() if n != BAD]
    assert len(others) == 3 and max(others) < 1e-6, others
    clean = [r["kv_cache_rel_l2"] for r in _prefill_cache_rows(dumps, None).values()]
    assert len(clean) == 4 and max(clean) < 1e-6, clean  # measured, and nothing off


def test_a_golden_with_every_module_dumped_names_the_prefill_cache_write(tmp_path, port):
    """The bisect from a golden dump of every module at the prefill: the dumped attention's call
    is run on the golden once more for what it writes."""
    dumps = make_dumps(tmp_path, f"tiny-qwen2:{SIZE}", golden_all=True, target_dtype="float32",
                       max_new_tokens=4, patch=f"{port}:prefill_keys_x15")
    v = bisect_dumps(dumps, estimate_cost=False)
    assert v["status"] == "fail" and v["first_bad_module"] == BAD, v["headline"]
    assert "the keys and values it writes to the KV cache" in v["headline"], v["headline"]
    assert v["replay"]["step"] == 0, v["replay"]


def test_a_target_known_by_its_dump_alone_names_the_attention_at_the_first_decode_step(tmp_path, port):
    model = f"tiny-llama:{SIZE}"
    golden = user_dump(tmp_path / "golden", model, {}, max_new_tokens=4)
    target = user_dump(tmp_path / "target", model, {}, patch=f"{port}:prefill_keys_x15", max_new_tokens=4)
    dumps = {"golden_dump": golden, "target_dump": target, "golden_ids": [], "target_ids": [],
             "prompt_ids": encode_prompt(load_model(model).tokenizer, "Tell me a story."),
             "golden_spec": {"model": model, "device": "cpu", "dtype": "float32"}}
    v = bisect_dumps(dumps, isolate="target_dump", estimate_cost=False)
    assert v["status"] == "fail" and v["first_bad_module"] == BAD, v["headline"]
    assert v["replay"]["step"] > 0, v["replay"]  # what it wrote at the prefill, read there
