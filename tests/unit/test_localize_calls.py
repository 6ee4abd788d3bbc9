"""Calls kept for replay: KV caches snapshotted as a module found them, private copies per replay,
what a module wrote into its cache, and caches given by position."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from llmflow.dump.memory import CacheSnapshot, CallRecorder
from llmflow.localize.calls import build_call, cast_inputs, written_kv
from llmflow.models import build_tiny, greedy_generate


class Attn(torch.nn.Module):
    """Appends a key/value to its layer of the cache, returns the sum of the cached keys."""

    layer_idx = 1

    def forward(self, x, past_key_values=None):
        k, _v = past_key_values.update(x * 2, x * 3, self.layer_idx)
        return k.sum(-2)


def filled_cache(n: int = 3) -> DynamicCache:
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.ones(1, 1, n, 4) * (layer + 1), torch.ones(1, 1, n, 4), layer)
    return cache


def test_a_snapshot_keeps_the_state_a_module_found_and_replays_on_private_copies():
    cache = filled_cache()
    snap = CacheSnapshot(cache, layer_idx=1)
    cache.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), 1)  # the live run goes on
    assert snap.layer_kv(1)[0].shape[-2] == 3  # as it was
    attn = Attn()
    copy = cast_inputs(snap, torch.device("cpu"), torch.bfloat16, attn)
    assert copy.layers[1].keys.dtype == torch.bfloat16 and copy.layers[1].keys.shape[-2] == 3
    attn(torch.ones(1, 1, 1, 4, dtype=torch.bfloat16), past_key_values=copy)
    assert copy.layers[1].keys.shape[-2] == 4 and snap.layer_kv(1)[0].shape[-2] == 3  # untouched
    written = written_kv(snap, copy, 1)
    assert written.shape == (1, 1, 1, 8) and torch.equal(written[..., :4], torch.full((1, 1, 1, 4), 2.0))


def test_a_recorder_keeps_the_cache_before_and_after_a_decode_call():
    model = build_tiny("llama", "layers=2")
    attn = "model.layers.1.self_attn"
    rec = CallRecorder(model, lambda name, _m: name == attn)
    rec.active = False
    step = {"n": -1}

    def pre(_m, _a):
        step["n"] += 1
        rec.active = step["n"] == 2
    model.register_forward_pre_hook(pre)
    greedy_generate(model, [256, 65, 66], 3)
    rec.close()
    call = rec.calls[attn]
    before = next(v for v in call.kwargs.values() if isinstance(v, CacheSnapshot))
    assert call.replayable and before.layer_kv(1)[0].shape[-2] == 4  # prompt 3 + one decoded token
    assert written_kv(before, call.cache_after, 1).shape[-2] == 1


def test_a_cache_by_position_is_empty_at_the_prefill_and_its_contents_missing_after():
    x = torch.randn(1, 2, 4)
    prefill = build_call("transformer.h.0", [("0", x), ("1", (None, "DynamicCache"))], [("0", x)], step=0)
    assert prefill.replayable and prefill.args == [x, None]
    decode = build_call("transformer.h.0", [("0", x), ("1", (None, "DynamicCache"))], [("0", x)], step=2)
    assert not decode.replayable and "KV cache (DynamicCache)" in decode.reason


def test_a_cache_with_state_beside_its_layers_is_snapshotted_whole():
    """MiniMax's cache keeps its linear-attention states in a list of its own: a snapshot shares
    none of it with later writes, and a private copy for a replay is cast as a whole."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    cache = MiniMaxCache()
    cache.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), 0)
    cache.set_linear_cache(1, torch.ones(1, 2, 4, 4))
    snap = CacheSnapshot(cache, layer_idx=0)
    cache.set_linear_cache(1, torch.full((1, 2, 4, 4), 7.0))  # a later step's write
    assert torch.equal(snap.cache.linear_cache[1], torch.ones(1, 2, 4, 4))
    copy = snap.materialize(Attn(), torch.device("cpu"), torch.bfloat16)
    assert copy.linear_cache[1].dtype == torch.bfloat16 and copy.layers[0].keys.dtype == torch.bfloat16


def test_a_fresh_cache_is_the_model_familys_own_kind_where_it_has_one():
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    from llmflow.localize.calls import cache_class, fresh_cache

    minimax, llama = build_tiny("minimax", "layers=2"), build_tiny("llama", "layers=2")
    assert cache_class(minimax, "MiniMaxCache") is MiniMaxCache
    assert type(fresh_cache(minimax, "MiniMaxCache")) is MiniMaxCache
    assert cache_class(llama, "MiniMaxCache") is None and cache_class(llama, "StaticCache") is None
    assert type(fresh_cache(llama)) is DynamicCache


def test_a_cache_layer_not_yet_written_holds_nothing():
    """A cache that adds its layers as they first write: the keys written into layer 1 by its first
    call are those after it, none before."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    before = MiniMaxCache()
    after = MiniMaxCache()
    for layer in range(2):
        after.update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4), layer)
    written = written_kv(before, after, 1)
    assert written is not None and written.shape == (1, 1, 3, 8)
