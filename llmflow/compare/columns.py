"""The names of a compare row's columns: the metrics, each side's statistics and their differences.

Declared apart from the arithmetic (``metrics``, ``statistics``) and importing nothing heavy, so
``llmflow validate`` checks a workflow's thresholds against the metric names without loading torch.
"""

from __future__ import annotations

METRIC_COLUMNS = (
    "cosine_similarity", "max_relative_error", "mean_relative_error", "max_absolute_error",
    "mean_absolute_error", "kl_divergence", "relative_euclidean_distance", "rmse",
    "one_thousandth_err_ratio", "five_thousandths_err_ratio",
)
COUNT_COLUMNS = ("golden_nan", "golden_inf", "target_nan", "target_inf")
STATS = ("max", "min", "mean", "norm")
STAT_COLUMNS = tuple(f"{s}_{kind}" for s in STATS for kind in ("diff", "rel_diff"))
SIDE_COLUMNS = tuple(f"{side}_{s}" for side in ("golden", "target") for s in STATS)


def known_metrics(algorithms: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The columns a thresholds mapping may name: the metrics, the statistics-only differences
    and the custom algorithms' columns."""
    return [*METRIC_COLUMNS, *STAT_COLUMNS, *algorithms]
