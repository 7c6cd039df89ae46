"""Pure aggregation arithmetic shared by the schemes.

Inputs are validated replies (see :mod:`strategies.validation`); shapes are still
checked explicitly here and nothing relies on numpy broadcasting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


class AggregationError(ValueError):
    """Inputs to an aggregation do not agree (keys, shapes, weights)."""


def weighted_average(
    arrays: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]
) -> dict[str, np.ndarray]:
    """Average dicts of arrays key by key with the given (unnormalised) weights.

    Accumulates in float64 and casts back to each array's dtype; integer arrays
    (e.g. batch-norm ``num_batches_tracked``) are rounded to the nearest integer.

    Parameters
    ----------
    arrays : Sequence[Mapping[str, np.ndarray]]
        One dict per contribution, all with the same keys, shapes and dtypes.
    weights : Sequence[float]
        One non-negative weight per contribution, with a positive sum.

    Returns
    -------
    dict[str, np.ndarray]
        The weighted average, keys in the order of the first contribution.

    Raises
    ------
    AggregationError
        If the inputs are empty or disagree in keys, shapes, dtypes or length.
    """
    if not arrays:
        raise AggregationError("nothing to aggregate: no contributions were given")
    if len(arrays) != len(weights):
        raise AggregationError(
            f"{len(arrays)} contributions but {len(weights)} weights; pass one weight "
            "per contribution"
        )
    w = np.asarray(weights, dtype=np.float64)
    if np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise AggregationError(
            f"weights {list(weights)} must be finite, non-negative and sum to > 0"
        )
    w = w / w.sum()
    reference = arrays[0]
    for i, contribution in enumerate(arrays):
        if contribution.keys() != reference.keys():
            raise AggregationError(
                f"contribution {i} has keys {sorted(contribution)} but the first "
                f"has {sorted(reference)}"
            )
    out: dict[str, np.ndarray] = {}
    for key, ref in reference.items():
        acc = np.zeros(ref.shape, dtype=np.float64)
        for i, contribution in enumerate(arrays):
            value = contribution[key]
            if value.shape != ref.shape or value.dtype != ref.dtype:
                raise AggregationError(
                    f"contribution {i} '{key}' is {value.dtype}{value.shape}, "
                    f"expected {ref.dtype}{ref.shape}"
                )
            acc += w[i] * value.astype(np.float64)
        if np.issubdtype(ref.dtype, np.integer):
            acc = np.rint(acc)
        out[key] = np.asarray(acc, dtype=np.float64).astype(ref.dtype)
    return out


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
