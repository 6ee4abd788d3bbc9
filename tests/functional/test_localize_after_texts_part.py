"""A fault that first shows after the texts part is named, not passed as rounding: where bf16 parts
the texts early, the bisect runs the target once more on the golden's tokens (teacher-forced) and
replays the first later step whose logits fail there, else the one whose logits are furthest from
the golden's (a cache written wrong grows with every step, under the thresholds at first). The
user's own patch writes wrong values into one layer's KV cache once it holds 40 positions (the
recipe's prompt is 32 tokens on the tiny models: decode step 8 on); whether bf16 parts the texts
before that is the CPU's affair, so every assertion holds either way. Run as a user runs it:
``llmflow run llama2_bisect``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from bisect_helpers import recipe_bisect_reusing_golden  # noqa: E402

FAMILIES = ["llama", "qwen2"]
SIZE = "layers=4,init=0.2"

PATCH = '''
class _LateWrite:
    """The cache as layer 1's attention sees it: values written x3 once it holds 40 positions."""

    def __init__(self, cache):
        self._cache = cache

    def update(self, key, value, layer_idx, *args, **kwargs):
        if self._cache.get_seq_length(layer_idx) >= 40:
            value = value * 3.0
        return self._cache.update(key, value, layer_idx, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._cache, name)


def late_cache_write(model):
    def wrap(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is None:
            return None
        return args, {**kwargs, "past_key_values": _LateWrite(cache)}

    model.model.layers[1].self_attn.register_forward_pre_hook(wrap, with_kwargs=True)


def pick_lowest_first(model):
    """The port's first forward (the prefill) makes its least likely token the greedy choice: the
    texts part at token 0 on every CPU, by code outside any module."""
    forward, calls = model.forward, []

    def first_changed(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            last = out.logits[..., -1, :]
            last[..., last.argmin(-1)] = last.max(-1).values + 10.0
        return out

    model.forward = first_changed


def late_cache_write_texts_parted(model):
    late_cache_write(model)
    pick_lowest_first(model)
'''


@pytest.fixture(scope="module")
def golden_runs() -> dict[str, Path]:
    """family -> its first run dir: a later run starts from a copy (the golden's dump reused)."""
    return {}


def _bisect(tmp_path: Path, family: str, golden_runs: dict[str, Path], patch: str) -> tuple[int, str, dict]:
    return recipe_bisect_reusing_golden(tmp_path, family, SIZE, golden_runs,
                                        "max_new_tokens=14", f"target_patch={patch}")


@pytest.fixture
def user_patch(tmp_path: Path) -> Path:
    path = tmp_path / "port.py"
    path.write_text(PATCH, encoding="utf-8")
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_a_kv_cache_written_wrong_late_is_named_wherever_the_texts_part(family, tmp_path, golden_runs,
                                                                        user_patch):
    rc, last, v = _bisect(tmp_path, family, golden_runs, f"{user_patch}:late_cache_write")
    assert rc == 1, last
    assert last.startswith("FAILED: model.layers.1.self_attn (the keys and values it writes to the KV cache) "
                           "is the fault"), last
    assert v["replay"]["step"] >= 8, v["replay"]  # the fault is not there before decode step 8
    forced = v["teacher_forced"]
    if forced is not None:  # the texts parted before the fault showed: found on the golden's tokens, at
        # the first step whose logits fail there, else the one whose logits are furthest from the golden's
        late = forced["first_fail"] if forced["first_fail"] is not None else forced["furthest"]
        assert late is not None and late > forced["after"], forced
        assert v["replay"]["step"] == late, (v["replay"], forced)


def test_texts_parted_at_the_first_token_the_late_fault_is_found_on_the_golden_tokens(tmp_path, golden_runs,
                                                                                      user_patch):
    """Pinned: the port's own code parts the texts at token 0 (outside any module), so the fault
    that comes later is found only on the golden's tokens."""
    rc, last, v = _bisect(tmp_path, "llama", golden_runs, f"{user_patch}:late_cache_write_texts_parted")
    assert rc == 1, last
    assert "model.layers.1.self_attn (the keys and values it writes to the KV cache)" in last, last
    forced = v["teacher_forced"]
    assert v["first_mismatch_token"] == 0 and forced is not None and forced["after"] == 0, forced
    late = forced["first_fail"] if forced["first_fail"] is not None else forced["furthest"]
    assert late >= 8 and v["replay"]["step"] == late, (v["replay"], forced)


def test_texts_parted_at_the_first_token_without_a_late_fault_name_nothing(tmp_path, golden_runs, user_patch):
    """The same parting alone: every step after it is checked on the golden's tokens and none is
    blamed; the first token's logits, changed outside any module, keep it inconclusive."""
    rc, last, v = _bisect(tmp_path, "llama", golden_runs, f"{user_patch}:pick_lowest_first")
    assert rc in (0, 3) and not last.startswith("FAILED"), last
    forced = v["teacher_forced"]
    assert forced is not None and forced["steps"] == list(range(1, 14)), forced
    assert v["first_bad_module"] is None
