"""``W8A8Linear.account``: a static W8A8 layer's own error split into its activation clip, its
activations' int8 rounding and its weight part, held up to what rounding the float weight to its
int8 grid gives. A layer quantized the way msModelSlim's static W8A8 does (per-channel weight scale,
per-tensor input scale from a calibration input) is explained on an input like its calibration's;
one whose input reaches far past the calibrated range clips too much to be; one with a channel of
its int8 weight negated has a weight part many times its rounding (a wrong weight)."""

from __future__ import annotations

import pytest
import torch

from llmflow.quantized import CLIP_EXPLAINED_SHARE, WEIGHT_ROUNDING_LIMIT, W8A8Linear


def _quantized(w: torch.Tensor, b: torch.Tensor, calibration: torch.Tensor) -> W8A8Linear:
    weight_scale = w.abs().amax(dim=1) / 127
    wq = torch.round(w / weight_scale[:, None]).clamp(-128, 127)
    input_scale = calibration.abs().max() / 127
    deq_scale = input_scale * weight_scale
    tensors = {"input_scale": input_scale.reshape(1), "input_offset": torch.zeros(1),
               "deq_scale": deq_scale.to(torch.float32),
               "quant_bias": torch.round(b / deq_scale).to(torch.int32),
               "weight_scale": weight_scale.reshape(-1, 1)}
    return W8A8Linear("W8A8", wq.to(torch.int8), tensors, None)


@pytest.fixture
def layer() -> tuple[W8A8Linear, torch.nn.Linear, torch.Generator]:
    gen = torch.Generator().manual_seed(0)
    float_layer = torch.nn.Linear(64, 32)
    with torch.no_grad():
        float_layer.weight.copy_(torch.randn(32, 64, generator=gen) * 0.1)
        float_layer.bias.copy_(torch.randn(32, generator=gen) * 0.01)
    calibration = torch.randn(16, 64, generator=gen)
    return _quantized(float_layer.weight.detach(), float_layer.bias.detach(), calibration), float_layer, gen


def test_an_input_like_the_calibrations_is_explained_by_the_quantization(layer):
    quant, float_layer, gen = layer
    x = torch.randn(8, 64, generator=gen) * 0.9
    account = quant.account(x, float_layer(x).detach())
    assert account.clipped == 0 and account.explained, account.words()
    assert 0.3 < account.weight_ratio < WEIGHT_ROUNDING_LIMIT, account.words()
    assert account.error > 0 and account.rounding > 0


def test_an_input_far_past_the_calibrated_range_clips_too_much_to_be_explained(layer):
    quant, float_layer, gen = layer
    x = torch.randn(8, 64, generator=gen) * 8
    account = quant.account(x, float_layer(x).detach())
    assert account.clipped_share > CLIP_EXPLAINED_SHARE and not account.explained, account.words()
    assert account.clip > account.rounding


def test_a_negated_int8_channel_is_a_wrong_weight_never_the_quantizations(layer):
    quant, float_layer, gen = layer
    with torch.no_grad():
        quant.weight[3] = -quant.weight[3]
    x = torch.randn(8, 64, generator=gen) * 0.9
    account = quant.account(x, float_layer(x).detach())
    assert account.weight_wrong and not account.explained, account.words()
    assert account.weight_ratio > 2 * WEIGHT_ROUNDING_LIMIT
