"""The built-in torch_npu references against torch's own ops, the registry's lookup order, and
the precheck's judging rules on hand-made outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmflow.checks import references as R
from llmflow.checks.precheck import judge_output


def test_npu_references_match_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    w = torch.randn(16, generator=g, dtype=torch.float64)
    y, rstd = R.npu_rms_norm(x, w, 1e-5)
    assert torch.allclose(y, F.rms_norm(x, (16,), w, 1e-5)) and rstd.shape == (2, 5, 1)
    assert torch.allclose(R.npu_swiglu(x), F.silu(x[..., :8]) * x[..., 8:])
    cos, sin = (torch.randn(5, 16, generator=g, dtype=torch.float64) for _ in range(2))
    rot = torch.cat((-x[..., 8:], x[..., :8]), -1)
    assert torch.allclose(R.npu_rotary_mul(x, cos, sin), x * cos + rot * sin)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)  # true: masked out
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          is_causal=True)
    got = R.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask, scale=8 ** -0.5)[0]
    assert torch.allclose(got, want)
    bsh = R.npu_incre_flash_attention(q[:, :, -1:].transpose(1, 2).reshape(1, 1, 32),
                                      k.transpose(1, 2).reshape(1, 6, 16),
                                      v.transpose(1, 2).reshape(1, 6, 16),
                                      num_heads=4, num_key_value_heads=2, scale_value=8 ** -0.5)
    assert torch.allclose(bsh.reshape(1, 1, 4, 8).transpose(1, 2), want[:, :, -1:])


def test_lookup_order_and_random_calls():
    ids = [torch.zeros(2, dtype=torch.long)]
    assert R.resolve("embedding", ids, {})[1] == "torch.nn.functional.embedding"
    assert R.resolve("to", [torch.zeros(2)], {})[1] == "Tensor.to"
    assert R.resolve("npu_swiglu", [], R.BUILTIN)[0] is R.npu_swiglu
    assert R.resolve("my_kernel", [torch.zeros(2)], {})[0] is None
    assert R.is_random("dropout", [torch.zeros(2), 0.1, True], {})
    assert not R.is_random("dropout", [torch.zeros(2)], {"p": 0.1, "training": False})


def test_judging_rules():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(1000, generator=g, dtype=torch.float64)
    bench = ref.to(torch.bfloat16)
    assert judge_output(bench.clone(), bench, ref).status == "pass"
    coarse = ref.to(torch.float8_e4m3fn).to(torch.bfloat16)  # 3 mantissa bits in a bf16 tensor
    assert judge_output(coarse, bench, ref).status == "fail"
    one_bad = bench.clone()
    one_bad[7] = float("nan")
    assert "NaN/Inf" in judge_output(one_bad, bench, ref).reasons[0]
    ints = torch.arange(5)
    assert judge_output(ints, ints, ints.double()).status == "pass"
    assert judge_output(ints + (ints == 3), ints, ints.double()).status == "fail"
