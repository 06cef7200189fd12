"""The window tier's statistics: how much a per-site metric varies from night to night.

Written for any metric with one value per run (or group) and site, counts and GPU time, and for
every site at once (one row of the matrix per site, one column per night): a band around the
window's values, and a candidate is unusual only outside it. With few runs (or when most nights
agree and the median absolute deviation is 0) the band is the window's own range; with more it is
the median plus or minus `k` robust standard deviations (1.4826 x the median absolute deviation),
which one odd night cannot widen.

Against a single baseline run a duration has no night-to-night spread to measure; there the GPU
time tier compares the per-execution durations of the two runs (`welch_z`: the shift of the mean in
standard errors, from each site's count, sum and sum of squares).
"""

from __future__ import annotations

import numpy as np

from tbpipe.pipeline.reports.regression.model import Spread

MEDIAN_MAD_FROM = 5  # runs in the window from which the band is median +- k MAD rather than min..max
MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation per unit of MAD


def band_edges(window: np.ndarray, median: np.ndarray, k: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(low, high, uses median-MAD) per row of `window` (sites x nights), given each row's median."""
    mad = np.median(np.abs(window - median[:, None]), axis=1)
    robust = (window.shape[1] >= MEDIAN_MAD_FROM) & (mad > 0)
    half = k * MAD_TO_SIGMA * mad
    low = np.where(robust, median - half, window.min(axis=1))
    high = np.where(robust, median + half, window.max(axis=1))
    return low, high, robust


def bands(window: np.ndarray, k: float) -> list[Spread]:
    """The band of every row of `window` (sites x nights, oldest night first), as Spread values."""
    median = np.median(window, axis=1)
    mad = np.median(np.abs(window - median[:, None]), axis=1)
    low, high, robust = band_edges(window, median, k)
    values = window.tolist()
    return [
        Spread(
            values[i],
            float(median[i]),
            float(mad[i]),
            float(low[i]),
            float(high[i]),
            "median-mad" if robust[i] else "min-max",
        )
        for i in range(len(values))
    ]


def mean_and_variance(total: np.ndarray, count: np.ndarray, sum_sq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the mean and the sample variance of values known by their count, sum and sum of squares
    (NaN where there are too few values)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(count > 0, total / np.where(count > 0, count, 1), np.nan)
        variance = np.where(count > 1, (sum_sq - count * mean * mean) / np.where(count > 1, count - 1, 1), np.nan)
    return mean, np.maximum(variance, 0.0)


def welch_z(
    mean_a: np.ndarray, var_a: np.ndarray, n_a: np.ndarray, mean_b: np.ndarray, var_b: np.ndarray, n_b: np.ndarray
) -> np.ndarray:
    """Welch's statistic for the difference of two means (b - a) in standard errors, per row: how far one
    run's per-execution durations moved against their own spread. NaN where a side has fewer than two
    values; +-inf where both spreads are 0 and the means differ."""
    with np.errstate(divide="ignore", invalid="ignore"):
        error = np.sqrt(var_a / np.where(n_a > 0, n_a, 1) + var_b / np.where(n_b > 0, n_b, 1))
        z = (mean_b - mean_a) / error
    z = np.where((error == 0) & (mean_a == mean_b), 0.0, z)
    return np.where((n_a < 2) | (n_b < 2), np.nan, z)
