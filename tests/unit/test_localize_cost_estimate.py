"""The full API-dump estimate of both sides of a dtype port from one run of the target: the
golden's bytes counted from the target's ops at the golden's dtype size (casts between the two
dropped) match what the golden's own run counts."""

from __future__ import annotations

import pytest
import torch

from llmflow.localize.cost import api_dump_estimates, estimate_api_dump_bytes
from llmflow.models import load_model

SIZE = "layers=4,hidden=64,intermediate=128,seed=3"
PROMPT = [1, 5, 9, 3, 7, 8]


@pytest.mark.parametrize(("family", "within"), [("llama", 0.0), ("qwen2", 0.0), ("gpt2", 0.0),
                                                ("gemma2", 0.01), ("mixtral", 0.05)])
def test_the_golden_estimate_from_the_bf16_targets_run_matches_the_fp32_goldens_own(family, within):
    """Exact on dense families; an MoE's routing differs between the dtypes (which experts run on
    how many tokens), so there it is within a few percent."""
    golden = load_model(f"tiny-{family}:{SIZE}")
    target = load_model(f"tiny-{family}:{SIZE}", dtype="bfloat16")
    own = estimate_api_dump_bytes(golden.model, PROMPT, 6)
    as_target, as_golden = api_dump_estimates(target.model, PROMPT, 6, [None, torch.float32])
    assert abs(as_golden["total_bytes"] - own["total_bytes"]) <= within * own["total_bytes"]
    assert as_target == estimate_api_dump_bytes(target.model, PROMPT, 6)
    assert as_target["total_bytes"] < as_golden["total_bytes"]  # the bf16 tensors at half the size


def test_the_same_dtype_counts_as_the_model_itself():
    target = load_model(f"tiny-llama:{SIZE}", dtype="bfloat16")
    itself, same = api_dump_estimates(target.model, PROMPT, 3, [None, torch.bfloat16])
    assert itself == same and itself["total_bytes"] > 0
