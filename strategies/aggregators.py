"""The Aggregator seam: how accepted weight updates become the next global weights.

Every weight-averaging path of every scheme goes through an :class:`Aggregator`
chosen by run-config ``aggregator``: the server asks it for an :class:`Accumulator`
per model at the start of a round, folds each accepted reply into it *as the reply
is pulled* (the reply's arrays can then be dropped, so server memory is O(model),
not O(clients x model)), and takes the result at the end of the round. A round
that is skipped (too few replies) simply discards its accumulators, and the global
weights stay as they were.

Coverage: a reply may cover only part of a global entry (a sub-model's channel
prefix) or leave entries out. :meth:`Accumulator.add` takes, per entry, the index
(a tuple of slices) its values occupy; every global entry is then averaged over the
replies that cover it, and an entry nobody covered keeps the reference (current
global) value.

``mean`` is the example-weighted mean (FedAvg). Robust aggregators register here
under their own names (:func:`register_aggregator`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from strategies.aggregation import AggregationError
from tessera.config import ConfigError

Index = tuple[slice, ...]
"""Where a reply's entry sits inside the global entry (one slice per dimension)."""


class Accumulator(Protocol):
    """Folds updates of one model, one at a time, into the next global weights."""

    @property
    def count(self) -> int:
        """Number of updates folded in so far."""
        ...

    def add(
        self,
        update: Mapping[str, np.ndarray],
        weight: float,
        *,
        index: Mapping[str, Index] | None = None,
    ) -> None:
        """Fold one update in (see the module docstring for ``index``)."""
        ...

    def result(self) -> dict[str, np.ndarray]:
        """Return the aggregated weights (raises if nothing was added)."""
        ...


class Aggregator(Protocol):
    """Makes an :class:`Accumulator` for one model and one round."""

    @property
    def name(self) -> str:
        """The run-config ``aggregator`` value."""
        ...

    def accumulator(self, reference: Mapping[str, np.ndarray]) -> Accumulator:
        """Start aggregating updates of the model whose current weights are ``reference``."""
        ...


def full_index(shape: tuple[int, ...]) -> Index:
    """Return the index covering a whole entry of ``shape``."""
    return tuple(slice(0, n) for n in shape)


def _check_index(key: str, index: Index, value: np.ndarray, ref: np.ndarray) -> Index:
    if len(index) != ref.ndim:
        raise AggregationError(
            f"entry '{key}': index has {len(index)} dimensions but the global entry has {ref.ndim}"
        )
    spans = []
    for dim, (sl, size) in enumerate(zip(index, ref.shape, strict=True)):
        start, stop, step = sl.indices(size)
        if step != 1 or stop < start:
            raise AggregationError(f"entry '{key}': index {sl} in dimension {dim} is not a range")
        spans.append(stop - start)
    if tuple(spans) != tuple(value.shape):
        raise AggregationError(
            f"entry '{key}': update has shape {tuple(value.shape)} but its index spans "
            f"{tuple(spans)} of the global {tuple(ref.shape)}"
        )
    return index


class MeanAccumulator:
    """Weighted mean with per-entry coverage, accumulated in float64.

    Parameters
    ----------
    reference : Mapping[str, np.ndarray]
        The current global weights: names, shapes and dtypes of the result, and the
        values of entries no update covers.
    """

    def __init__(self, reference: Mapping[str, np.ndarray]) -> None:
        self.reference = dict(reference)
        self._sums: dict[str, np.ndarray] = {}
        self._weights: dict[str, np.ndarray | float] = {}
        self._count = 0

    @property
    def count(self) -> int:
        """Number of updates folded in so far."""
        return self._count

    def add(
        self,
        update: Mapping[str, np.ndarray],
        weight: float,
        *,
        index: Mapping[str, Index] | None = None,
    ) -> None:
        """Add ``weight * update`` to the sums and ``weight`` to the coverage.

        Raises
        ------
        AggregationError
            If the weight is not finite and positive, or an entry is unknown or of
            the wrong dtype or shape; nothing is added then.
        """
        w = float(weight)
        if not np.isfinite(w) or w <= 0:
            raise AggregationError(f"weight {weight!r} must be finite and positive")
        checked: list[tuple[str, np.ndarray, Index | None]] = []
        for key, value in update.items():
            if key not in self.reference:
                raise AggregationError(f"update has entry '{key}' that the global model lacks")
            ref = self.reference[key]
            if value.dtype != ref.dtype:
                raise AggregationError(
                    f"entry '{key}' is {value.dtype}, the global model's is {ref.dtype}"
                )
            where = None if index is None or key not in index else index[key]
            if where is None and value.shape != ref.shape:
                raise AggregationError(
                    f"entry '{key}' has shape {tuple(value.shape)}, expected "
                    f"{tuple(ref.shape)} (pass an index for a partial entry)"
                )
            if where is not None:
                where = _check_index(key, where, value, ref)
                if tuple(value.shape) == tuple(ref.shape):
                    where = None
            checked.append((key, value, where))
        for key, value, where in checked:
            ref = self.reference[key]
            if key not in self._sums:
                self._sums[key] = np.zeros(ref.shape, dtype=np.float64)
                self._weights[key] = 0.0
            total = self._sums[key]
            if where is None:
                total += w * value.astype(np.float64)
                cover = self._weights[key]
                if isinstance(cover, np.ndarray):
                    cover += w
                else:
                    self._weights[key] = cover + w
            else:
                total[where] += w * value.astype(np.float64)
                cover = self._weights[key]
                if not isinstance(cover, np.ndarray):
                    cover = np.full(ref.shape, cover, dtype=np.float64)
                    self._weights[key] = cover
                cover[where] += w
        self._count += 1

    def result(self) -> dict[str, np.ndarray]:
        """Return the per-entry weighted mean; uncovered entries keep the reference.

        Raises
        ------
        AggregationError
            If no update was added.
        """
        if self._count == 0:
            raise AggregationError("nothing to aggregate: no update was added")
        out: dict[str, np.ndarray] = {}
        for key, ref in self.reference.items():
            if key not in self._sums:
                out[key] = ref.copy()
                continue
            cover = self._weights[key]
            if isinstance(cover, np.ndarray):
                covered = cover > 0
                mean = np.where(covered, self._sums[key] / np.where(covered, cover, 1.0), 0.0)
                mean = np.where(covered, mean, ref.astype(np.float64))
            else:
                mean = self._sums[key] / cover
            if np.issubdtype(ref.dtype, np.integer):
                mean = np.rint(mean)
            out[key] = mean.astype(ref.dtype)
        return out


@dataclass(frozen=True)
class MeanAggregator:
    """Example-weighted mean (FedAvg), streaming, with per-entry coverage."""

    name: str = "mean"

    def accumulator(self, reference: Mapping[str, np.ndarray]) -> Accumulator:
        """Return a fresh :class:`MeanAccumulator`."""
        return MeanAccumulator(reference)


@dataclass(frozen=True)
class AggregatorSettings:
    """The run-config knobs of the robust aggregators (:mod:`strategies.robust`).

    Attributes
    ----------
    trim_fraction : float
        ``trim-fraction``: share cut from each end per coordinate (``trimmed-mean``).
    krum_byzantine : int
        ``krum-byzantine``: the ``f`` of (multi-)Krum.
    clip_norm : float
        ``clip-norm``: largest L2 distance of an update from the global model
        (``norm-clip``).
    """

    trim_fraction: float = 0.1
    krum_byzantine: int = 1
    clip_norm: float = 10.0


AggregatorFactory = Callable[[AggregatorSettings], Aggregator]
_AGGREGATORS: dict[str, AggregatorFactory] = {}


def register_aggregator(name: str, factory: AggregatorFactory) -> None:
    """Register an aggregator factory under ``name`` (a duplicate raises)."""
    if name in _AGGREGATORS:
        raise ValueError(f"aggregator '{name}' is already registered")
    _AGGREGATORS[name] = factory


def list_aggregators() -> list[str]:
    """Names of the registered aggregators."""
    return sorted(_AGGREGATORS)


def get_aggregator(name: str, settings: AggregatorSettings | None = None) -> Aggregator:
    """Build the aggregator called ``name`` with ``settings`` (defaults when omitted).

    Raises
    ------
    ConfigError
        If no aggregator has that name; the message lists the known ones.
    """
    if name not in _AGGREGATORS:
        raise ConfigError(
            f"run-config 'aggregator' is '{name}'; use one of {', '.join(list_aggregators())}"
        )
    return _AGGREGATORS[name](settings if settings is not None else AggregatorSettings())


register_aggregator("mean", lambda settings: MeanAggregator())
