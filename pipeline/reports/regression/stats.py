"""The window tier's statistics: how much a per-site metric varies from night to night.

Written for any metric with one value per run (or group) and site, counts today and GPU time
later: a band around the window's values, and a candidate is unusual only outside it. With few
runs (or when most nights agree and the median absolute deviation is 0) the band is the window's
own range; with more it is the median plus or minus `k` robust standard deviations (1.4826 x the
median absolute deviation), which one odd night cannot widen.
"""

from __future__ import annotations

import numpy as np

from tbpipe.pipeline.reports.regression.model import Spread

MEDIAN_MAD_FROM = 5  # runs in the window from which the band is median +- k MAD rather than min..max
MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation per unit of MAD


def spread(values: np.ndarray, k: float) -> Spread:
    """The band of one site's window values (oldest first)."""
    values = np.asarray(values, dtype=float)
    median = float(np.median(values))
    mad = float(np.median(np.abs(values - median)))
    # Too few runs for a robust spread, or one that cannot see the variation (most nights equal,
    # a few not): the window's own range.
    if len(values) < MEDIAN_MAD_FROM or mad == 0:
        low, high, method = float(values.min()), float(values.max()), "min-max"
    else:
        half = k * MAD_TO_SIGMA * mad
        low, high, method = median - half, median + half, "median-mad"
    return Spread(values.tolist(), median, mad, low, high, method)
