"""``llmflow precheck`` on API dumps a user's own script makes (``register_hook``, never
``remove()``), the two ways a PASSED would overstate what was checked:

* the port's own kernel, a ``torch.library`` op named like a torch function (``ported::rms_norm``,
  wrong eps): it is recorded with its namespace, never replayed as ``F.rms_norm``, and without a
  reference the precheck is INCONCLUSIVE naming the ``--reference`` to give; given one, it fails;
* a dump without ``dump_weight``: every matmul unchecked, INCONCLUSIVE naming ``dump_weight=True``;
  the same clean model dumped with its weights passes."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from path_helpers import checkout_path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from llmflow import DumpConfig, register_hook

out, fault, weights = sys.argv[1], sys.argv[2] == "fault", sys.argv[3] == "weights"


@torch.library.custom_op("ported::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 0.5)  # the kernel's bug: eps fixed at 0.5
    return (weight * h.to(x.dtype))


torch.manual_seed(0)
config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
if fault:
    norm = model.model.layers[1].post_attention_layernorm
    norm.forward = lambda x: torch.ops.ported.rms_norm(x, norm.weight, norm.variance_epsilon)
register_hook(model, DumpConfig(dump_path=out, mode="api", token_range=[0, 1], dump_weight=weights))
ids = torch.tensor([[1, 5, 9, 33, 70, 12]])
with torch.no_grad():
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
"""
REFERENCE = """
import torch


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("user_kernels")
    (out / "port.py").write_text(SCRIPT, encoding="utf-8")
    (out / "reference.py").write_text(REFERENCE, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": checkout_path(REPO)}
    for name, fault, weights in (("kernel", "fault", "weights"), ("no_weights", "clean", "none"),
                                 ("clean", "clean", "weights")):
        proc = subprocess.run([sys.executable, "port.py", name, fault, weights], capture_output=True,
                              text=True, timeout=300, cwd=out, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def precheck(dumps: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = dumps / f"precheck_{name}_{len(extra)}"
    proc = subprocess.run([sys.executable, "-m", "llmflow", "precheck", name, "-o", str(out), *extra],
                          capture_output=True, text=True, timeout=300, cwd=dumps,
                          env={**os.environ, "PYTHONPATH": checkout_path(REPO)})
    return proc, out


def rows(out: Path) -> list[dict[str, str]]:
    with open(out / "precheck.csv", newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_a_ported_kernel_without_a_reference_is_inconclusive_never_replayed_as_torchs(dumps):
    proc, out = precheck(dumps, "kernel")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert lines[-1].startswith("INCONCLUSIVE") and "ported::rms_norm" in lines[-1], lines[-1]
    assert any(ln.startswith("next:") and "--reference ported::rms_norm=" in ln for ln in lines), lines
    kernel = [r for r in rows(out) if r["api"] == "ported::rms_norm"]
    assert kernel and all(r["status"] == "not checked" for r in kernel), kernel
    assert not any(r["implementation"] == "torch.nn.functional.rms_norm" for r in rows(out))


def test_the_ported_kernel_given_a_reference_fails(dumps):
    proc, _out = precheck(dumps, "kernel", "--reference", "ported::rms_norm=reference.py:rms_norm")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last.startswith("FAILED") and "post_attention_layernorm/ported::rms_norm.0" in last, last


def test_a_dump_without_weights_is_inconclusive_and_asks_for_them(dumps):
    proc, _out = precheck(dumps, "no_weights")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert lines[-1].startswith("INCONCLUSIVE") and "the dump holds no weights" in lines[-1], lines[-1]
    assert any(ln.startswith("next:") and "dump_weight=True" in ln for ln in lines), lines


def test_the_same_clean_model_dumped_with_its_weights_passes(dumps):
    proc, _out = precheck(dumps, "clean")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED")


def test_a_rank_folder_given_to_precheck_names_the_dump_without_a_flag_precheck_lacks(dumps):
    proc, out = precheck(dumps, "clean/llmflow_dump/rank0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert f"inside the llmflow dump {dumps / 'clean' / 'llmflow_dump'}: give the dump itself" in last, last
    assert "compare takes one rank with -r/--rank N" in last, last  # (precheck has no -r: it reads them all)
    assert not out.exists()
