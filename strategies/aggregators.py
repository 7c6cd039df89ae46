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

``mean`` is the example-weighted mean (FedAvg), folded in place in the entries' own
float32 precision (:func:`add_scaled`, :func:`sum_dtype`; float64 only for integer
entries and the scalar weight sums): ``benchmarks/aggregation.py`` measures it
against torch's in-place accumulation and its peak memory for 1,000 updates.
Robust aggregators register here under their own names (:func:`register_aggregator`);
the order-statistic ones buffer the round (:mod:`strategies.robust`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

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


CHUNK = 1 << 16
"""Elements per float64 block when distances are measured (bounds the temporaries)."""


def squared_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Return ``sum((a - b) ** 2)`` computed in float64, in blocks of about :data:`CHUNK`.

    The float64 difference is formed one block of rows at a time, so an entry of a
    million float32 values needs a 0.5 MiB temporary, not an 8 MiB one.
    """
    if a.shape != b.shape:
        raise AggregationError(f"cannot measure {a.shape} against {b.shape}")
    if a.ndim == 0 or a.size <= CHUNK:
        diff = np.subtract(a, b, dtype=np.float64)
        return float(np.vdot(diff, diff))
    rows = max(1, CHUNK // max(1, a.size // a.shape[0]))
    total = 0.0
    for start in range(0, a.shape[0], rows):
        diff = np.subtract(a[start : start + rows], b[start : start + rows], dtype=np.float64)
        total += float(np.vdot(diff, diff))
    return total


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
        kind = entry_kind(key)
        totals[kind] = totals.get(kind, 0.0) + squared_distance(value, base)
    return {kind: math.sqrt(total) for kind, total in totals.items()}


def sum_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """Return the dtype an entry of ``dtype`` is summed in.

    Floating entries are summed in their own precision, at least float32 (float16
    in float32): ``tests/test_aggregation.py`` measures the float32 error of 1,000
    example-weighted updates against a float64 sum and finds it far inside what
    training notices. Integer and boolean entries (``num_batches_tracked``) are
    summed in float64, which holds every int32 step count exactly.
    """
    if np.issubdtype(dtype, np.floating):
        return np.promote_types(dtype, np.float32)
    return np.dtype(np.float64)


def add_scaled(total: np.ndarray, value: np.ndarray, weight: float) -> None:
    """Add ``weight * value`` to ``total`` in place, without a temporary of ``value``'s size.

    ``total`` may be a view (a slice of a larger sum). Floating values of
    ``total``'s dtype go through torch's fused in-place ``add_(value, alpha=weight)``
    on the same memory (one pass, multi-threaded); anything else (integer entries,
    other dtypes, layouts torch cannot view) through numpy with one temporary.
    """
    if value.shape != total.shape:
        raise AggregationError(f"cannot add {value.shape} to {total.shape}")
    if value.dtype == total.dtype and value.dtype in _TORCH_DTYPES and value.size > 0:
        try:
            if value.flags.writeable:
                source = torch.from_numpy(value)
            else:
                # torch warns that it cannot mark the tensor read-only; it is only read
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    source = torch.from_numpy(value)
            torch.from_numpy(total).add_(source, alpha=weight)
            return
        except (TypeError, ValueError, RuntimeError):
            pass  # negative strides, foreign byte order: numpy below
    total += np.multiply(value, weight, dtype=total.dtype)


_TORCH_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_Checked = dict[str, tuple[np.ndarray, Index | None]]


def check_update(
    reference: Mapping[str, np.ndarray],
    update: Mapping[str, np.ndarray],
    index: Mapping[str, Index] | None,
) -> _Checked:
    """Pair every entry of ``update`` with its index, checking names, dtypes and shapes.

    An entry without an index must have the reference's shape; an index that spans
    the whole entry is dropped (``None``).

    Raises
    ------
    AggregationError
        If an entry is unknown, of another dtype, or does not fit its index.
    """
    checked: _Checked = {}
    for key, value in update.items():
        if key not in reference:
            raise AggregationError(f"update has entry '{key}' that the global model lacks")
        ref = reference[key]
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


class EntrySums:
    """Per-entry running sums ``sum_c w_c * x_c``, one array per global entry, in place.

    An entry's sum is allocated (zeros of :func:`sum_dtype`) the first time something
    is added to it; a partial update adds into the slice its index names.
    """

    def __init__(self, reference: Mapping[str, np.ndarray]) -> None:
        self.reference = reference
        self.sums: dict[str, np.ndarray] = {}

    def add(self, key: str, value: np.ndarray, weight: float, where: Index | None) -> None:
        """Add ``weight * value`` to entry ``key`` (to its ``where`` slice when given)."""
        total = self.sums.get(key)
        if total is None:
            ref = self.reference[key]
            total = self.sums[key] = np.zeros(ref.shape, dtype=sum_dtype(ref.dtype))
        add_scaled(total if where is None else total[where], value, weight)

    def pop(self, key: str) -> np.ndarray:
        """Return entry ``key``'s sum (zeros if nothing was added) and forget it."""
        if key in self.sums:
            return self.sums.pop(key)
        ref = self.reference[key]
        return np.zeros(ref.shape, dtype=sum_dtype(ref.dtype))


class Coverage:
    """Per entry, the weight that covers each element: a float, or an array once partial.

    Whole-entry weights stay one float64 scalar per entry; an entry that receives a
    partial update gets a coverage array in the entry's :func:`sum_dtype` (float32
    sums of 1,000 weights are checked in ``tests/test_aggregation.py``).
    """

    def __init__(self, reference: Mapping[str, np.ndarray]) -> None:
        self.reference = reference
        self.weights: dict[str, np.ndarray | float] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.weights

    def add(self, key: str, weight: float, where: Index | None) -> None:
        """Add ``weight`` to the coverage of entry ``key`` (of its ``where`` slice when given)."""
        cover = self.weights.get(key, 0.0)
        if where is None:
            if isinstance(cover, np.ndarray):
                cover += weight
            else:
                self.weights[key] = cover + weight
            return
        if not isinstance(cover, np.ndarray):
            ref = self.reference[key]
            cover = np.full(ref.shape, cover, dtype=sum_dtype(ref.dtype))
            self.weights[key] = cover
        cover[where] += weight

    def divide(self, key: str, total: np.ndarray, *, offset: bool = False) -> np.ndarray:
        """Turn entry ``key``'s sum into its mean, in place, in the reference's dtype.

        Elements nobody covered take the reference value. With ``offset`` the sum is
        of differences from the reference, which is added back to the covered
        elements (``reference + sum / cover``). Integer entries are rounded to the
        nearest integer.
        """
        ref = self.reference[key]
        cover = self.weights[key]
        if isinstance(cover, np.ndarray):
            covered = cover > 0
            np.divide(total, cover, out=total, where=covered)
            if offset:
                np.add(total, ref, out=total, where=covered)
            np.copyto(total, ref, where=~covered)
        else:
            total /= cover
            if offset:
                total += ref
        if np.issubdtype(ref.dtype, np.integer):
            np.rint(total, out=total)
        return total.astype(ref.dtype, copy=False)


class MeanAccumulator:
    """Weighted mean with per-entry coverage, folded in place, optionally bounded.

    Every update is added into one running sum per entry as it arrives, in the
    entry's own floating precision (:func:`sum_dtype`: float32 for float32 models,
    float64 for integer entries), with no temporary of the model's size
    (:func:`add_scaled`); the weights are summed in float64. Memory: one sum per
    model entry, plus a coverage array for entries that received partial updates.

    With ``clip_factor > 0`` every update's L2 distance from the reference (the
    current global weights) is clipped to ``clip_factor`` times the cohort's median
    distance, so that no single node can move the model arbitrarily far. Learned
    parameters and batch-norm statistics are measured and bounded separately
    (:func:`entry_kind`):

    - when ``previous`` (the lower medians of this model's last committed round) is
      known, the bounds are ``clip_factor`` times them and updates are clipped and
      folded as they arrive (memory: one accumulator per model);
    - otherwise (the model's first round, or a round after which nothing moved) the
      round's updates are kept until :meth:`result`, which clips them against this
      round's own medians (memory: the round's updates, once).

    A clipped update ``reference + f * (update - reference)`` is folded as
    ``w * f * update + w * (1 - f) * reference``, so clipping allocates nothing either.

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
        self._sums = EntrySums(self.reference)
        self._cover = Coverage(self.reference)
        self._count = 0
        self._distances: dict[str, list[float]] = {}
        self._buffer: list[tuple[int, _Checked, float, dict[str, float]]] = []
        self._clips: list[Clip] = []
        self._result: dict[str, np.ndarray] | None = None
        self._unit: float | None = None

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
        """Add ``weight * update`` (clipped, when bounded) to the sums, ``weight`` to the coverage.

        Raises
        ------
        AggregationError
            If the weight is not finite and positive, an entry is unknown or of the
            wrong dtype or shape (nothing is added then), or :meth:`result` was
            already taken.
        """
        if self._result is not None:
            raise AggregationError("this round's result was already taken; start a new one")
        w = float(weight)
        if not np.isfinite(w) or w <= 0:
            raise AggregationError(f"weight {weight!r} must be finite and positive")
        checked = check_update(self.reference, update, index)
        # weights relative to the first one: a lone update, or equal weights, add with
        # factor 1 and divide by a whole count, so they come back exactly in float32
        if self._unit is None:
            self._unit = w
        w /= self._unit
        position = self._count
        self._count += 1
        if self.max_distance is not None:
            distances = self._measure(checked)
            bounds = dict.fromkeys(distances, self.max_distance)
            self._fold(checked, w, self._factors(position, distances, bounds))
            return
        if self.clip_factor <= 0:
            self._fold(checked, w, {})
            return
        distances = self._measure(checked)
        if self.bounds is None or any(k not in self.bounds for k in distances):
            self._buffer.append((position, checked, w, distances))
            return
        self._fold(checked, w, self._factors(position, distances, self.bounds))

    def _measure(self, checked: _Checked) -> dict[str, float]:
        values = {k: v for k, (v, _) in checked.items()}
        where = {k: i for k, (_, i) in checked.items()}
        distances = update_distances(values, self.reference, where)
        for kind, distance in distances.items():
            if distance > 0:
                self._distances.setdefault(kind, []).append(distance)
        return distances

    def _factors(
        self, position: int, distances: Mapping[str, float], bounds: Mapping[str, float]
    ) -> dict[str, float]:
        factors: dict[str, float] = {}
        for kind, distance in distances.items():
            bound = bounds.get(kind, 0.0)
            if bound > 0 and distance > bound:
                factors[kind] = bound / distance
                self._clips.append(Clip(position, kind, distance, bound))
        return factors

    def _fold(self, checked: _Checked, w: float, factors: Mapping[str, float]) -> None:
        for key, (value, where) in checked.items():
            ref = self.reference[key]
            factor = factors.get(entry_kind(key))
            if factor is None or not np.issubdtype(ref.dtype, np.floating):
                self._sums.add(key, value, w, where)
            else:  # w * (ref + f * (value - ref)) = w f value + w (1 - f) ref
                self._sums.add(key, value, w * factor, where)
                self._sums.add(key, ref if where is None else ref[where], w * (1 - factor), where)
            self._cover.add(key, w, where)

    def _flush(self) -> None:
        if not self._buffer:
            return
        bounds = {
            kind: self.clip_factor * lower_median(values)
            for kind, values in self._distances.items()
            if values
        }
        for position, checked, w, distances in self._buffer:
            self._fold(checked, w, self._factors(position, distances, bounds))
        self._buffer = []

    def result(self) -> dict[str, np.ndarray]:
        """Return the per-entry weighted mean; uncovered entries keep the reference.

        The sums become the result in place (no second copy of the model); calling
        again returns the same arrays.

        Raises
        ------
        AggregationError
            If no update was added.
        """
        if self._result is not None:
            return self._result
        if self._count == 0:
            raise AggregationError("nothing to aggregate: no update was added")
        self._flush()
        out: dict[str, np.ndarray] = {}
        for key, ref in self.reference.items():
            if key not in self._cover:
                out[key] = ref.copy()
                continue
            out[key] = self._cover.divide(key, self._sums.pop(key))
        self._result = out
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
