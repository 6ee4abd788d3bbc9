"""The built-in references of ATB operations against torch's own functions, for each parameter
the model json may carry; modes they do not compute raise UnsupportedArguments (the operation is
then listed as not checked, never judged against a wrong reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmflow.checks.references import (
    UnsupportedArguments,
    atb_activation,
    atb_elewise,
    atb_linear,
    atb_rms_norm,
    atb_rope,
    atb_softmax,
    resolve,
)

g = torch.Generator().manual_seed(0)
X = torch.randn(3, 8, generator=g, dtype=torch.float64)
Y = torch.randn(3, 8, generator=g, dtype=torch.float64)


def test_linear_transposes_and_bias():
    w, bias = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    assert torch.allclose(atb_linear(X, w, param={})[0], X @ w.T)
    assert torch.allclose(atb_linear(X, w, bias, param={"hasBias": True})[0], X @ w.T + bias)
    assert torch.allclose(atb_linear(X, w.T.contiguous(), param={"transposeB": False})[0], X @ w.T)
    assert atb_linear(X.half(), w.half(), param={"outDataType": 27})[0].dtype == torch.bfloat16
    with pytest.raises(UnsupportedArguments):
        atb_linear(X, w, torch.ones(5), param={})  # a fourth input: a quantisation scale


def test_rms_norm_epsilon_default_and_layer_types():
    gamma = torch.rand(8, dtype=torch.float64)
    expected = X * torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + 1e-3) * gamma
    assert torch.allclose(atb_rms_norm(X, gamma, param={"normParam": {"epsilon": 1e-3}})[0], expected)
    default = X * torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
    assert torch.allclose(atb_rms_norm(X, gamma, param={})[0], default)
    with pytest.raises(UnsupportedArguments, match="layerType 2"):
        atb_rms_norm(X, gamma, param={"layerType": 2})


@pytest.mark.parametrize(("kind", "expected"), [
    (3, torch.cos(X)), (5, -X), (8, X + Y), (9, X * Y), (10, X / Y), (15, X - Y), (20, torch.tanh(X)),
    (13, (X < Y).to(torch.int8)), (16, (X == Y).to(torch.int8)), (2, X * 0.5)])
def test_elewise_types(kind, expected):
    out = atb_elewise(X, Y, param={"elewiseType": kind, "mulsParam": {"varAttr": 0.5}})[0]
    assert out.dtype == expected.dtype and torch.allclose(out.double(), expected.double())


def test_elewise_cast_keeps_float64_in_the_reference_run():
    assert atb_elewise(X.half(), param={"elewiseType": 1, "outTensorType": 0})[0].dtype == torch.float32
    assert atb_elewise(X, param={"elewiseType": 1, "outTensorType": 1})[0].dtype == torch.float64
    assert atb_elewise(X, param={"elewiseType": 1, "outTensorType": 3})[0].dtype == torch.int32
    with pytest.raises(UnsupportedArguments, match="elewiseType 19"):
        atb_elewise(X, param={"elewiseType": 19})


@pytest.mark.parametrize(("param", "expected"), [
    ({"activationType": 1}, F.relu(X)), ({"activationType": 2}, F.gelu(X, approximate="tanh")),
    ({"activationType": 2, "geluMode": 1}, F.gelu(X)), ({"activationType": 4, "scale": 1.0}, F.silu(X)),
    ({"activationType": 6}, F.silu(X[:, :4]) * X[:, 4:])])
def test_activation_types(param, expected):
    assert torch.allclose(atb_activation(X, param=param)[0], expected)


def test_softmax_over_one_axis_and_consecutive_axes():
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert torch.allclose(atb_softmax(x, param={"axes": [1]})[0], torch.softmax(x, 1))
    joint = torch.softmax(x.reshape(2, 12), -1).reshape(2, 3, 4)
    assert torch.allclose(atb_softmax(x, param={"axes": [1, 2]})[0], joint)
    with pytest.raises(UnsupportedArguments):
        atb_softmax(x, param={"axes": [0, 2]})


def test_rope_rotates_each_head_by_half():
    q = torch.randn(3, 2 * 4, dtype=torch.float64)
    angle = torch.randn(3, 2, dtype=torch.float64)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    out_q, out_k = atb_rope(q, q, cos, sin, torch.tensor([3]), param={"rotaryCoeff": 2})
    heads = q.reshape(3, 2, 4)
    rotated = torch.cat((-heads[..., 2:], heads[..., :2]), -1)
    assert torch.allclose(out_q, (heads * cos[:, None] + rotated * sin[:, None]).reshape(3, 8))
    assert torch.equal(out_q, out_k)
    with pytest.raises(UnsupportedArguments):
        atb_rope(q, q, cos, sin, param={"rotaryCoeff": 4})


def test_an_atb_op_without_reference_is_named_as_such():
    fn, why = resolve("SelfAttentionOperation", [X], {}, "atb")
    assert fn is None and why.startswith("no reference for ATB op SelfAttentionOperation")
    assert resolve("softmax", [X], {}, "atb")[0] is None  # never torch's function of the same name
