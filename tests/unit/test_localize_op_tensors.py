"""The first bad op's tensors the bisect keeps: the golden op it was compared with (an op only the
target runs is compared with the value it rewrites), its output and small inputs on both sides,
a strided sample past the budget (the same elements on both sides), and the file they are written
to read back by ``llmflow inspect`` as a user runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llmflow.dump.memory import OpCall
from llmflow.localize.ops import op_tensors, paired_op

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from workflow_helpers import assert_bad_input, llmflow  # noqa: E402


def _op(name: str, out: torch.Tensor, *inputs: torch.Tensor) -> OpCall:
    api = name.rsplit("/", 1)[1].rsplit(".", 1)[0]
    return OpCall(name=name, api=api, func=getattr(torch, api, torch.mul), args=inputs, kwargs={}, output=out)


def test_an_op_only_the_target_runs_is_paired_with_the_value_it_rewrites():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    y = x @ w.T
    golden = [_op("m/linear.0", y, x, w)]
    target = [_op("m/linear.0", y.bfloat16(), x.bfloat16(), w.bfloat16()),
              _op("m/mul.0", 3 * y.bfloat16(), y.bfloat16())]
    g, t = paired_op(golden, target, "m/mul.0")
    assert g is golden[0] and t is target[1]
    assert paired_op(golden, target, "m/linear.0") == (golden[0], target[0])
    assert paired_op(golden, target, "m/exp.0") == (None, None)


def test_small_ops_keep_inputs_and_big_outputs_are_sampled_alike_on_both_sides(tmp_path):
    x = torch.randn(64, 64)
    g = _op("m/exp.0", x.exp(), x)
    t = _op("m/exp.0", x.bfloat16().exp(), x.bfloat16())
    tensors, sampled, notes = op_tensors(g, t)
    assert sorted(tensors) == ["golden.input.0", "golden.output.0", "target.input.0", "target.output.0"]
    assert sampled == [] and notes == [] and tensors["target.output.0"].dtype == torch.bfloat16
    assert torch.equal(tensors["golden.output.0"], x.exp())
    # past the budget: 64x64 float32 is 16 KiB; 4 KiB keep every 4th element, on both sides
    tensors, sampled, notes = op_tensors(g, t, max_bytes_per_side=4096)
    assert sampled == ["golden.output.0", "target.output.0"]
    assert tensors["golden.output.0"].shape == tensors["target.output.0"].shape == (1024,)
    assert torch.equal(tensors["golden.output.0"], x.exp().reshape(-1)[::4])
    assert "golden.input.0" not in tensors and any("every 4th element" in n for n in notes)
    save_file(tensors, str(tmp_path / "sampled.safetensors"))  # (a strided sample is written packed)
    assert any("inputs are not kept" in n for n in notes)
    # one input passed twice shares storage: each key is a copy of its own, so the file writes
    same = _op("m/mul.0", x * x, x, x)
    kept, _, _ = op_tensors(same, same)
    save_file(kept, str(tmp_path / "op.safetensors"))
    assert torch.equal(load_file(str(tmp_path / "op.safetensors"))["target.input.1"], x)


def test_inspect_reads_a_plain_safetensors_file(tmp_path):
    path = tmp_path / "first_bad_op.safetensors"
    save_file({"golden.output.0": torch.arange(6.0).reshape(2, 3), "target.output.0": torch.ones(2, 3)},
              str(path), metadata={"op": "model.layers.1.mlp/mul.0", "step": "2"})
    listed = llmflow("inspect", str(path))
    assert listed.returncode == 0, listed.stderr
    assert "golden.output.0: F32 [2, 3]" in listed.stdout and "op model.layers.1.mlp/mul.0" in listed.stdout
    shown = llmflow("inspect", str(path), "golden.output.0")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.strip().splitlines()
    assert "(step 2," in lines[0] and "op model.layers.1.mlp/mul.0" in lines[0]
    assert "shape [2, 3]" in shown.stdout and "max=5" in shown.stdout
    assert lines[-1].startswith("PASSED")
    assert_bad_input(llmflow("inspect", str(path), "golden.output.9"), str(path), "golden.output.9")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    assert_bad_input(llmflow("inspect", str(junk), "x"), str(junk), "not a readable safetensors file")
