"""The logits a reader derives for a dump that records none (``formats/head.py``) and where the
texts part from the token ids both dumps record (``compare/divergence.divergence_in_dumps``), on
entries made here: which output is a head, which is not, and when the token ids cannot say."""

from __future__ import annotations

import torch
from compare_helpers import MemoryDump

from llmflow.compare.divergence import divergence_in_dumps, token_ids_entry
from llmflow.formats.base import Entry
from llmflow.formats.head import as_logits, derived_logits, vocabulary

VOCAB = 300


def _out(name: str, shape: tuple[int, ...], *, step: int = 0, order: int = 0, level: str = "module",
         mtype: str | None = "Linear", data: bool = True) -> Entry:
    return Entry(step=step, rank=0, name=name, kind="output", index="0", level=level, order=order,
                 dtype="bfloat16", shape=shape, module_type=mtype, has_data=data, key=f"{name}.{step}.pt",
                 stats=None if data else {"max": 1.0, "min": -1.0, "mean": 0.0, "norm": 3.0})


def _embedding_weight() -> Entry:
    return Entry(step=-1, rank=0, name="model.embed_tokens.weight", kind="weight", index="0", level="weight",
                 order=0, dtype="float32", shape=(VOCAB, 64))


def _embedding_call(step: int) -> Entry:
    return Entry(step=step, rank=0, name="model.embed_tokens", kind="input", index="0", level="module",
                 order=0, dtype="int64", shape=(1, 1), module_type="Embedding")


def test_the_head_of_each_step_gives_one_logits_entry():
    entries = [_embedding_weight()]
    for step in range(3):
        entries += [_embedding_call(step), _out("model.layers.0", (1, 1, 64), step=step, order=1),
                    _out("lm_head", (1, 1, VOCAB), step=step, order=2)]
    assert vocabulary(entries) == VOCAB
    logits = derived_logits(entries)
    assert [(e.step, e.name, e.level, e.shape, e.extra["logits_of"]) for e in logits] == [
        (s, "logits", "logits", (1, VOCAB), "lm_head") for s in range(3)]
    assert all(e.order > 2 and e.key == f"lm_head.{e.step}.pt" for e in logits)


def test_a_head_over_every_position_gives_its_last_the_next_tokens_logits():
    every_position = derived_logits([_embedding_weight(), _out("lm_head", (1, 7, VOCAB))])
    assert [(e.step, e.shape, e.extra) for e in every_position] == [
        (0, (1, VOCAB), {"logits_of": "lm_head", "position": "last"})]
    assert every_position[0].stats is None  # (the head's statistics are of all seven positions)
    head = torch.randn(1, 7, VOCAB, dtype=torch.bfloat16)
    assert torch.equal(as_logits(head), head[:, -1, :].float())
    # statistics alone of every position: no logits row (nothing says the last position's)
    assert derived_logits([_embedding_weight(), _out("lm_head", (1, 7, VOCAB), data=False)]) == []


def test_no_logits_from_a_wrong_width_or_a_dump_that_has_them():
    wrong_width = [_embedding_weight(), _embedding_call(0), _out("lm_head", (1, 1, 64))]
    assert derived_logits(wrong_width) == []
    own = Entry(step=0, rank=0, name="logits", kind="output", index="0", level="logits", order=9,
                dtype="float32", shape=(1, VOCAB))
    assert derived_logits([_out("lm_head", (1, 1, VOCAB)), own]) == []


def test_api_level_heads_need_the_vocabulary_and_atb_heads_one_row():
    weight = Entry(step=0, rank=0, name="/embedding.0", kind="input", index="1", level="api", order=0,
                   dtype="float32", shape=(VOCAB, 64), module_type="embedding")
    linear = _out("/linear.13", (1, 1, VOCAB), order=5, level="api", mtype="linear")
    other = _out("/linear.12", (1, 1, 128), order=4, level="api", mtype="linear")
    assert [e.extra["logits_of"] for e in derived_logits([weight, other, linear])] == ["/linear.13"]
    assert derived_logits([other, linear]) == []  # no vocabulary known: an API call is no head
    one_row = _out("40_LmHead", (1, VOCAB), mtype="LmHead")
    assert [e.shape for e in derived_logits([one_row])] == [(1, VOCAB)]
    assert derived_logits([_out("40_LmHead", (5, VOCAB), mtype="LmHead")]) == []
    stats_only = _out("lm_head", (1, 1, VOCAB), data=False)
    assert derived_logits([stats_only])[0].stats == stats_only.stats


def test_as_logits_keeps_the_numbers_in_float32():
    head = torch.randn(2, 1, VOCAB, dtype=torch.bfloat16)
    out = as_logits(head)
    assert out.shape == (2, VOCAB) and out.dtype == torch.float32 and torch.equal(out, head[:, 0].float())


def _ids_dump(ids: list[int | None], stats: bool = False) -> MemoryDump:
    """A dump of the token ids each step's embedding received (``None``: the step not dumped)."""
    entries, tensors = [], {}
    for step, token in enumerate(ids):
        if token is None:
            continue
        e = _embedding_call(step)
        e.key = f"ids{step}"
        tensors[e.key] = torch.tensor([[token]])
        if stats:
            e.has_data, e.stats = False, {"max": float(token), "min": float(token), "mean": float(token)}
        entries.append(e)
    return MemoryDump(entries, tensors)


def _pairs(n: int) -> list[dict[str, int]]:
    return [{"golden_step": s, "target_step": s} for s in range(n)]


def test_the_first_step_whose_ids_differ_dates_the_token_before_it():
    golden, target = _ids_dump([5, 10, 11, 12, 13]), _ids_dump([5, 10, 11, 40, 41])
    assert token_ids_entry(golden.entries()).name == "model.embed_tokens"
    parted = divergence_in_dumps(golden, target, _pairs(5))
    assert parted is not None and parted.first_differing_token == 2 and parted.golden_file is None
    assert "model.embed_tokens input 0" in parted.source
    assert divergence_in_dumps(_ids_dump([5, 10, 11], stats=True), _ids_dump([5, 10, 12], stats=True),
                               _pairs(3)).first_differing_token == 1


def test_no_claim_where_the_ids_agree_or_a_step_is_missing():
    assert divergence_in_dumps(_ids_dump([5, 10, 11]), _ids_dump([5, 10, 11]), _pairs(3)) is None
    # step 2 not dumped on the target: a difference at step 3 cannot say whether token 1 or 2 parted
    assert divergence_in_dumps(_ids_dump([5, 10, 11, 12]), _ids_dump([5, 10, None, 40]), _pairs(4)) is None
