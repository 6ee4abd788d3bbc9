"""Each metric of compare_tensors against an independent numpy computation, and the verdicts."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmflow import native
from llmflow.compare import metrics
from llmflow.compare.metrics import COLUMNS, compare_stats, compare_tensors, judge, verdict
from llmflow.compare.thresholds import dtype_class, resolve_thresholds
from llmflow.errors import UserError

EPS = np.finfo(np.float32).eps


def reference(g: np.ndarray, t: np.ndarray) -> dict[str, float]:
    """The msit definitions, written out plainly in float64 numpy."""
    g = g.astype(np.float64).ravel()
    t = t.astype(np.float64).ravel()
    d = t - g
    rel = np.where(np.abs(g) > EPS, np.abs(d) / np.where(np.abs(g) > EPS, np.abs(g), 1), 0.0)
    gn, tn = np.linalg.norm(g), np.linalg.norm(t)
    return {
        "cosine_similarity": float(g @ t / (gn * tn)),
        "max_relative_error": float(rel.max()),
        "mean_relative_error": float(rel.mean()),
        "max_absolute_error": float(np.abs(d).max()),
        "mean_absolute_error": float(np.abs(d).mean()),
        "relative_euclidean_distance": float(np.linalg.norm(d) / gn),
        "rmse": float(np.sqrt(np.mean(d * d))),
        "one_thousandth_err_ratio": float(np.mean(rel < 1e-3)),
        "five_thousandths_err_ratio": float(np.mean(rel < 5e-3)),
    }


def assert_side_stats(row: dict, g: np.ndarray, t: np.ndarray, rtol: float = 1e-6) -> None:
    """Each side's max, min, mean and norm over its finite elements (the mean to rtol of mean |x|:
    it may cancel to about zero)."""
    for side, x in (("golden", g), ("target", t)):
        x = x.astype(np.float64).ravel()
        x = x[np.isfinite(x)]
        assert row[f"{side}_max"] == pytest.approx(x.max(), rel=rtol), side
        assert row[f"{side}_min"] == pytest.approx(x.min(), rel=rtol), side
        assert row[f"{side}_norm"] == pytest.approx(np.linalg.norm(x), rel=rtol), side
        assert abs(row[f"{side}_mean"] - x.mean()) <= rtol * np.abs(x).mean(), side


def np_kl(g: np.ndarray, t: np.ndarray) -> float:
    """KL(softmax(g) || softmax(t)) over the flattened tensors."""
    g = g.astype(np.float64).reshape(1, -1)
    t = t.astype(np.float64).reshape(1, -1)

    def log_softmax(x: np.ndarray) -> np.ndarray:
        m = x.max(axis=-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))

    lg, lt = log_softmax(g), log_softmax(t)
    return float((np.exp(lg) * (lg - lt)).sum(-1).mean())


def assert_matches(row: dict, ref: dict, rtol: float = 1e-9) -> None:
    for k, v in ref.items():
        assert row[k] == pytest.approx(v, rel=rtol, abs=1e-12), k


@pytest.mark.parametrize("path", ["compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_metrics_match_numpy(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, path: str) -> None:
    """Both paths: the compiled kernel (fp32 element-wise, as the metrics are defined: to ~1e-7)
    and eager torch (float64 throughout)."""
    from llmflow.compare import kernels

    if path == "eager":
        monkeypatch.setattr(kernels, "_fused", False)
    elif kernels.fused() is None:
        pytest.skip("no compiled kernel here (no C++ compiler?)")
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 50, 70, generator=gen)
    t = (g + 0.01 * torch.randn(g.shape, generator=gen)).to(dtype)
    row = compare_tensors(g, t)
    gn, tn = g.numpy(), t.float().numpy()
    assert_matches(row, reference(gn, tn), rtol=1e-9 if path == "eager" else 1e-6)
    assert_side_stats(row, gn, tn, rtol=1e-9 if path == "eager" else 1e-6)
    assert row["kl_divergence"] == pytest.approx(np_kl(gn, tn), rel=1e-6)
    assert row["dtype_mismatch"] is (dtype != torch.float32)
    assert row["reason"] == "" and row["numel"] == g.numel()
    assert set(COLUMNS) <= set(row)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_equal_integer_tensors_take_the_exact_match_path(monkeypatch: pytest.MonkeyPatch,
                                                         dtype: torch.dtype) -> None:
    """Integer pairs equal element for element skip the eager pass and give its numbers."""
    g = torch.arange(-3, 40).reshape(1, -1).to(dtype)
    fast = compare_tensors(g, g.clone())
    monkeypatch.setattr(torch, "equal", lambda a, b: False)  # the general path, for reference
    slow = compare_tensors(g, g.clone())
    assert fast.keys() == slow.keys()
    for k, v in slow.items():
        assert fast[k] == (pytest.approx(v, rel=1e-12, abs=1e-15) if isinstance(v, float) else v), k
    assert fast["cosine_similarity"] == 1.0 and fast["kl_divergence"] == 0.0
    assert fast["one_thousandth_err_ratio"] == 1.0 and fast["max_absolute_error"] == 0.0
    off = g.clone()
    off[0, 5] = 0 if dtype == torch.bool else 99
    assert compare_tensors(g, off)["max_absolute_error"] > 0  # unequal: the general path


def test_chunking_does_not_change_results(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.randn(10_007, dtype=torch.float32)
    t = g + 1e-3 * torch.randn(10_007)
    whole = compare_tensors(g, t)
    monkeypatch.setattr(metrics, "CHUNK", 1000)
    chunked = compare_tensors(g, t)
    for k in ("cosine_similarity", "max_relative_error", "mean_absolute_error", "kl_divergence",
              "rmse", "one_thousandth_err_ratio"):
        assert chunked[k] == pytest.approx(whole[k], rel=1e-9), k


def test_long_row_kl_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.randn(5000, dtype=torch.float64)
    t = g + 0.1 * torch.randn(5000, dtype=torch.float64)
    monkeypatch.setattr(metrics, "CHUNK", 512)  # the row is longer than a chunk
    assert compare_tensors(g, t)["kl_divergence"] == pytest.approx(np_kl(g.numpy(), t.numpy()), rel=1e-9)


def test_kl_merges_chunks_of_very_different_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks whose log-sum-exps differ by far more than exp's range merge exactly (online softmax)."""
    gen = torch.Generator().manual_seed(5)
    g = torch.cat([torch.randn(700, generator=gen, dtype=torch.float64) * 3 + shift
                   for shift in (0.0, 900.0, -900.0, 40.0)])
    t = g + 0.05 * torch.randn(g.shape, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(metrics, "CHUNK", 700)
    assert compare_tensors(g, t)["kl_divergence"] == pytest.approx(np_kl(g.numpy(), t.numpy()), rel=1e-9)


def test_tiny_golden_values_are_left_out_of_relative_errors() -> None:
    g = torch.tensor([1e-9, 0.0, 2.0, -4.0])
    t = torch.tensor([1.0, 0.5, 2.2, -4.0])
    row = compare_tensors(g, t)
    assert row["max_relative_error"] == pytest.approx(0.1)
    assert row["mean_relative_error"] == pytest.approx(0.1 / 4)
    assert row["max_absolute_error"] == pytest.approx(1.0)
    assert_matches(row, reference(g.numpy(), t.numpy()), rtol=1e-6)


def test_zeros() -> None:
    z = torch.zeros(100)
    row = compare_tensors(z, z)
    assert row["cosine_similarity"] == 1.0 and row["relative_euclidean_distance"] == 0.0
    assert verdict(row, "float32") == "pass"
    row = compare_tensors(z, torch.ones(100))
    assert math.isnan(row["cosine_similarity"]) and row["relative_euclidean_distance"] == math.inf
    assert verdict(row, "bfloat16") == "fail"
    row = compare_tensors(torch.ones(100), z)
    assert math.isnan(row["cosine_similarity"]) and row["relative_euclidean_distance"] == 1.0
    assert verdict(row, "bfloat16") == "fail"


def test_nan_and_inf_are_counted_and_left_out() -> None:
    g = torch.arange(1.0, 11.0)
    t = g.clone()
    t[2], t[5] = float("nan"), float("inf")
    g2 = g.clone()
    g2[7] = float("-inf")
    row = compare_tensors(g2, t)
    assert (row["target_nan"], row["target_inf"], row["golden_nan"], row["golden_inf"]) == (1, 1, 0, 1)
    assert "target has 1 NaN, 1 Inf" in row["reason"] and "golden has 0 NaN, 1 Inf" in row["reason"]
    # the 7 elements finite on both sides are equal
    assert row["max_absolute_error"] == 0.0 and row["cosine_similarity"] == pytest.approx(1.0)
    assert verdict(row, "float32") == "fail"  # the target has more non-finite values than golden
    same = compare_tensors(t, t)
    assert verdict(same, "float32") == "warn"  # NaN in both: not the target's fault, but worth a look
    all_nan = compare_tensors(torch.full((4,), float("nan")), torch.ones(4))
    assert "no element finite" in all_nan["reason"] and verdict(all_nan, "float32") == "fail"


def test_shape_mismatch_never_raises() -> None:
    row = compare_tensors(torch.ones(3, 4), torch.ones(5))
    assert row["shape_mismatch"] and row["code"] == "shape_mismatch"
    assert row["reason"].startswith("shape mismatch")
    assert math.isnan(row["cosine_similarity"]) and verdict(row, "float32") == "fail"
    # each side's statistics are still there
    assert (row["golden_norm"], row["target_norm"]) == (pytest.approx(12**0.5), pytest.approx(5**0.5))
    # same elements, another view: compared flat, flagged, judged by the numbers
    row = compare_tensors(torch.arange(6.0).reshape(1, 2, 3), torch.arange(6.0).reshape(2, 3))
    assert row["shape_mismatch"] and row["cosine_similarity"] == pytest.approx(1.0)
    assert row["code"] == "ok" and "compared flat" in row["reason"] and verdict(row, "float32") == "pass"
    empty = compare_tensors(torch.ones(0), torch.ones(0))
    assert empty["code"] == "empty_tensor" and judge(empty, "float32").verdict == "warn"


def test_integer_and_bool_tensors() -> None:
    ids = torch.tensor([[1, 2, 3]])
    assert verdict(compare_tensors(ids, ids), "int64") == "pass"
    assert verdict(compare_tensors(ids, ids + torch.tensor([[0, 0, 1]])), "int64") == "fail"
    mask = torch.tensor([True, False])
    assert compare_tensors(mask, mask)["max_absolute_error"] == 0.0


def test_fp32_vs_bf16_does_not_fail_every_row() -> None:
    gen = torch.Generator().manual_seed(1)
    verdicts = []
    for _ in range(20):
        g = torch.randn(64, 128, generator=gen)
        verdicts.append(verdict(compare_tensors(g, g.bfloat16()), "bfloat16"))
    assert verdicts.count("pass") == 20
    # the same rounding error held to fp32's standard is flagged
    g = torch.randn(64, 128, generator=gen)
    assert verdict(compare_tensors(g, g.bfloat16()), "float32") != "pass"
    # a real fault in a bf16 target still fails
    bad = g.clone()
    bad[:, :16] *= 3
    assert verdict(compare_tensors(g, bad.bfloat16()), "bfloat16") == "fail"


def test_threshold_overrides() -> None:
    row = {"cosine_similarity": 0.995, "relative_euclidean_distance": 0.01}
    assert verdict(row, "bfloat16") == "warn"
    assert verdict(row, "bfloat16", {"cosine_similarity": {"warn": 0.99, "fail": 0.9}}) == "pass"
    assert verdict(row, "bfloat16", {"bf16": {"cosine_similarity": 0.999}}) == "fail"
    # a per-dtype block only applies to that dtype
    assert verdict(row, "float16", {"bfloat16": {"cosine_similarity": 0.999999}}) == "warn"
    # custom columns with their own direction
    assert verdict({**row, "my_score": 0.5}, "bfloat16",
                   {"my_score": {"warn": 0.9, "fail": 0.8, "higher_is_better": True},
                    "cosine_similarity": 0.9}) == "fail"
    with pytest.raises(UserError, match="thresholds.cosine_similarity"):
        resolve_thresholds("float32", {"cosine_similarity": "high"})
    with pytest.raises(UserError, match="thresholds.bfloat16"):
        resolve_thresholds("bfloat16", {"bfloat16": 3})


def test_dtype_classes() -> None:
    assert dtype_class("torch.bfloat16") == "bfloat16"
    assert dtype_class("bf16") == "bfloat16"
    assert dtype_class("float8_e4m3fn") == "float8"
    assert dtype_class("int4") == "int4"
    assert dtype_class("int64") == "integer"
    assert dtype_class(None) == "float32"


def test_statistics_only_rows() -> None:
    g = {"max": 4.0, "min": -2.0, "mean": 0.5, "norm": 10.0, "nan": 0, "inf": 0}
    t = {"max": 4.5, "min": -2.0, "mean": 0.5, "norm": 10.1, "nan": 0, "inf": 0}
    row = compare_stats(g, t)
    assert row["max_diff"] == pytest.approx(0.5) and row["max_rel_diff"] == pytest.approx(0.125)
    assert row["norm_rel_diff"] == pytest.approx(0.01) and row["min_diff"] == 0.0
    assert verdict(row, "bfloat16") == "pass" and verdict(row, "float32") == "warn"
    row = compare_stats(g, {**t, "norm": 20.0, "inf": 3})
    assert row["target_inf"] == 3 and verdict(row, "bfloat16") == "fail"
    assert verdict(compare_stats(g, None), "float32") == "fail"


def test_fused_kernels_agree_with_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmflow.compare import kernels

    monkeypatch.setattr(kernels, "_fused", None)
    kernel = kernels.fused()
    if kernel is None:
        pytest.skip("no compiled kernels here (no C++ compiler?); the eager path is tested above")
    n = kernels.FUSED_CHUNK
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(3 * n + 123, generator=gen)
    cases = [g + 1e-3 * torch.randn(g.shape, generator=gen), g.bfloat16(), g.clone()]
    bad = g.clone()
    bad[n + 5000] = float("nan")
    cases.append(bad)
    for t in cases:
        fused = compare_tensors(g, t)
        monkeypatch.setattr(kernels, "_fused", False)
        eager = compare_tensors(g, t)
        monkeypatch.setattr(kernels, "_fused", kernel)
        for k in metrics.METRIC_COLUMNS:
            assert fused[k] == pytest.approx(eager[k], rel=1e-6, abs=1e-15), k
        assert fused["reason"] == eager["reason"]


def test_kl_when_the_target_moves_all_mass_away() -> None:
    """The golden's mass sits where the target has almost none: KL is large and finite, never a
    math domain error (found by benchmarks/bench_bisect.py on real API dumps)."""
    g = np.array([100.0, 0.0, 0.0, 0.0], dtype=np.float32)
    t = np.array([-100.0, 0.0, 0.0, 0.0], dtype=np.float32)
    row = compare_tensors(torch.from_numpy(g), torch.from_numpy(t))
    assert math.isfinite(row["kl_divergence"])
    assert row["kl_divergence"] == pytest.approx(np_kl(g, t), rel=1e-6)


def test_compiled_kernel_is_cached_checked_once_and_can_be_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library (built by `make install`, else here once) loads from the cache and is checked
    against eager torch once per build, not once per process."""
    from llmflow.compare import kernels

    try:
        kernels.build()
    except RuntimeError as exc:  # a machine without a C++ compiler
        pytest.skip(str(exc))
    assert kernels.compiled()
    monkeypatch.setattr(kernels, "_fused", None)
    kernel = kernels.fused()
    a = torch.randn(kernels.FUSED_CHUNK, generator=torch.Generator().manual_seed(1))
    b = a + 0.01
    torch.testing.assert_close(kernel(a, b), kernels.pass1(a, b), rtol=1e-5, atol=1e-9)
    assert (kernels.library_dir() / "verified").is_file()
    monkeypatch.setattr(kernels, "_fused", None)
    monkeypatch.setattr(kernels, "_agrees", lambda k: pytest.fail("checked a verified build again"))
    assert kernels.fused() is not None
    with pytest.raises(ValueError, match="float32"):
        kernel(a.double(), b.double())  # a wrong pointer type would read garbage, so it is refused
    monkeypatch.setenv("LLMFLOW_FUSED", "0")
    assert not kernels.compiled() and kernels.fused() is None


def test_a_failed_build_is_remembered_and_compare_goes_eager(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """No working compiler: one failed attempt, written down, then eager torch at once (no second
    compiler run per process); the install step (force) tries again."""
    from llmflow.compare import kernels

    monkeypatch.setenv("LLMFLOW_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_fused", None)
    runs = []
    real_run = subprocess.run
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: runs.append(a) or real_run(*a, **k))
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        kernels.build()
    targets = native.supported_targets()  # each tried once, each failure written down
    assert all((kernels.library_dir(t) / "build-failed.txt").is_file() for t in targets)
    assert len(runs) == len(targets)
    assert kernels.fused() is None
    n_runs = len(runs)
    monkeypatch.setattr(kernels, "_fused", None)
    assert kernels.fused() is None and len(runs) == n_runs
    g = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    assert compare_tensors(g, g * 1.01)["max_relative_error"] == pytest.approx(0.01, rel=1e-5)


def test_a_build_without_openmp_for_the_baseline_isa_agrees(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """The last choices (the compiler's baseline ISA, no OpenMP: what Apple clang gets) give the
    same numbers, one thread."""
    from llmflow.compare import kernels

    monkeypatch.setenv("LLMFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "OPENMP_CHOICES", ((),))
    monkeypatch.setenv("LLMFLOW_KERNEL_TARGET", "baseline")
    monkeypatch.setattr(kernels, "_fused", None)
    try:
        kernels.build()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    assert "-fopenmp" not in (kernels.library_dir() / "build.txt").read_text()
    kernel = kernels.fused()
    assert kernel is not None
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(3 * kernels.FUSED_CHUNK + 5, generator=gen)
    b = (a + 0.01 * torch.randn(a.shape, generator=gen)).bfloat16()
    torch.testing.assert_close(kernel(a, b), kernels.pass1(a, b), rtol=1e-6, atol=1e-12)


def _fused_kernel_or_skip(monkeypatch: pytest.MonkeyPatch):
    from llmflow.compare import kernels

    monkeypatch.setattr(kernels, "_fused", None)
    kernel = kernels.fused()
    if kernel is None:
        pytest.skip("no compiled kernels here (no C++ compiler?); the eager path is tested above")
    return kernels, kernel


def extended_kl(g: np.ndarray, t: np.ndarray) -> float:
    """KL(softmax(g) || softmax(t)) in extended precision, cancellation-free for tiny divergences."""
    g = g.astype(np.longdouble).ravel()
    t = t.astype(np.longdouble).ravel()
    p = np.exp(g - g.max())
    p /= p.sum()
    e = np.expm1(t - g)
    u = (p * e).sum()
    return float((p * (e - (t - g))).sum() + (np.log1p(u) - u))


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-18, reason="no extended precision for the reference")
@pytest.mark.parametrize("path", ["fused", "eager"])
def test_kl_of_tiny_divergences_is_precise(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """fp32 vs fp32 one ulp apart: KL ~1e-13, which a difference of log-sum-exps cannot resolve."""
    kernels, kernel = _fused_kernel_or_skip(monkeypatch)
    if path == "eager":
        monkeypatch.setattr(kernels, "_fused", False)
    gen = np.random.default_rng(7)
    g = (gen.standard_normal(3 * kernels.FUSED_CHUNK + 99) * 2).astype(np.float32)
    t = np.nextafter(g, np.where(gen.random(g.size) < 0.5, -np.inf, np.inf).astype(np.float32))
    ref = extended_kl(g, t)
    assert 1e-15 < ref < 1e-11
    kl = compare_tensors(torch.from_numpy(g), torch.from_numpy(t))["kl_divergence"]
    assert kl == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("case", ["shifted_rows", "large_d", "bf16", "fp16", "logits", "shift_100"])
def test_fused_kernel_matches_eager_and_numpy(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Rows of very different scale (merged inside the kernel), |d| > 1 (phi's second branch),
    bf16/fp16 on both sides (converted through reused buffers), a long logits row, a shift whose
    exp overflows fp32 (those rows are redone eagerly)."""
    kernels, kernel = _fused_kernel_or_skip(monkeypatch)
    n = kernels.FUSED_CHUNK
    gen = torch.Generator().manual_seed(11)
    g = torch.randn(5 * n + 7, generator=gen)
    if case == "shifted_rows":
        g = g * 3 + torch.tensor([0.0, 900.0, -900.0, 40.0, 0.0, 0.0]).repeat_interleave(n)[:g.numel()]
        t = g + 0.05 * torch.randn(g.shape, generator=gen)
    elif case == "large_d":
        t = g + 2 * torch.randn(g.shape, generator=gen)
    elif case == "logits":
        g = g * 4
        t = g + 0.02 * torch.randn(g.shape, generator=gen)
    elif case == "shift_100":
        t = g + 100
    else:
        dtype = torch.bfloat16 if case == "bf16" else torch.float16
        t = (g + 0.01 * torch.randn(g.shape, generator=gen)).to(dtype)
        g = g.to(dtype)
    fused = compare_tensors(g, t)
    monkeypatch.setattr(kernels, "_fused", False)
    eager = compare_tensors(g, t)
    for k in metrics.METRIC_COLUMNS:
        assert fused[k] == pytest.approx(eager[k], rel=1e-6, abs=1e-15), k
    gn, tn = g.double().numpy(), t.double().numpy()
    assert_matches(fused, reference(gn, tn), rtol=1e-6)
    assert_side_stats(fused, gn, tn)
    if case != "shift_100":  # KL ~1e-12 there: below numpy's own rounding of the log-softmaxes
        assert fused["kl_divergence"] == pytest.approx(np_kl(gn, tn), rel=1e-6)


def test_each_row_spread_gives_eager_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's second pass takes one of three forms by the row's largest |d| (< 1/16: a
    short series and exp(b) from exp(a); < 1: the full series; beyond: a second exp): rows of
    each kind in one tensor agree with eager torch, each kind alone and merged."""
    kernels, kernel = _fused_kernel_or_skip(monkeypatch)
    n = kernels.FUSED_CHUNK
    gen = torch.Generator().manual_seed(21)
    g = torch.randn(3 * n, generator=gen) * 2
    noise = torch.randn(3 * n, generator=gen).clamp(-3, 3)
    spread = torch.tensor([0.01, 0.3, 1.5]).repeat_interleave(n)  # max |d| ~0.03, ~0.9, ~4.5
    t = g + spread * noise
    for lo, hi in ((0, n), (n, 2 * n), (2 * n, 3 * n), (0, 3 * n)):
        a, b = g[lo:hi], t[lo:hi]
        torch.testing.assert_close(kernel(a, b), kernels.pass1(a, b), rtol=1e-6, atol=1e-12)
    fused = compare_tensors(g, t)
    monkeypatch.setattr(kernels, "_fused", False)
    eager = compare_tensors(g, t)
    for k in metrics.METRIC_COLUMNS:
        assert fused[k] == pytest.approx(eager[k], rel=1e-6, abs=1e-15), k


def test_fused_spans_with_nan_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A span with NaN/Inf is redone row by row: only those rows go eager, counts stay exact."""
    kernels, kernel = _fused_kernel_or_skip(monkeypatch)
    n = kernels.FUSED_CHUNK
    monkeypatch.setattr(kernels, "FUSED_SPAN", 2 * n)
    gen = torch.Generator().manual_seed(12)
    g = torch.randn(5 * n + 300, generator=gen)
    t = g + 1e-3 * torch.randn(g.shape, generator=gen)
    g[3 * n + 17] = float("nan")
    t[n + 5] = float("inf")
    t[5 * n + 3] = float("nan")  # in the eager tail
    fused = compare_tensors(g, t)
    monkeypatch.setattr(kernels, "_fused", False)
    eager = compare_tensors(g, t)
    assert (fused["golden_nan"], fused["target_inf"], fused["target_nan"]) == (1, 1, 1)
    assert fused["reason"] == eager["reason"]
    for k in metrics.METRIC_COLUMNS:
        assert fused[k] == pytest.approx(eager[k], rel=1e-6, abs=1e-15), k
    # each side's statistics over its own finite elements, not over those finite on both
    assert_side_stats(fused, g.numpy(), t.numpy())
    assert_side_stats(eager, g.numpy(), t.numpy(), rtol=1e-9)


def test_fused_kernel_runs_on_more_threads_than_it_was_built_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled code must not size per-thread state at build time (it once crashed at 4 threads)."""
    kernels, kernel = _fused_kernel_or_skip(monkeypatch)
    # rows are computed independently and merged in order: any thread count gives the same bits
    # (against eager float64 only to within rounding: a count of elements at a threshold may differ)
    code = ("import torch\nfrom llmflow.compare import kernels\nk = kernels.fused()\n"
            "a = torch.randn(9 * kernels.FUSED_CHUNK, generator=torch.Generator().manual_seed(0))\n"
            "b = a + 0.01\ntorch.set_num_threads(1)\none = k(a, b)\n"
            "torch.set_num_threads(4 * (torch.get_num_threads() + 1))\n"
            "assert torch.equal(k(a, b), one)\n"
            "assert torch.allclose(one, kernels.pass1(a, b), rtol=1e-5, atol=1e-9)\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-18, reason="no extended precision for the reference")
def test_log1p_minus_x_has_no_cancellation() -> None:
    for u in (-0.4, -1e-2, -3e-3, -1e-7, 1e-12, 5e-5, 9.9e-3, 0.2, 1.0):
        ref = float(np.log1p(np.longdouble(u)) - np.longdouble(u))
        assert metrics._log1p_minus_x(u) == pytest.approx(ref, rel=1e-14), u


def test_fused_tails_of_any_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last, partial row of a tensor goes through the variable-length kernel."""
    kernels, kernel = _fused_kernel_or_skip(monkeypatch)
    n = kernels.FUSED_CHUNK
    gen = torch.Generator().manual_seed(13)
    for tail in (1, 2, 15, 16, 17, 1001, n - 1):
        g = torch.randn(2 * n + tail, generator=gen)
        t = g + 0.3 * torch.randn(g.shape, generator=gen)
        fused = compare_tensors(g, t)
        monkeypatch.setattr(kernels, "_fused", False)
        eager = compare_tensors(g, t)
        monkeypatch.setattr(kernels, "_fused", kernel)
        for k in metrics.METRIC_COLUMNS:
            assert fused[k] == pytest.approx(eager[k], rel=1e-6, abs=1e-15), (tail, k)
        a, b = g[-tail:], t[-tail:]
        torch.testing.assert_close(kernel(a, b), kernels.pass1(a, b), rtol=1e-6, atol=1e-12)


def test_statistics_rows_judge_what_both_sides_have() -> None:
    ids = {"max": 257.0, "min": 3.0}  # an integer tensor: msprobe leaves its mean and norm out
    row = compare_stats(ids, dict(ids))
    assert row["mean_diff"] is None and row["norm_rel_diff"] is None and row["golden_norm"] is None
    assert row["max_diff"] == 0.0 and judge(row, "integer").code == "ok"
    assert judge(compare_stats(ids, {**ids, "max": 258.0}), "integer").verdict == "fail"
    flags = {"max": 1.0, "min": 0.0}  # a bool tensor's max and min
    assert judge(compare_stats(flags, {"max": 1.0, "min": 1.0}), "bool").verdict == "fail"
    row = compare_stats({"max": 1.0}, {"norm": 2.0})  # nothing recorded on both sides
    assert row["code"] == "stats_missing" and "golden has max, target norm" in row["reason"]


@pytest.mark.parametrize("golden,target,code", [
    ({"max": math.nan, "norm": math.nan}, {"max": 2.0, "norm": 5.0}, "nan_inf"),
    ({"max": 2.0, "norm": 5.0}, {"max": math.inf, "norm": math.inf}, "nan_inf"),
    ({"max": math.inf, "norm": 5.0}, {"max": math.nan, "norm": 5.0}, "nan_inf"),
    ({"max": math.nan, "norm": 5.0}, {"max": math.nan, "norm": 5.0}, "nan_inf_shared"),
])
def test_non_finite_statistics_on_one_side_fail(golden: dict, target: dict, code: str) -> None:
    j = judge(compare_stats(golden, target), "float32")
    assert j.code == code and j.verdict == ("fail" if code == "nan_inf" else "warn")
    assert "NaN/Inf statistics on " + ("one side only" if code == "nan_inf" else "both sides") in j.reason


@pytest.mark.parametrize("n", [1, 4096, 4097, 65_536, 200_003])
def test_fixed_sum_is_the_sum_whatever_the_thread_count(n: int) -> None:
    from llmflow.compare.kernels import fixed_dot, fixed_sum

    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    y = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n + 1))
    before = torch.get_num_threads()
    try:
        got = {}
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            got[threads] = (float(fixed_sum(x)), float(fixed_dot(x, y)))
    finally:
        torch.set_num_threads(before)
    assert got[2] == got[1] and got[4] == got[1]
    assert got[1][0] == pytest.approx(math.fsum(x.tolist()), rel=1e-12, abs=1e-12)
    assert got[1][1] == pytest.approx(math.fsum((x * y).tolist()), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16)])
def test_the_kernel_gives_the_same_bits_on_any_number_of_threads(monkeypatch: pytest.MonkeyPatch,
                                                                  dtypes: tuple) -> None:
    """Rows split among 1 to 8 threads, each fetching its next row ahead (the last row short, more
    threads than rows): every value the same bits, and eager torch's numbers."""
    kernels, fused = _fused_kernel_or_skip(monkeypatch)
    n = 5 * kernels.FUSED_CHUNK + 77
    gen = torch.Generator().manual_seed(11)
    a = (torch.randn(n, generator=gen) * 2).to(dtypes[0])
    b = (a.float() + 0.05 * torch.randn(n, generator=gen)).to(dtypes[1])
    got = {}
    for threads in (1, 2, 3, 4, 8):
        with kernels.threads_from(lambda threads=threads: threads):
            got[threads] = fused(a, b)
    for threads, values in got.items():
        assert torch.equal(values, got[1]), threads
    torch.testing.assert_close(got[1], kernels.pass1(a, b), rtol=1e-5, atol=1e-9)
