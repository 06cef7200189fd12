"""The window tier's statistics: how much a per-site metric varies from night to night.

Written for any metric with one value per run (or group) and site, counts today and GPU time
later, and for every site at once (one row of the matrix per site, one column per night): a band
around the window's values, and a candidate is unusual only outside it. With few runs (or when
most nights agree and the median absolute deviation is 0) the band is the window's own range;
with more it is the median plus or minus `k` robust standard deviations (1.4826 x the median
absolute deviation), which one odd night cannot widen.
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
