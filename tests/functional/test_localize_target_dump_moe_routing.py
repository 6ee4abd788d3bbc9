"""An MoE block replayed from a target dump gets the routing the target chose, where the target's
own router logits explain that choice: a token sent elsewhere because its logits moved (near-tied
experts under a lower dtype's rounding) is no error of the block's, and the router's own replay
judges its logits. A choice its logits do not explain (a top-k kernel gone wrong) is not forced:
the block replayed with the golden module's own routing shows it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmflow.dump.config import DumpConfig
from llmflow.dump.run import dump_run
from llmflow.formats import open_dump
from llmflow.localize.moe import choice_follows_logits
from llmflow.localize.target_dump import recorded_outputs, replay_target_dump
from llmflow.models import encode_prompt, load_model

SPEC = "tiny-qwen3-moe:layers=2,seed=5"
BLOCK = "model.layers.1.mlp"


def _gate_seen(lm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate's input of the first token and its logits and choice, in a golden run."""
    seen = {}
    gate = lm.model.get_submodule(BLOCK).gate
    def keep(_m, args, out) -> None:
        seen.setdefault("call", (args[0], out))
    handle = gate.register_forward_hook(keep)
    with torch.no_grad():
        lm.model(torch.tensor([encode_prompt(lm.tokenizer, "Tell me a story.")]))
    handle.remove()
    x, (logits, _weights, index) = seen["call"]
    first = [t.reshape(-1, t.shape[-1])[0] for t in (x, logits, index)]
    return first[0], first[1], first[2]


def _nudged_router(lm) -> None:
    """The first token's weakest chosen expert loses to the best other one by a hair: its logits
    move a little (as rounding moves near-tied logits), the choice follows them."""
    x, logits, index = _gate_seen(lm)
    other = max((e for e in range(logits.shape[-1]) if e not in index.tolist()), key=lambda e: logits[e])
    gap = float(logits[index].min() - logits[other])
    with torch.no_grad():
        lm.model.get_submodule(BLOCK).gate.weight[other] += (gap + 1e-3) * x / x.dot(x)


def _swapped_choice(lm) -> None:
    """The first token sent to an expert its logits did not choose, its logits untouched."""
    gate = lm.model.get_submodule(BLOCK).gate

    def swap(_m, _args, out):
        logits, weights, index = out
        flat = index.reshape(-1, index.shape[-1]).clone()
        flat[0, 0] = next(e for e in range(logits.shape[-1]) if e not in flat[0].tolist())
        return logits, weights, flat.reshape(index.shape)
    gate.register_forward_hook(swap)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe-routing")
    for name, change in (("golden", None), ("nudged", _nudged_router), ("swapped", _swapped_choice)):
        lm = load_model(SPEC)
        if change is not None:
            change(lm)
        ids = encode_prompt(lm.tokenizer, "Tell me a story.")
        dump_run(lm, ids, 1, DumpConfig(dump_path=str(out / name), token_range="all", tensor_part=2))
    return out


def _block_row(dumps: Path, target: str, forced: bool) -> dict:
    golden, tgt = open_dump(str(dumps / "golden")), open_dump(str(dumps / target))
    rows = replay_target_dump(load_model(SPEC), golden, tgt, golden_step=0, target_step=0,
                              select=lambda name, _m: name == BLOCK,
                              routing=recorded_outputs(tgt, 0) if forced else None)
    return next(rows)


def test_a_choice_its_logits_explain_is_forced_and_the_block_errs_by_nothing(dumps: Path) -> None:
    own = _block_row(dumps, "nudged", forced=False)
    assert own.get("routing") is None
    assert own["rel_l2"] > 1e-3  # the golden router on the target's input routes the token elsewhere
    row = _block_row(dumps, "nudged", forced=True)
    assert row["routing"] == "target" and row["rel_l2"] < 1e-5, row


def test_a_choice_its_logits_do_not_explain_is_not_forced(dumps: Path) -> None:
    row = _block_row(dumps, "swapped", forced=True)
    assert row.get("routing") is None and row["rel_l2"] > 1e-3, row


def test_the_choice_is_checked_against_its_own_logits() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 5.0, 5.0, 1.0]])
    weights = torch.ones(2, 2)
    assert choice_follows_logits({"0": logits, "1": weights, "2": torch.tensor([[0, 2], [2, 1]])})
    assert not choice_follows_logits({"0": logits, "1": weights, "2": torch.tensor([[0, 1], [1, 2]])})
    assert choice_follows_logits({"0": logits})  # no choice recorded: the block chooses from the logits
    nothing_explains_it = {"1": weights, "2": torch.tensor([[0, 2], [2, 1]])}
    assert not choice_follows_logits(nothing_explains_it)
