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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from strategies.aggregation import AggregationError
from tessera.config import ConfigError, RunConfig

Index = tuple[slice, ...]
"""Where a reply's entry sits inside the global entry (one slice per dimension)."""


@dataclass(frozen=True)
class Clip:
    """One update whose distance from the global model was scaled down.

    Attributes
    ----------
    position : int
        Its place in the round's fold order (0-based).
    kind : str
        Which entries were clipped (:func:`entry_kind`).
    distance : float
        Their L2 distance from the global model before clipping.
    bound : float
        The distance they were clipped to.
    """

    position: int
    kind: str
    distance: float
    bound: float


@dataclass(frozen=True)
class AccumulatorReport:
    """What an accumulator did this round, for the round record and the next round.

    Attributes
    ----------
    medians : Mapping[str, float]
        Per kind of entry (:func:`entry_kind`), the lower median of the positive L2
        distances of the round's updates from the global model (empty when the
        accumulator does not measure them); the next round's clipping bound of
        ``mean`` is ``clip-factor`` times this.
    clips : tuple[Clip, ...]
        Updates that were scaled down.
    """

    medians: Mapping[str, float] = field(default_factory=dict)
    clips: tuple[Clip, ...] = ()


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

    def report(self) -> AccumulatorReport:
        """Return what was measured and clipped (call after :meth:`result`)."""
        ...


class Aggregator(Protocol):
    """Makes an :class:`Accumulator` for one model and one round."""

    @property
    def name(self) -> str:
        """The run-config ``aggregator`` value."""
        ...

    def accumulator(
        self, reference: Mapping[str, np.ndarray], *, previous: AccumulatorReport | None = None
    ) -> Accumulator:
        """Start aggregating updates of the model whose current weights are ``reference``.

        ``previous`` is the report of the same model's last committed round (``None``
        for its first), for aggregators whose bound carries over between rounds.
        """
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


def lower_median(values: Sequence[float]) -> float:
    """Return the lower median of ``values`` (an element of them; raises if empty)."""
    if not values:
        raise ValueError("the median of nothing is undefined")
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


STATISTICS_SUFFIXES = ("running_mean", "running_var")
"""Entries that are batch-norm statistics, not learned parameters."""


def entry_kind(key: str) -> str:
    """Return ``"statistics"`` for batch-norm running statistics, else ``"parameters"``.

    The two are bounded separately: running statistics move by far more than the
    learned parameters (a running variance of 1 can become 50 in one round), so a
    single distance would be dominated by them and bound the parameters loosely.
    """
    return "statistics" if key.endswith(STATISTICS_SUFFIXES) else "parameters"


def update_distances(
    update: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    index: Mapping[str, Index | None],
) -> dict[str, float]:
    """Per kind of entry, the L2 distance of an update's floating entries from the reference.

    An entry with an index is compared with the part of the reference it covers;
    integer entries (step counters) are left out.
    """
    totals: dict[str, float] = {}
    for key, value in update.items():
        ref = reference[key]
        if not np.issubdtype(ref.dtype, np.floating):
            continue
        where = index.get(key)
        base = ref if where is None else ref[where]
        diff = value.astype(np.float64) - base.astype(np.float64)
        kind = entry_kind(key)
        totals[kind] = totals.get(kind, 0.0) + float(np.vdot(diff, diff))
    return {kind: math.sqrt(total) for kind, total in totals.items()}


def scale_update(
    update: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    index: Mapping[str, Index | None],
    factors: Mapping[str, float],
) -> dict[str, np.ndarray]:
    """Return ``reference + factor * (update - reference)``, the factor per kind of entry.

    Floating entries of a kind without a factor, and integer entries, are unchanged.
    """
    out: dict[str, np.ndarray] = {}
    for key, value in update.items():
        ref = reference[key]
        factor = factors.get(entry_kind(key))
        if factor is None or not np.issubdtype(ref.dtype, np.floating):
            out[key] = value
            continue
        where = index.get(key)
        base = (ref if where is None else ref[where]).astype(np.float64)
        out[key] = base + factor * (value.astype(np.float64) - base)
    return out


_Checked = dict[str, tuple[np.ndarray, Index | None]]


class MeanAccumulator:
    """Weighted mean with per-entry coverage, accumulated in float64, optionally bounded.

    With ``clip_factor > 0`` every update's L2 distance from the reference (the
    current global weights) is clipped to ``clip_factor`` times the cohort's median
    distance, so that no single node can move the model arbitrarily far. Learned
    parameters and batch-norm statistics are measured and bounded separately
    (:func:`entry_kind`):

    - when ``previous`` (the lower medians of this model's last committed round) is
      known, the bounds are ``clip_factor`` times them and updates are clipped and
      folded as they arrive (memory: one float64 accumulator per model);
    - otherwise (the model's first round, or a round after which nothing moved) the
      round's updates are kept until :meth:`result`, which clips them against this
      round's own medians (memory: the round's updates, once).

    Parameters
    ----------
    reference : Mapping[str, np.ndarray]
        The current global weights: names, shapes and dtypes of the result, and the
        values of entries no update covers.
    clip_factor : float
        Multiple of the cohort's median distance an update may move the model
        (``0`` switches the bound off).
    previous : Mapping[str, float] | None
        The last round's median distance per kind of entry, or ``None``.
    max_distance : float | None
        An absolute bound instead (``norm-clip``): every kind of entry of every
        update is clipped to this L2 distance as it arrives.
    """

    def __init__(
        self,
        reference: Mapping[str, np.ndarray],
        *,
        clip_factor: float = 0.0,
        previous: Mapping[str, float] | None = None,
        max_distance: float | None = None,
    ) -> None:
        self.reference = dict(reference)
        self.clip_factor = float(clip_factor)
        self.max_distance = max_distance
        self.bounds: dict[str, float] | None = None
        if self.clip_factor > 0 and previous and all(d > 0 for d in previous.values()):
            self.bounds = {kind: self.clip_factor * float(d) for kind, d in previous.items()}
        self._sums: dict[str, np.ndarray] = {}
        self._weights: dict[str, np.ndarray | float] = {}
        self._count = 0
        self._distances: dict[str, list[float]] = {}
        self._buffer: list[tuple[int, _Checked, float, dict[str, float]]] = []
        self._clips: list[Clip] = []

    @property
    def count(self) -> int:
        """Number of updates folded in so far."""
        return self._count

    def _check(
        self, update: Mapping[str, np.ndarray], index: Mapping[str, Index] | None
    ) -> _Checked:
        checked: _Checked = {}
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
            checked[key] = (value, where)
        return checked

    def add(
        self,
        update: Mapping[str, np.ndarray],
        weight: float,
        *,
        index: Mapping[str, Index] | None = None,
    ) -> None:
        """Add ``weight * update`` (clipped, when bounded) to the sums, ``weight`` to the coverage.

        Raises
        ------
        AggregationError
            If the weight is not finite and positive, or an entry is unknown or of
            the wrong dtype or shape; nothing is added then.
        """
        w = float(weight)
        if not np.isfinite(w) or w <= 0:
            raise AggregationError(f"weight {weight!r} must be finite and positive")
        checked = self._check(update, index)
        position = self._count
        self._count += 1
        if self.max_distance is not None:
            distances = self._measure(checked)
            bounds = dict.fromkeys(distances, self.max_distance)
            self._fold(self._clipped(position, checked, distances, bounds), w)
            return
        if self.clip_factor <= 0:
            self._fold(checked, w)
            return
        distances = self._measure(checked)
        if self.bounds is None or any(k not in self.bounds for k in distances):
            self._buffer.append((position, checked, w, distances))
            return
        self._fold(self._clipped(position, checked, distances, self.bounds), w)

    def _measure(self, checked: _Checked) -> dict[str, float]:
        values = {k: v for k, (v, _) in checked.items()}
        where = {k: i for k, (_, i) in checked.items()}
        distances = update_distances(values, self.reference, where)
        for kind, distance in distances.items():
            if distance > 0:
                self._distances.setdefault(kind, []).append(distance)
        return distances

    def _clipped(
        self,
        position: int,
        checked: _Checked,
        distances: Mapping[str, float],
        bounds: Mapping[str, float],
    ) -> _Checked:
        factors: dict[str, float] = {}
        for kind, distance in distances.items():
            bound = bounds.get(kind, 0.0)
            if bound > 0 and distance > bound:
                factors[kind] = bound / distance
                self._clips.append(Clip(position, kind, distance, bound))
        if not factors:
            return checked
        values = {k: v for k, (v, _) in checked.items()}
        where = {k: i for k, (_, i) in checked.items()}
        scaled = scale_update(values, self.reference, where, factors)
        return {k: (scaled[k], where[k]) for k in checked}

    def _fold(self, checked: _Checked, w: float) -> None:
        for key, (value, where) in checked.items():
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

    def _flush(self) -> None:
        if not self._buffer:
            return
        bounds = {
            kind: self.clip_factor * lower_median(values)
            for kind, values in self._distances.items()
            if values
        }
        for position, checked, w, distances in self._buffer:
            self._fold(self._clipped(position, checked, distances, bounds), w)
        self._buffer = []

    def result(self) -> dict[str, np.ndarray]:
        """Return the per-entry weighted mean; uncovered entries keep the reference.

        Raises
        ------
        AggregationError
            If no update was added.
        """
        if self._count == 0:
            raise AggregationError("nothing to aggregate: no update was added")
        self._flush()
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

    def report(self) -> AccumulatorReport:
        """Return the round's median distances (when measured) and the clipped updates."""
        medians = {kind: lower_median(v) for kind, v in sorted(self._distances.items()) if v}
        return AccumulatorReport(medians=medians, clips=tuple(self._clips))


@dataclass(frozen=True)
class MeanAggregator:
    """Example-weighted mean (FedAvg), streaming, with per-entry coverage.

    ``clip_factor > 0`` bounds each update's distance from the global model by that
    multiple of the cohort's median distance (see :class:`MeanAccumulator`).
    """

    clip_factor: float = 0.0
    name: str = "mean"

    def accumulator(
        self, reference: Mapping[str, np.ndarray], *, previous: AccumulatorReport | None = None
    ) -> Accumulator:
        """Return a fresh :class:`MeanAccumulator` bounded by the previous round's median."""
        return MeanAccumulator(
            reference,
            clip_factor=self.clip_factor,
            previous=None if previous is None else previous.medians,
        )


@dataclass(frozen=True)
class AggregatorSettings:
    """The run-config knobs of the aggregators (:mod:`strategies.robust`).

    Attributes
    ----------
    clip_factor : float
        ``clip-factor``: ``mean`` clips each update's distance from the global model
        to this multiple of the cohort's median distance (0: off).
    trim_fraction : float
        ``trim-fraction``: share cut from each end per coordinate (``trimmed-mean``).
    krum_byzantine : int
        ``krum-byzantine``: the ``f`` of (multi-)Krum.
    clip_norm : float
        ``clip-norm``: largest L2 distance of an update from the global model
        (``norm-clip``).
    """

    clip_factor: float = 0.0
    trim_fraction: float = 0.1
    krum_byzantine: int = 1
    clip_norm: float = 10.0

    @classmethod
    def from_run(cls, run: RunConfig) -> AggregatorSettings:
        """Take the settings from a parsed run config."""
        return cls(
            clip_factor=run.clip_factor,
            trim_fraction=run.trim_fraction,
            krum_byzantine=run.krum_byzantine,
            clip_norm=run.clip_norm,
        )


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


register_aggregator("mean", lambda settings: MeanAggregator(settings.clip_factor))
