"""``--kl logits``: the KL divergence for the logits rows only, run the user's way. Every other
cell of every CSV stays the same as the default compare's (the compiled kernel skips the softmax
sums and nothing else), the other rows leave the column empty, the verdict does not move; the
``compare_dumps`` workflow takes it as ``--set kl=logits``; a value it does not know, or KL limits
with it, is bad input; dumps with no logits rows are told no row got a KL."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_helpers import as_dump  # noqa: E402
from workflow_helpers import llmflow  # noqa: E402

from llmflow import native  # noqa: E402
from llmflow.compare import kernels  # noqa: E402
from llmflow.compare.metrics import compare_tensors  # noqa: E402


def read_csvs(folder: Path) -> dict[str, list[dict[str, str]]]:
    return {p.name: list(csv.DictReader(io.StringIO(p.read_text()))) for p in sorted(folder.glob("*.csv"))}


def assert_kl_only_on_logits(default: dict, logits_only: dict) -> None:
    assert default.keys() == logits_only.keys() and "compare_logits.csv" in default and len(default) > 1
    for name, rows in default.items():
        other = logits_only[name]
        assert len(rows) == len(other) > 0, name
        for full, lean in zip(rows, other, strict=True):
            if name == "compare_logits.csv":
                assert lean == full
                assert float(lean["kl_divergence"]) >= 0
            else:
                assert lean["kl_divergence"] == "" and full["kl_divergence"] != ""
                assert {k: v for k, v in lean.items() if k != "kl_divergence"} == \
                    {k: v for k, v in full.items() if k != "kl_divergence"}


def outlier(layer: int, x: torch.Tensor) -> torch.Tensor:
    """One element 200 off in layer 1 (and, through the residual, after it): beyond the range of
    the kernel's float32 softmax, so its rows are redone in float64 with the KL and without it."""
    if layer != 1:
        return x
    x = x.clone()
    x.view(-1)[3] += 200.0
    return x


@pytest.mark.parametrize("fault", ["noise", "layer", "outlier"])
def test_the_cli_leaves_kl_empty_but_on_logits_and_every_other_cell_the_same(tmp_path, fault):
    as_dump(tmp_path, "golden", steps=[0, 1, 2])
    if fault == "noise":
        as_dump(tmp_path, "target", steps=[0, 1, 2], noise=1e-5)
    elif fault == "layer":
        as_dump(tmp_path, "target", steps=[0, 1, 2], fault=lambda layer, x: x * 1.5 if layer == 2 else x)
    else:
        as_dump(tmp_path, "target", steps=[0, 1, 2], fault=outlier)
    runs = {}
    for kl in ("all", "logits"):
        args = ["compare", "-gp", "golden", "-mp", "target", "-o", f"out_{kl}", "--no-xlsx"]
        runs[kl] = llmflow(*(args if kl == "all" else [*args, "--kl", kl]), cwd=tmp_path)
        assert runs[kl].returncode in (0, 1) and "Traceback" not in runs[kl].stderr, runs[kl].stderr
    assert runs["all"].returncode == runs["logits"].returncode == (0 if fault == "noise" else 1)
    assert runs["all"].stdout.splitlines()[-1] == runs["logits"].stdout.splitlines()[-1]
    assert_kl_only_on_logits(read_csvs(tmp_path / "out_all"), read_csvs(tmp_path / "out_logits"))
    for kl in ("all", "logits"):
        summary = json.loads((tmp_path / f"out_{kl}" / "compare_summary.json").read_text())
        assert summary["logits"]["mean_kl_divergence"] is not None


def test_the_compare_dumps_workflow_takes_kl_logits(tmp_path):
    as_dump(tmp_path, "gpu_dump")
    as_dump(tmp_path, "npu_dump", noise=1e-3)
    runs = {}
    for kl in ("all", "logits"):
        runs[kl] = llmflow("run", "compare_dumps", "--set", "golden_dump=gpu_dump", "--set",
                           "target_dump=npu_dump", "--set", f"kl={kl}", "--run-dir", f"run_{kl}",
                           cwd=tmp_path)
        assert runs[kl].returncode == 0, runs[kl].stdout + runs[kl].stderr
        assert runs[kl].stdout.strip().splitlines()[-1].startswith("PASSED")
    (full_dir,) = {p.parent for p in (tmp_path / "run_all").rglob("compare_logits.csv")}
    (lean_dir,) = {p.parent for p in (tmp_path / "run_logits").rglob("compare_logits.csv")}
    assert_kl_only_on_logits(read_csvs(full_dir), read_csvs(lean_dir))


def test_an_unknown_kl_value_is_bad_input(tmp_path):
    as_dump(tmp_path, "golden")
    as_dump(tmp_path, "target")
    done = llmflow("compare", "-gp", "golden", "-mp", "target", "-o", "out", "--kl", "none", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--kl" in done.stderr and "none" in done.stderr
    assert not (tmp_path / "out").exists()
    run = llmflow("run", "compare_dumps", "--set", "golden_dump=golden", "--set", "target_dump=target",
                  "--set", "kl=some", "--run-dir", "run", cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "kl" in run.stdout.strip().splitlines()[-1] + run.stderr


def test_kl_limits_with_kl_logits_are_bad_input_and_exponents_read_as_numbers(tmp_path):
    as_dump(tmp_path, "golden")
    as_dump(tmp_path, "target", noise=1e-5)
    limits = {form: f'{{"kl_divergence": {{"warn": {form}, "fail": {form}}}}}'
              for form in ("1e-15", "1.0e-15")}
    refused = llmflow("compare", "-gp", "golden", "-mp", "target", "-o", "out", "--kl", "logits",
                      "--thresholds", limits["1e-15"], cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stdout.strip().splitlines()[-1] == (
        "FAILED: --thresholds: kl_divergence limits judge every row, but --kl logits leaves the KL of "
        "every row but the logits empty: use --kl all, or drop the kl_divergence limits")
    assert not (tmp_path / "out").exists()
    # 1e-15 is a number, as JSON reads it (PyYAML alone reads text), and judges as 1.0e-15 does:
    # the KL limit fails a compare the default limits pass
    plain = llmflow("compare", "-gp", "golden", "-mp", "target", "-o", "plain", "--no-xlsx", cwd=tmp_path)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    last = {}
    for form, text in limits.items():
        done = llmflow("compare", "-gp", "golden", "-mp", "target", "-o", f"out_{form}", "--no-xlsx",
                       "--thresholds", text, cwd=tmp_path)
        assert done.returncode == 1, done.stdout + done.stderr
        last[form] = done.stdout.strip().splitlines()[-1]
        assert "threshold_fail" in last[form]
    assert last["1e-15"] == last["1.0e-15"]


def test_dumps_without_logits_rows_are_told_no_row_got_a_kl(tmp_path):
    as_dump(tmp_path, "golden", logits=False)
    as_dump(tmp_path, "target", logits=False, noise=1e-6)
    done = llmflow("compare", "-gp", "golden", "-mp", "target", "-o", "out", "--no-xlsx", "--kl", "logits",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("kl_divergence: none computed (--kl logits, and no row is at the logits level; --kl all gives "
            "every row's)") in done.stdout.splitlines()
    summary = json.loads((tmp_path / "out" / "compare_summary.json").read_text())
    assert summary["kl"] == "logits" and summary["logits"] is None
    default = llmflow("compare", "-gp", "golden", "-mp", "target", "-o", "out2", "--no-xlsx", cwd=tmp_path)
    assert "kl_divergence: none computed" not in default.stdout
    assert json.loads((tmp_path / "out2" / "compare_summary.json").read_text())["kl"] == "all"


def test_two_tensor_files_with_kl_logits_get_no_kl(tmp_path):
    from safetensors.torch import save_file

    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    save_file({"h": x}, str(tmp_path / "g.safetensors"))
    save_file({"h": x * 1.0001}, str(tmp_path / "t.safetensors"))
    for kl, has_value in (("all", True), ("logits", False)):
        done = llmflow("compare", "-gp", "g.safetensors", "-mp", "t.safetensors", "--kl", kl, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        (line,) = [x for x in done.stdout.splitlines() if "kl_divergence" in x]
        assert any(ch.isdigit() for ch in line) == has_value, line


def test_the_python_api_refuses_an_unknown_kl(tmp_path):
    from llmflow.compare.options import CompareOptions
    from llmflow.compare.run import compare_dumps
    from llmflow.errors import UserError

    g, t = as_dump(tmp_path, "golden"), as_dump(tmp_path, "target")
    with pytest.raises(UserError, match="compare: kl: expected one of all, logits, got 'LOGITS'"):
        compare_dumps(g, t, tmp_path / "out", CompareOptions(kl="LOGITS"))
    assert not (tmp_path / "out").exists()


def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """fp32 and bf16 pairs with small and large differences (each form of the kernel's second
    loop), several rows and a tail, one with a NaN (the rows redone on eager torch)."""
    gen = torch.Generator().manual_seed(3)
    n = 3 * kernels.FUSED_CHUNK + 17
    g = torch.randn(n, generator=gen) * 2
    small, medium, large = (g + s * torch.randn(n, generator=gen) for s in (1e-3, 0.2, 3.0))
    with_nan = small.clone()
    with_nan[kernels.FUSED_CHUNK + 5] = float("nan")
    return [(g, small), (g, medium), (g, large), (g.bfloat16(), small.bfloat16()), (g, large.bfloat16()),
            (g, with_nan), (g[:1001], small[:1001])]


def test_every_build_gives_the_same_bits_without_the_kl():
    builds = [t for t in native.supported_targets()]
    checked = 0
    for target in builds:
        kernel = kernels.for_target(target)
        if kernel is None:
            continue
        checked += 1
        for a, b in pairs():
            if a.isnan().any() or b.isnan().any():
                continue
            full, lean = kernel(a, b), kernel(a, b, softmax=False)
            assert not lean[kernels.SOFTMAX_VALUES].any()
            keep = torch.ones(kernels.N_VALUES, dtype=torch.bool)
            keep[kernels.SOFTMAX_VALUES] = False
            assert torch.equal(lean[keep], full[keep]), target.name
    if not checked:
        pytest.skip("no compiled compare kernel on this machine")


@pytest.mark.parametrize("path", ["compiled", "eager"])
def test_compare_tensors_without_kl_changes_that_column_only(path, monkeypatch):
    if path == "eager":
        monkeypatch.setattr(kernels, "_fused", False)
    elif kernels.fused() is None:
        pytest.skip("no compiled compare kernel on this machine")
    for a, b in pairs():
        full, lean = compare_tensors(a, b), compare_tensors(a, b, kl=False)
        assert lean["kl_divergence"] is None and full["kl_divergence"] >= 0
        assert {k: v for k, v in lean.items() if k != "kl_divergence"} == \
            {k: v for k, v in full.items() if k != "kl_divergence"}
