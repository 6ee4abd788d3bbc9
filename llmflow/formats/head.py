"""The logits of a dump that records none: its output head's output at each step.

llmflow's own dumps hold an entry ``name="logits"`` every step (``base.py``); msprobe, msit and
ATB record the head as the module, API call or operation it is (``Module.lm_head.Linear.forward.0``,
``/linear.13``, ``40_LmHead``). A reader of such a dump adds one ``logits`` entry per step from
it, so compare's logits level (greedy-token agreement, KL, the first step whose top-1 token
differs) and the bisect's token level read foreign dumps as they read llmflow's:
``derived_logits(entries)`` the entries, ``as_logits(tensor)`` what the reader's ``load`` returns
for one (``[batch, vocab]`` float32, like llmflow's own).

The head of a step is its last output 0 of a floating dtype, 2 or 3 dims, that is

* a top-level module named like an output head (``lm_head``, ``embed_out``, ``output_layer``,
  ``output``), or ATB's top-level ``LmHead`` operation when it holds one row, or
* a ``linear``/``matmul`` API call whose last dimension is the vocabulary (the rows of the
  embedding table the dump records: an ``embedding`` call's weight, or an Embedding module's
  parameter), for dumps with API calls alone (msprobe L1).

Where the vocabulary is known a module must match it too. A head that computed every position
(``[batch, tokens, vocab]``: a loop calling the model itself, without a KV cache or at the
prefill without ``logits_to_keep``) gives its last position, the next token's logits
(``extra["position"] = "last"``; its statistics are the whole head's, so a statistics-only head
of many positions gives none). ``generate()`` and serving engines compute the head on the last
position alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from llmflow.formats.base import Entry, api_of

HEAD_MODULES = frozenset({"lm_head", "embed_out", "output_layer", "output"})
_HEAD_APIS = frozenset({"linear", "matmul"})
_FLOAT = ("float", "bfloat")


def vocabulary(entries: Iterable[Entry]) -> int | None:
    """The rows of the embedding table the dump records, or None."""
    embeddings: set[str] = set()
    weights: dict[str, int] = {}
    for e in entries:
        mtype = e.module_type or ""
        if e.level == "module" and mtype.endswith("Embedding") and "Rotary" not in mtype:
            embeddings.add(e.name)
        if not e.shape or len(e.shape) != 2:
            continue
        if e.level == "api" and e.kind == "input" and e.index == "1" and api_of(e.name) == "embedding":
            return int(e.shape[0])
        if e.kind == "weight":
            weights[e.name] = int(e.shape[0])
    found = [weights[f"{m}.weight"] for m in embeddings if f"{m}.weight" in weights]
    return found[0] if len(set(found)) == 1 else None


def _is_head(e: Entry, vocab: int | None) -> bool:
    if e.kind != "output" or e.index != "0" or not e.shape or len(e.shape) not in (2, 3):
        return False
    if not (e.dtype or "").startswith(_FLOAT) or not (e.has_data or e.stats):
        return False
    if e.level == "module" and e.name in HEAD_MODULES:
        return vocab is None or e.shape[-1] == vocab
    if e.level == "module" and e.module_type == "LmHead" and "." not in e.name:
        # ATB's top-level LmHead op: its rows are tokens or sequences, so only a single row is
        # surely the next token's logits
        return e.shape[0] == 1 and (vocab is None or e.shape[-1] == vocab)
    return e.level == "api" and vocab is not None and e.shape[-1] == vocab and api_of(e.name) in _HEAD_APIS


def derived_logits(entries: list[Entry]) -> list[Entry]:
    """One ``logits`` entry per (rank, step) from the step's head; none when the dump records
    logits already or no step has a head."""
    if any(e.level == "logits" for e in entries):
        return []
    vocab = vocabulary(entries)
    heads: dict[tuple[int, int], Entry] = {}
    last: dict[tuple[int, int], int] = {}
    for e in entries:
        if e.step < 0:
            continue
        key = (e.rank, e.step)
        last[key] = max(last.get(key, -1), e.order)
        if _is_head(e, vocab) and (key not in heads or e.order > heads[key].order):
            heads[key] = e
    out = []
    for key, head in heads.items():
        shape = head.shape or ()
        extra, stats = {"logits_of": head.name}, head.stats
        if len(shape) == 3 and shape[1] != 1:  # every position's logits: the next token's are the last
            if not head.has_data:  # (the statistics recorded are of every position: not the last's)
                continue
            extra["position"], stats = "last", None
        out.append(Entry(step=head.step, rank=head.rank, name="logits", kind="output", index="0",
                         level="logits", order=last[key] + 1, dtype="float32",
                         shape=(shape[0], shape[-1]), stats=stats, has_data=head.has_data,
                         key=head.key, extra=extra))
    return out


def as_logits(tensor: torch.Tensor) -> torch.Tensor:
    """A head's output as llmflow's logits entry holds it: ``[batch, vocab]``, float32 (the same
    numbers as the head's file; of a head over every position, its last: the next token's)."""
    rows = tensor[:, -1, :] if tensor.dim() == 3 else tensor
    return rows.to(torch.float32)
