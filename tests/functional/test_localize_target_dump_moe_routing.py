"""An MoE block replayed from a target dump gets the routing the target chose where it differs from
the golden router's own, on the same input, as rounding's near ties do: a token sent to a near-tied
expert is no error of the block's, and the router's own replay judges its logits. A routing that
differs otherwise (routing weights not normalised, many tokens sent elsewhere: a top-k or a bias
gone wrong) is not forced: the block replayed with the golden router's routing shows it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmflow.dump.config import DumpConfig
from llmflow.dump.run import dump_run
from llmflow.formats import open_dump
from llmflow.localize.moe import rounding_flips
from llmflow.localize.target_dump import replay_target_dump
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
    """The first token's weakest chosen expert loses to the best other one by a hair in the router's
    own arithmetic (as rounding moves a near tie): its input moves a little along the two experts'
    weight difference, for the router alone; the other tokens route and weigh as the golden's."""
    _x, logits, index = _gate_seen(lm)
    gate = lm.model.get_submodule(BLOCK).gate
    weakest = int(index[logits[index].argmin()])
    other = max((e for e in range(logits.shape[-1]) if e not in index.tolist()), key=lambda e: logits[e])
    direction = (gate.weight[other] - gate.weight[weakest]).detach()
    step = (float(logits[weakest] - logits[other]) + 1e-3) * direction / direction.dot(direction)

    def nudge(_m, args):
        hidden = args[0].clone()
        hidden.reshape(-1, hidden.shape[-1])[0] += step
        return (hidden, *args[1:])
    gate.register_forward_pre_hook(nudge)


def _unnormalised_weights(lm) -> None:
    """The routing weights left as the softmax gives them, not renormalised over the chosen experts
    (a port that forgot the division): the choice is the golden's."""
    gate = lm.model.get_submodule(BLOCK).gate

    def unnormalised(_m, _args, out):
        logits, weights, index = out
        return logits, weights * 0.6, index
    gate.register_forward_hook(unnormalised)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe-routing")
    changes = (("golden", None), ("nudged", _nudged_router), ("unnormalised", _unnormalised_weights))
    for name, change in changes:
        lm = load_model(SPEC)
        if change is not None:
            change(lm)
        ids = encode_prompt(lm.tokenizer, "Tell me a story.")
        dump_run(lm, ids, 1, DumpConfig(dump_path=str(out / name), token_range="all", tensor_part=2))
    return out


def _block_row(dumps: Path, target: str, routing: bool) -> dict:
    golden, tgt = open_dump(str(dumps / "golden")), open_dump(str(dumps / target))
    rows = replay_target_dump(load_model(SPEC), golden, tgt, golden_step=0, target_step=0,
                              select=lambda name, _m: name == BLOCK, routing=routing)
    return next(rows)


def test_a_near_tie_routed_otherwise_is_forced_and_the_block_errs_by_nothing(dumps: Path) -> None:
    own = _block_row(dumps, "nudged", routing=False)
    assert own.get("routing") is None
    assert own["rel_l2"] > 1e-3  # the golden router on the target's input routes the token elsewhere
    row = _block_row(dumps, "nudged", routing=True)
    assert row["routing"] == "target" and row["rel_l2"] < 1e-5, row
    assert row["own_routing_rel_l2"] == pytest.approx(own["rel_l2"])


def test_routing_weights_computed_otherwise_are_not_forced(dumps: Path) -> None:
    row = _block_row(dumps, "unnormalised", routing=True)
    assert row.get("routing") is None and row["rel_l2"] > 0.1, row


def _outputs(index: list[list[int]], weights: list[list[float]]) -> dict[str, torch.Tensor]:
    return {"0": torch.zeros(len(index), 8), "1": torch.tensor(weights), "2": torch.tensor(index)}


def test_rounding_flips_are_few_tokens_with_their_weights_matching() -> None:
    tokens = 40
    golden = _outputs([[0, 1]] * tokens, [[0.6, 0.4]] * tokens)
    one = _outputs([[0, 2]] + [[0, 1]] * (tokens - 1), [[0.6, 0.4]] * tokens)
    assert rounding_flips(golden, one, "bfloat16")
    assert not rounding_flips(golden, golden, "bfloat16")  # nothing to force
    # many tokens elsewhere: a bias or a top-k gone wrong
    many = _outputs([[0, 2]] * 5 + [[0, 1]] * (tokens - 5), [[0.6, 0.4]] * tokens)
    assert not rounding_flips(golden, many, "bfloat16")
    reweighted = _outputs([[0, 2]] + [[0, 1]] * (tokens - 1), [[0.5, 0.5]] * tokens)
    assert not rounding_flips(golden, reweighted, "bfloat16")
    assert rounding_flips(golden, _outputs([[0, 2]] + [[0, 1]] * (tokens - 1), [[0.601, 0.4]] * tokens),
                          "bfloat16")  # within bf16's rounding
