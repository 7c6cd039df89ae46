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
multiply by the cohort mean at the end: :class:`ScalableAccumulator` (what FedFA's
server uses). The bound ``max_factor`` is not linear in the mean; how the
accumulator stays exact under it is in its docstring. The functions
(:func:`scalable_aggregate`) take lists and are the reference it is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from strategies.aggregation import AggregationError
from strategies.aggregators import (
    Coverage,
    EntrySums,
    Index,
    MeanAccumulator,
    add_scaled,
    check_update,
    entry_kind,
)
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
    # one float64 copy, partitioned in place by the percentile and zeroed where trimmed:
    # the norm only needs the multiset of kept values, not their order
    if trim == "magnitude":
        x = np.abs(np.asarray(values), dtype=np.float64).ravel()
    else:
        x = np.array(values, dtype=np.float64, copy=True).ravel()
    if x.size == 0:
        return 0.0
    if trim in ("magnitude", "signed"):
        high = float(np.percentile(x, percentile, overwrite_input=True))
        x[x > high] = 0.0
    elif trim == "central":
        tail = (100.0 - percentile) / 2.0
        low, high = np.percentile(x, [tail, 100.0 - tail], overwrite_input=True)
        x[(x < low) | (x > high)] = 0.0
    else:
        raise ValueError(f"trim must be one of {', '.join(TRIMS)}, got {trim!r}")
    return math.sqrt(float(np.dot(x, x)))


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


CANDIDATE_MARGIN = 2.0
"""How far under the running cap threshold a layer's norm may be and still be kept.

:class:`ScalableAccumulator` keeps a client's layer (instead of folding it) when its
norm is under ``CANDIDATE_MARGIN * running_mean / max_factor``: only such layers can
end up capped unless the layer's mean norm grows more than ``CANDIDATE_MARGIN``-fold
after the client's reply."""


class ScalableAccumulator:
    """FedFA's scalable aggregation, folded one (grafted) client at a time.

    Equal, within float32 rounding, to :func:`scalable_aggregate` of the same
    clients, without keeping their states. Per scaled layer ``l`` it holds, in the
    entry's precision and in place (:class:`~strategies.aggregators.EntrySums`)::

        P_l = sum_{c: n_c > 0} (N_c / n_c) X_c     (X: the update, or the weights)
        S_l = sum_{c: n_c = 0} N_c X_c              (factor 1)
        Gamma_l = sum_c N_c                          (element-wise coverage)

    plus each client's norm ``n_c`` (a float), and at the end sets
    ``M_G = mean_l * P_l + S_l`` over ``Gamma_l`` (added to the global weights for
    ``"updates"``). Entries that are not scaled are a plain coverage mean.

    The factor bound ``max_factor`` (``alpha_c = min(mean_l / n_c, max_factor)``)
    depends on the final mean, which is known only at the end, and no bounded state
    can decide it for every client afterwards. A client's layer whose norm is under
    ``CANDIDATE_MARGIN`` times the running threshold ``running_mean / max_factor``
    is therefore kept apart and folded with its exact factor at the end; memory is
    O(model) plus those layers (updates far smaller than the cohort's, such as a
    narrow slice's normalisation layer; none in ``benchmarks/aggregation.py``).
    Should the final mean cap a layer that was already folded (the layer's mean
    norm grew over ``CANDIDATE_MARGIN``-fold after it arrived, e.g. an oversized
    reply came last), ``P_l`` is multiplied by ``max_factor`` times the
    smallest folded norm instead of the mean: no factor exceeds ``max_factor``, the
    folded layers' factors all shrink by the same ratio, and :attr:`late_caps`
    counts the client layers that were capped late (the round record's
    ``late_capped_layers``).

    Parameters
    ----------
    global_state : Mapping[str, np.ndarray]
        The current global weights.
    target, percentile, trim, max_factor
        As :func:`scalable_aggregate`.
    """

    def __init__(
        self,
        global_state: Mapping[str, np.ndarray],
        *,
        target: Target = "updates",
        percentile: float = 95.0,
        trim: Trim = "magnitude",
        max_factor: float = math.inf,
    ) -> None:
        if target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        if trim not in TRIMS:
            raise ValueError(f"trim must be one of {', '.join(TRIMS)}, got {trim!r}")
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile!r}; FedFA uses 95")
        if not max_factor >= 1:
            raise ValueError(f"max_factor must be >= 1, got {max_factor!r}")
        self.reference = dict(global_state)
        self.target: Target = target
        self.percentile = float(percentile)
        self.trim: Trim = trim
        self.max_factor = float(max_factor)
        self._scaled = frozenset(k for k, v in self.reference.items() if is_scaled(k, v))
        self._plain = MeanAccumulator(
            {k: v for k, v in self.reference.items() if k not in self._scaled}
        )
        self._inverse = EntrySums(self.reference)
        self._unit = EntrySums(self.reference)
        self._cover = Coverage(self.reference)
        self._norms: dict[str, list[float]] = {}
        self._kept: dict[str, list[tuple[np.ndarray, Index | None, float, float]]] = {}
        self._smallest: dict[str, float] = {}
        self._count = 0
        self.late_caps = 0
        """Folded layers the final mean capped (they kept the uncapped factor)."""
        self.capped = 0
        """Client layers whose factor ``mean / norm`` exceeds ``max_factor``."""

    @property
    def count(self) -> int:
        """Number of clients folded in so far."""
        return self._count

    def add(
        self,
        state: Mapping[str, np.ndarray],
        weight: float = 1.0,
        *,
        index: Mapping[str, Index] | None = None,
    ) -> None:
        """Fold one client's (grafted) state, weighted by ``weight`` (its examples).

        Raises
        ------
        AggregationError
            If the weight is not finite and positive, an entry does not fit the
            global model, or a norm is not finite; nothing is folded then.
        """
        w = float(weight)
        if not math.isfinite(w) or w <= 0:
            raise AggregationError(f"weight {weight!r} must be finite and positive")
        where = coverage_index(self.reference, state) if index is None else index
        checked = check_update(self.reference, state, where)
        norms: dict[str, float] = {}
        for key, (value, at) in checked.items():
            if key in self._scaled:  # every norm first: a bad one folds nothing
                n = trimmed_norm(
                    self._values(key, value, at), percentile=self.percentile, trim=self.trim
                )
                if not math.isfinite(n):
                    raise AggregationError(
                        f"layer '{key}' has norm {n!r}; norms are finite and >= 0"
                    )
                norms[key] = n
        plain = {k: v for k, (v, _) in checked.items() if k not in norms}
        if plain:
            self._plain.add(
                plain,
                w,
                index={k: i for k, (_, i) in checked.items() if i is not None and k in plain},
            )
        for key, n in norms.items():
            value, at = checked[key]
            seen = self._norms.setdefault(key, [])
            seen.append(n)
            self._cover.add(key, w, at)
            x = self._values(key, value, at)  # the update again: one entry at a time
            if n == 0:
                self._unit.add(key, x, w, at)
                continue
            running = math.fsum(seen) / len(seen)
            if n * self.max_factor < CANDIDATE_MARGIN * running:
                self._kept.setdefault(key, []).append((x if x is not value else x.copy(), at, w, n))
            else:
                self._inverse.add(key, x, w / n, at)
                self._smallest[key] = min(self._smallest.get(key, math.inf), n)
        self._count += 1

    def _values(self, key: str, value: np.ndarray, at: Index | None) -> np.ndarray:
        if self.target == "weights":
            return value
        ref = self.reference[key]
        delta: np.ndarray = np.subtract(value, ref if at is None else ref[at])
        return delta

    def result(self) -> dict[str, np.ndarray]:
        """Return the new global weights.

        Raises
        ------
        AggregationError
            If no client was folded.
        """
        if self._count == 0:
            raise AggregationError("nothing to aggregate: no state was given")
        out = self._plain.result() if self._plain.count else {}
        for key, ref in self.reference.items():
            if key not in self._norms:
                if key not in out:
                    out[key] = ref.copy()
                continue
            norms = self._norms[key]
            mean = math.fsum(norms) / len(norms)
            total = self._inverse.pop(key)
            # min(mean, max_factor * smallest folded norm): the final mean itself unless a
            # folded layer turns out capped; then no folded factor exceeds max_factor
            total *= min(mean, self.max_factor * self._smallest.get(key, math.inf))
            if key in self._unit.sums:
                total += self._unit.pop(key)
            kept_capped = 0
            for x, at, w, n in self._kept.pop(key, []):
                factor = mean / n
                if factor > self.max_factor:
                    factor = self.max_factor
                    kept_capped += 1
                add_scaled(total if at is None else total[at], x, w * factor)
            capped = sum(1 for n in norms if n > 0 and mean / n > self.max_factor)
            self.capped += capped
            self.late_caps += capped - kept_capped
            out[key] = self._cover.divide(key, total, offset=self.target == "updates")
        return {key: out[key] for key in self.reference}
