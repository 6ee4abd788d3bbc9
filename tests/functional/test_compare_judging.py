"""Verdicts follow the model's compute dtype: a bf16 model's logits reach the dump upcast to fp32
and are judged at bf16 (the dtype its env.json records), --target-dtype overrides, and an unknown
dtype name is refused."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

from llmflow.cli import main
from llmflow.compare.match import Pair
from llmflow.compare.rows import judge_dtype
from llmflow.dump import DumpConfig, dump_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the area's helpers
from compare_helpers import entry  # noqa: E402
from dump_helpers import TINY, prompt_ids, tiny  # noqa: E402


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One prefill step (a single new token: no test may depend on where fp32 and bf16 texts part)
    of the tiny Llama in fp32, in bf16, and in bf16 with one projection scaled."""
    root = tmp_path_factory.mktemp("judging")
    out = {}
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        out[name] = root / name
        dump_run(tiny(TINY, dtype), prompt_ids("hello world"), 1, DumpConfig(dump_path=str(out[name]),
                                                                          token_range=[0]))
    lm = tiny(TINY, "bfloat16")
    w = lm.model.model.layers[1].mlp.down_proj.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w.mul_(4)
    try:
        out["bad"] = root / "bad"
        dump_run(lm, prompt_ids("hello world"), 1, DumpConfig(dump_path=str(out["bad"]), token_range=[0]))
    finally:
        with torch.no_grad():
            w.copy_(saved)
    return out


def compare(tmp: Path, g: Path, t: Path, *extra: str) -> tuple[int, str, dict, list[dict[str, str]]]:
    out = tmp / "out"
    rc = main(["compare", "-gp", str(g), "-mp", str(t), "-o", str(out), "--no-xlsx", *extra])
    rows = list(csv.DictReader(open(out / "compare_logits.csv")))
    return rc, "", json.loads((out / "compare_summary.json").read_text()), rows


def test_bf16_logits_are_judged_at_the_model_dtype(tmp_path: Path, dumps, capsys) -> None:
    rc, _, summary, logits = compare(tmp_path, dumps["fp32"], dumps["bf16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert ("judged at bfloat16: the model dtype each dump records, else the dtype most of its outputs are "
            "in (golden float32 recorded and target bfloat16 recorded)") in out
    assert summary["judged_as"]["dtype"] == "bfloat16" and summary["judged_as"]["recorded"] == "bfloat16"
    # the logits are stored upcast (float32 on both sides), yet judged at bf16
    assert logits[0]["target_dtype"] == "float32" and logits[0]["verdict"] == "pass"
    # held to fp32's limits the same rounding is flagged, and the reason says at which dtype
    rc, _, summary, logits = compare(tmp_path, dumps["fp32"], dumps["bf16"], "--target-dtype", "float32")
    assert "judged at float32: given" in capsys.readouterr().out
    assert logits[0]["verdict"] != "pass" and logits[0]["reason"].endswith("(float32)")


def test_a_real_fault_in_a_bf16_model_still_fails(tmp_path: Path, dumps, capsys) -> None:
    rc, _, summary, _ = compare(tmp_path, dumps["fp32"], dumps["bad"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("FAILED:") and "first: model.layers.1.mlp.down_proj" in last
    assert summary["judged_as"]["dtype"] == "bfloat16" and summary["levels"]["module"]["counts"]["fail"] > 0


@pytest.mark.parametrize("name", ["float8", "fp8", "bfloat", "int3"])
def test_unknown_target_dtype_is_refused(tmp_path: Path, dumps, capsys, name: str) -> None:
    rc = main(["compare", "-gp", str(dumps["fp32"]), "-mp", str(dumps["bf16"]), "-o", str(tmp_path / "o"),
               "--target-dtype", name])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: --target-dtype: unknown dtype {name!r}")
    assert "known: float64, float32, float16, bfloat16, float8_e4m3fn" in err[0]
    assert not (tmp_path / "o").exists()


def test_the_judging_dtype_of_one_pair() -> None:
    def pair(g: str, t: str) -> Pair:
        return Pair(("module",), entry("x", dtype=g), (entry("x", dtype=t),), "name", 0, 0, 0)

    assert judge_dtype(pair("float32", "float32"), None, "bfloat16") == "bfloat16"  # upcast logits
    assert judge_dtype(pair("float32", "float8_e4m3fn"), None, "bfloat16") == "float8_e4m3fn"  # coarser
    assert judge_dtype(pair("float32", "float32"), None, None) == "float32"  # nothing recorded
    assert judge_dtype(pair("int64", "int64"), None, "bfloat16") == "integer"  # ids stay exact
    assert judge_dtype(pair("float32", "bfloat16"), "float16", "bfloat16") == "float16"  # given wins
