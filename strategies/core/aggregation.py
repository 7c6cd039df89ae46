"""Pure arithmetic shared by the schemes: the aggregation error and summary statistics.

Weight averaging itself lives behind the Aggregator seam
(:mod:`strategies.core.aggregators`, :mod:`strategies.core.robust`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


class AggregationError(ValueError):
    """Inputs to an aggregation do not agree (keys, shapes, weights)."""


def mean_std(
    values: Sequence[float], weights: Sequence[float] | None = None
) -> tuple[float, float]:
    """Return the (weighted) mean and (weighted, population) standard deviation.

    Parameters
    ----------
    values : Sequence[float]
        Values; an empty sequence gives ``(nan, nan)``.
    weights : Sequence[float], optional
        Non-negative weights; uniform when omitted.

    Returns
    -------
    tuple[float, float]
        Mean and standard deviation.
    """
    if len(values) == 0:
        return math.nan, math.nan
    v = np.asarray(values, dtype=np.float64)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != v.shape or np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise AggregationError(
            f"{len(values)} values need as many non-negative weights with a positive "
            f"sum, got {list(w)}"
        )
    mean = float(np.sum(w * v) / w.sum())
    var = float(np.sum(w * (v - mean) ** 2) / w.sum())
    return mean, math.sqrt(max(var, 0.0))
