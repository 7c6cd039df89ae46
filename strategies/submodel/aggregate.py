"""Averaging sub-models into the global model: coverage and FedFA's scalable aggregation.

Coverage averaging (HeteroFL, NeFL, and FedFA after grafting): every global entry
is averaged, element by element, over the clients whose slice covers it, weighted
by their examples (or uniformly); elements nobody covered keep the global value.
It is :class:`strategies.aggregators.MeanAccumulator` (``clip_factor=0``) fed with
each sub-model's channel-prefix index: :func:`coverage_average` is that, for lists.

Scalable aggregation (FedFA Algorithm 1, lines 12-22), per layer ``l`` (one
state-dict entry) and client ``c`` of the ``m`` in the cohort::

    n_c      = || values of M_c^(l) under the 95th percentile ||_2
    alpha_c  = (1/m * sum_k n_k) / n_c
    M_G^(l)  = (sum_c N_c * alpha_c * M_c^(l)) / Gamma^(l)   (element-wise)

with ``Gamma`` the example-weighted coverage. The text leaves two things open; the
default reading and the alternative are both here.

**Weights or updates** (``target``). Default ``"updates"``: ``M_c`` is the client's
update ``Delta_c = W_c - W_G[slice]``, scaled and added back, so the result is
``W_G + sum_c N_c alpha_c Delta_c / Gamma``. Reasons: the paper motivates the
scaling by step sizes ("the magnitudes of weight changes during each step ... can
differ", Section 3.3), says the factors apply "to the weight updates from each
client model" and that the averaged norm "moderates the convergence speed by
averaging the magnitude of updates" (Section 4.3), and its convergence analysis
(Appendix E) scales gradients. It is also the only reading under which an
aggregation of untrained replies leaves the global model where it was: with
``"weights"`` the factor rescales the weights themselves, and since a narrow
client's layer has fewer entries its norm is smaller by construction, so at mixed
widths its prefix is inflated and the rest shrunk every round, trained or not.
``"weights"`` follows Algorithm 1's symbols literally (``M_c^{t+1}`` is the local
model) and is there to compare.

**Percentile of what** (``trim``). Default ``"magnitude"``: keep the values whose
absolute value is at most the 95th percentile of the absolute values. The stated
purpose is to keep outliers out of an L2 norm, and a large negative value is as
much an outlier (and weighs as much in the norm) as a large positive one; a
signed percentile would keep every negative outlier and make ``n(-w) != n(w)``.
``"signed"`` keeps values at most the 95th percentile of the signed values (the
literal "under the 95th percentile"); ``"central"`` keeps the central 95 % (between
the 2.5th and 97.5th percentiles, Appendix E's "central 95% of the weights").
Percentiles are numpy's linear interpolation, and "under" is ``<=`` so that a
constant tensor keeps every value.

Only learned floating parameters are scaled. Batch-norm running statistics (a
variance times a factor is no variance) and integer entries (step counters) are
averaged by coverage unscaled. A client whose norm is 0 for a layer (an update
that did not move it) gets factor 1: its contribution is the same for any factor.

Streaming: since ``alpha_c = mean_l / n_c``, the numerator is
``mean_l * sum_c (N_c / n_c) M_c`` and ``Gamma`` is the plain coverage, so an
accumulator can fold clients as they arrive keeping only the per-client norms and
multiply by the cohort mean at the end. The functions here take lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from strategies.aggregation import AggregationError
from strategies.aggregators import Index, MeanAccumulator, entry_kind
from strategies.submodel.extract import coverage_index

Target = Literal["updates", "weights"]
"""What FedFA's factor scales: the client's update from the global slice, or its weights."""

Trim = Literal["magnitude", "signed", "central"]
"""Which values count as "under the 95th percentile" (module docstring)."""

TARGETS: tuple[Target, ...] = ("updates", "weights")
TRIMS: tuple[Trim, ...] = ("magnitude", "signed", "central")


def _weights(count: int, weights: Sequence[float] | None) -> list[float]:
    if weights is None:
        return [1.0] * count
    if len(weights) != count:
        raise AggregationError(f"{len(weights)} weights for {count} states; give one per state")
    return [float(w) for w in weights]


def _indices(
    global_state: Mapping[str, np.ndarray],
    states: Sequence[Mapping[str, np.ndarray]],
    indices: Sequence[Mapping[str, Index]] | None,
) -> list[Mapping[str, Index]]:
    if indices is None:
        return [coverage_index(global_state, state) for state in states]
    if len(indices) != len(states):
        raise AggregationError(f"{len(indices)} indices for {len(states)} states; give one each")
    return list(indices)


def coverage_average(
    global_state: Mapping[str, np.ndarray],
    states: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float] | None = None,
    *,
    indices: Sequence[Mapping[str, Index]] | None = None,
) -> dict[str, np.ndarray]:
    """Average every global element over the states that cover it; keep it where none does.

    Parameters
    ----------
    global_state : Mapping[str, np.ndarray]
        The current global weights (names, shapes, dtypes, uncovered values).
    states : Sequence[Mapping[str, np.ndarray]]
        The clients' sub-models: a subset of the global keys, each entry a slice.
    weights : Sequence[float], optional
        Positive weight per state (examples); uniform when omitted.
    indices : Sequence[Mapping[str, Index]], optional
        Per state, where each entry sits in the global one; the channel prefix of
        the entry's shape when omitted (:func:`coverage_index`).

    Returns
    -------
    dict[str, np.ndarray]
        The new global weights, in the global key order and dtypes.

    Raises
    ------
    AggregationError
        If there is no state, the counts disagree, a weight is not positive, or an
        entry is unknown, of another dtype, or does not fit its index.
    """
    accumulator = MeanAccumulator(global_state, clip_factor=0.0)
    where = _indices(global_state, states, indices)
    for state, weight, index in zip(states, _weights(len(states), weights), where, strict=True):
        accumulator.add(state, weight, index=index)
    return accumulator.result()


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
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}; FedFA uses 95")
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        return 0.0
    if trim == "magnitude":
        a = np.abs(x)
        kept = x[a <= np.percentile(a, percentile)]
    elif trim == "signed":
        kept = x[x <= np.percentile(x, percentile)]
    elif trim == "central":
        tail = (100.0 - percentile) / 2.0
        low, high = np.percentile(x, [tail, 100.0 - tail])
        kept = x[(x >= low) & (x <= high)]
    else:
        raise ValueError(f"trim must be one of {', '.join(TRIMS)}, got {trim!r}")
    return math.sqrt(float(np.dot(kept, kept)))


def is_scaled(key: str, value: np.ndarray) -> bool:
    """Return whether FedFA's factor applies to an entry: floating, learned (not statistics)."""
    return np.issubdtype(value.dtype, np.floating) and entry_kind(key) == "parameters"


def _values(
    key: str,
    value: np.ndarray,
    global_state: Mapping[str, np.ndarray],
    index: Mapping[str, Index],
    target: Target,
) -> np.ndarray:
    if target == "weights":
        return np.asarray(value, dtype=np.float64)
    if target != "updates":
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    where = index.get(key)
    base = global_state[key] if where is None else global_state[key][where]
    if np.shape(base) != np.shape(value):
        raise AggregationError(
            f"entry '{key}' has shape {np.shape(value)} but its index covers {np.shape(base)}"
        )
    return np.asarray(value, dtype=np.float64) - np.asarray(base, dtype=np.float64)


def layer_norms(
    global_state: Mapping[str, np.ndarray],
    state: Mapping[str, np.ndarray],
    index: Mapping[str, Index],
    *,
    target: Target = "updates",
    percentile: float = 95.0,
    trim: Trim = "magnitude",
) -> dict[str, float]:
    """Return, per scaled entry of one client's state, its trimmed L2 norm (line 12)."""
    return {
        key: trimmed_norm(
            _values(key, value, global_state, index, target), percentile=percentile, trim=trim
        )
        for key, value in state.items()
        if is_scaled(key, value)
    }


def scaling_factors(
    norms: Sequence[Mapping[str, float]], *, max_factor: float = math.inf
) -> list[dict[str, float]]:
    """Return FedFA's factor per client and layer: the cohort's mean norm over the client's.

    The mean of a layer is over the clients that have it. A client whose norm is 0
    gets factor 1 (scaling a zero changes nothing). A factor is at most
    ``max_factor``: the paper's factor is unbounded, and a layer whose update
    happens to be tiny (a narrow slice's normalisation layer holds two values, one
    of which the trim drops) is otherwise multiplied by thousands, which destroyed
    the global model in our runs (``benchmarks/submodel.py``). Scaling *down* (the
    defence against an oversized update) is not bounded.

    Parameters
    ----------
    norms : Sequence[Mapping[str, float]]
        Per client, the trimmed norm of each layer (:func:`layer_norms`).
    max_factor : float, optional
        Largest factor (unbounded by default, as in the paper).

    Returns
    -------
    list[dict[str, float]]
        Per client, the factor of each of its layers.
    """
    if not max_factor >= 1:
        raise ValueError(f"max_factor must be >= 1, got {max_factor!r}")
    totals: dict[str, list[float]] = {}
    for client in norms:
        for key, n in client.items():
            if not math.isfinite(n) or n < 0:
                raise AggregationError(f"layer '{key}' has norm {n!r}; norms are finite and >= 0")
            totals.setdefault(key, []).append(float(n))
    means = {key: math.fsum(values) / len(values) for key, values in totals.items()}
    return [
        {key: min(means[key] / n, max_factor) if n > 0 else 1.0 for key, n in client.items()}
        for client in norms
    ]


def scale_state(
    global_state: Mapping[str, np.ndarray],
    state: Mapping[str, np.ndarray],
    index: Mapping[str, Index],
    factors: Mapping[str, float],
    *,
    target: Target = "updates",
) -> dict[str, np.ndarray]:
    """Apply one client's factors: ``alpha * W`` (weights) or ``W_G + alpha * Delta`` (updates).

    Entries without a factor are returned as they are; scaled entries keep their dtype.
    """
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        factor = factors.get(key)
        if factor is None:
            out[key] = value
            continue
        values = factor * _values(key, value, global_state, index, target)
        if target == "updates":
            where = index.get(key)
            base = global_state[key] if where is None else global_state[key][where]
            values = np.asarray(base, dtype=np.float64) + values
        out[key] = values.astype(value.dtype)
    return out


def scalable_aggregate(
    global_state: Mapping[str, np.ndarray],
    states: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float] | None = None,
    *,
    indices: Sequence[Mapping[str, Index]] | None = None,
    target: Target = "updates",
    percentile: float = 95.0,
    trim: Trim = "magnitude",
    max_factor: float = math.inf,
) -> dict[str, np.ndarray]:
    """FedFA's scalable aggregation of (grafted) sub-models (module docstring).

    Parameters
    ----------
    global_state : Mapping[str, np.ndarray]
        The current global weights.
    states : Sequence[Mapping[str, np.ndarray]]
        The cohort's replies, grafted to the global depth (each at its own width).
    weights : Sequence[float], optional
        Examples per client (``N_Dc``); 1 each when omitted, as in the paper.
    indices : Sequence[Mapping[str, Index]], optional
        Where each entry sits in the global one; its channel prefix when omitted.
    target : {"updates", "weights"}
        What the factor scales (module docstring; default ``"updates"``).
    percentile : float
        Values kept for the norm, 95 in the paper.
    trim : {"magnitude", "signed", "central"}
        Which values are "under the percentile" (default ``"magnitude"``).
    max_factor : float
        Largest scaling factor (:func:`scaling_factors`).

    Returns
    -------
    dict[str, np.ndarray]
        The new global weights.

    Raises
    ------
    AggregationError
        As :func:`coverage_average`, or if a norm is not finite.
    """
    if not states:
        raise AggregationError("nothing to aggregate: no state was given")
    where = _indices(global_state, states, indices)
    norms = [
        layer_norms(global_state, state, index, target=target, percentile=percentile, trim=trim)
        for state, index in zip(states, where, strict=True)
    ]
    factors = scaling_factors(norms, max_factor=max_factor)
    scaled = [
        scale_state(global_state, state, index, f, target=target)
        for state, index, f in zip(states, where, factors, strict=True)
    ]
    return coverage_average(global_state, scaled, weights, indices=where)
