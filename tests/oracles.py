"""Test oracles: FedFA's scalable aggregation, the coverage average, the weights allowed.

The product folds replies as they arrive (:class:`~strategies.core.mean.MeanAccumulator`,
:class:`~strategies.submodel.ScalableAccumulator`); these take the whole cohort at
once, as FedFA's Algorithm 1 is written, and are what the streaming code is tested
against (``tests/test_submodel.py``, ``tests/test_robust_submodel_ensemble.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import Message

from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import Index
from strategies.core.mean import MeanAccumulator
from strategies.core.validation import weight_caps
from strategies.submodel.extract import coverage_index
from strategies.submodel.norms import (
    TARGETS,
    Target,
    Trim,
    effective_norm,
    is_scaled,
    norms_of,
    reference_norm,
)
from tessera import wire


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
    clip_factor: float = 0.0,
) -> dict[str, float]:
    """Return, per scaled entry of one client's state, its norm (line 12; :func:`effective_norm`).

    With ``clip_factor`` 0 this is FedFA's trimmed L2 norm.
    """
    out: dict[str, float] = {}
    for key, value in state.items():
        if is_scaled(key, value):
            values = _values(key, value, global_state, index, target)
            trimmed, full = norms_of(values, percentile=percentile, trim=trim)
            out[key] = effective_norm(trimmed, full, clip_factor)
    return out


def scaling_factors(
    norms: Sequence[Mapping[str, float]],
    *,
    max_factor: float = math.inf,
    previous: Mapping[str, float] | None = None,
) -> list[dict[str, float]]:
    """Return FedFA's factor per client and layer: the layer's reference over the client's norm.

    The reference of a layer is :func:`reference_norm` of the norms of the clients
    that have it (at most the median of the others' norms for every client), or
    ``previous[layer]`` when fewer than two of them moved it; without either the
    factor is 1. A client whose norm is 0 gets factor 1 (scaling a zero changes
    nothing). A factor is at most ``max_factor``: a layer whose update happens to be
    tiny (a narrow slice's normalisation layer holds two values, one of which the
    trim drops) is otherwise multiplied by thousands, which destroyed the global
    model in our runs (``benchmarks/submodel.py``). Scaling *down* (the defence
    against an oversized update) is not bounded.

    Parameters
    ----------
    norms : Sequence[Mapping[str, float]]
        Per client, the norm of each layer (:func:`layer_norms`).
    max_factor : float, optional
        Largest factor (unbounded by default, as in the paper).
    previous : Mapping[str, float], optional
        Per layer, the reference of an earlier round (:attr:`ScalableAccumulator.references`).

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
    earlier = previous or {}
    references = {key: reference_norm(values) for key, values in totals.items()}
    references = {
        key: ref if ref is not None else earlier.get(key) for key, ref in references.items()
    }
    out: list[dict[str, float]] = []
    for client in norms:
        factors: dict[str, float] = {}
        for key, n in client.items():
            ref = references[key]
            factors[key] = 1.0 if n == 0 or ref is None else min(ref / n, max_factor)
        out.append(factors)
    return out


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
    clip_factor: float = 0.0,
    previous: Mapping[str, float] | None = None,
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
    clip_factor : float
        ``kappa`` of :func:`effective_norm` (0: the paper's trimmed norm alone).
    previous : Mapping[str, float], optional
        Per layer, an earlier round's reference (:func:`scaling_factors`).

    Returns
    -------
    dict[str, np.ndarray]
        The new global weights (statistics and integer entries: coverage average).

    Raises
    ------
    AggregationError
        As :func:`coverage_average`, or if a norm is not finite.
    """
    if not states:
        raise AggregationError("nothing to aggregate: no state was given")
    where = _indices(global_state, states, indices)
    norms = [
        layer_norms(
            global_state,
            state,
            index,
            target=target,
            percentile=percentile,
            trim=trim,
            clip_factor=clip_factor,
        )
        for state, index in zip(states, where, strict=True)
    ]
    factors = scaling_factors(norms, max_factor=max_factor, previous=previous)
    scaled = [
        scale_state(global_state, state, index, f, target=target)
        for state, index, f in zip(states, where, factors, strict=True)
    ]
    return coverage_average(global_state, scaled, weights, indices=where)


def allowed_weights(sizes: Mapping[int, int], replies: Sequence[Message]) -> list[float]:
    """Each reply's weight in a merge: its claimed ``num-examples`` within its cohort cap.

    ``sizes`` are the round's cohort's handshake ``num-train`` (every node that was
    sent the round's message); the caps are the default's (``weight-cap`` 2 x the
    lower median, ``weight-trim`` 0.2: the largest claims cut to the next one,
    :func:`strategies.core.validation.weight_caps`, whose maths is tested by hand in
    ``tests/test_bounded_mean.py``).
    """
    caps = weight_caps(sizes, 2.0, 0.2)
    out = []
    for reply in replies:
        claimed = float(reply.content.metric_records[wire.METRICS][wire.NUM_EXAMPLES])
        cap = caps[reply.metadata.src_node_id]
        out.append(claimed if cap is None else min(claimed, cap))
    return out
