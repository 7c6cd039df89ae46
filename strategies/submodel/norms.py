"""FedFA's per-layer norms: the trimmed norm, its bound, and the cohort's reference.

The pure maths of scalable aggregation (:mod:`strategies.submodel.aggregate` says
which reading of the paper each function implements and why): a layer's norm over
the values under a percentile (:func:`trimmed_norm`), the norm bounded by a multiple
of its full norm (:func:`effective_norm`), and the cohort's reference, a median
(:func:`reference_norm`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Literal

import numpy as np

from strategies.core.aggregators import (
    entry_kind,
)

Target = Literal["updates", "weights"]
"""What FedFA's factor scales: the client's update from the global slice, or its weights."""

Trim = Literal["magnitude", "signed", "central"]
"""Which values count as "under the 95th percentile" (module docstring)."""

TARGETS: tuple[Target, ...] = ("updates", "weights")
TRIMS: tuple[Trim, ...] = ("magnitude", "signed", "central")


def norms_of(
    values: np.ndarray, *, percentile: float = 95.0, trim: Trim = "magnitude"
) -> tuple[float, float]:
    """Return the trimmed L2 norm of ``values`` (:func:`trimmed_norm`) and their full one.

    One float64 copy serves both: the full norm is taken before the trim.

    Parameters
    ----------
    values : np.ndarray
        One layer's values (any shape).
    percentile : float
        In ``(0, 100]``; 100 keeps every value.
    trim : {"magnitude", "signed", "central"}
        As :func:`trimmed_norm`.

    Returns
    -------
    tuple[float, float]
        ``(trimmed, full)``; ``(0.0, 0.0)`` for an empty array.
    """
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}; FedFA uses 95")
    # one float64 copy, partitioned in place by the percentile and zeroed where trimmed:
    # the norm only needs the multiset of kept values, not their order
    if trim == "magnitude":
        x = np.abs(np.asarray(values), dtype=np.float64).ravel()
    else:
        x = np.array(values, dtype=np.float64, copy=True).ravel()
    if x.size == 0:
        return 0.0, 0.0
    full = math.sqrt(float(np.dot(x, x)))
    if trim in ("magnitude", "signed"):
        high = float(np.percentile(x, percentile, overwrite_input=True))
        x[x > high] = 0.0
    elif trim == "central":
        tail = (100.0 - percentile) / 2.0
        low, high = np.percentile(x, [tail, 100.0 - tail], overwrite_input=True)
        x[(x < low) | (x > high)] = 0.0
    else:
        raise ValueError(f"trim must be one of {', '.join(TRIMS)}, got {trim!r}")
    return math.sqrt(float(np.dot(x, x))), full


def trimmed_norm(
    values: np.ndarray, *, percentile: float = 95.0, trim: Trim = "magnitude"
) -> float:
    """Return the L2 norm of the values "under the ``percentile``-th percentile".

    Parameters
    ----------
    values : np.ndarray
        One layer's values (any shape).
    percentile : float
        In ``(0, 100]``; 100 keeps every value.
    trim : {"magnitude", "signed", "central"}
        ``|x| <= P(|x|)``, ``x <= P(x)``, or ``P'(x) <= x <= P''(x)`` with the
        central ``percentile`` % (module docstring).

    Returns
    -------
    float
        The norm, 0.0 for an empty array.
    """
    return norms_of(values, percentile=percentile, trim=trim)[0]


def effective_norm(trimmed: float, full: float, clip_factor: float) -> float:
    """Return the norm a client's layer is scaled by: ``max(trimmed, full / clip_factor)``.

    The trimmed norm is FedFA's; the full norm over ``clip_factor`` bounds what the
    trim leaves out (module docstring: values hidden above the percentile). With
    ``clip_factor`` 0 the bound is off and the trimmed norm is returned.

    Examples
    --------
    >>> effective_norm(2.0, 3.0, 3.0)  # an honest layer: the trimmed norm
    2.0
    >>> effective_norm(2.0, 300.0, 3.0)  # large values above the percentile
    100.0
    >>> effective_norm(2.0, 300.0, 0.0)
    2.0
    """
    if not (clip_factor == 0 or clip_factor >= 1):
        raise ValueError(f"clip_factor must be 0 (off) or at least 1, got {clip_factor!r}")
    if clip_factor == 0:
        return float(trimmed)
    return max(float(trimmed), float(full) / clip_factor)


def reference_norm(norms: Iterable[float]) -> float | None:
    """Return the norm a layer's clients are scaled to: the smallest leave-one-out median.

    That is the median of the positive ``norms`` with the largest left out: for every
    client it is at most the median of the *other* clients' norms (module
    docstring), so no client's own norm raises the scale it is compared with.

    Returns
    -------
    float or None
        The reference, or None when fewer than two norms are positive (a client
        alone has no others to be compared with).

    Examples
    --------
    >>> reference_norm([5.0, 10.0, 15.0])  # median of 5 and 10
    7.5
    >>> reference_norm([1.0, 1.0, 1.0, 100.0])  # one huge norm does not move it
    1.0
    >>> reference_norm([0.0, 4.0]) is None
    True
    """
    positive = sorted(float(n) for n in norms if n > 0)
    if len(positive) < 2:
        return None
    return float(statistics.median(positive[:-1]))


def is_scaled(key: str, value: np.ndarray) -> bool:
    """Return whether FedFA's factor applies to an entry: floating, learned (not statistics)."""
    return np.issubdtype(value.dtype, np.floating) and entry_kind(key) == "parameters"
