"""The example faults that break one expert reach the routed experts' output projection, never a
shared expert's, whatever the family calls its parts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from example_faults import scale_expert  # noqa: E402

from llmflow.models import build_tiny  # noqa: E402

#: family -> the parameter scale_expert changes in layer 1
ROUTED = {"mixtral": "model.layers.1.mlp.experts.down_proj",
          "deepseek-v3": "model.layers.1.mlp.experts.down_proj",  # beside its shared_experts
          "llama4": "model.layers.1.feed_forward.experts.down_proj",  # beside its shared_expert
          "granite-moe": "model.layers.1.block_sparse_moe.experts.down_proj"}


@pytest.mark.parametrize("family", list(ROUTED))
def test_scale_expert_scales_one_routed_experts_output_weights(family: str) -> None:
    golden = build_tiny(family, "layers=2,hidden=64,intermediate=128,seed=2")
    target = build_tiny(family, "layers=2,hidden=64,intermediate=128,seed=2")
    scale_expert(1, expert=1)(target)
    pairs = zip(golden.named_parameters(), target.named_parameters(), strict=True)
    changed = [name for (name, p), (_, q) in pairs if not torch.equal(p, q)]
    assert changed == [ROUTED[family]], changed
    before, after = golden.get_parameter(changed[0]), target.get_parameter(changed[0])
    assert torch.equal(after[1], before[1] * 1.5) and torch.equal(after[0], before[0])
