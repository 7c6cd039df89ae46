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

``mean`` is the example-weighted mean (FedAvg), folded in place into float64 sums
(:func:`add_scaled`, :func:`sum_dtype`), so that the same seed gives the same
numbers whatever order the replies arrive in: ``benchmarks/aggregation.py``
measures it against torch's in-place float32 accumulation and its peak memory for
1,000 updates.
Robust aggregators register here under their own names (:func:`register_aggregator`);
the order-statistic ones buffer the round (:mod:`strategies.core.robust`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from strategies.core import fused
from strategies.core.aggregation import AggregationError
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
        direction: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Fold one update in (see the module docstring for ``index``).

        ``direction``, when given, is the server's own update of the model this
        update was trained as (a sub-model slice's own, shaped like the update's
        entries): aggregators that check directions compare with it instead of
        the slice of the accumulator's direction; others ignore it.
        """
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
        self,
        reference: Mapping[str, np.ndarray],
        *,
        previous: AccumulatorReport | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
    ) -> Accumulator:
        """Start aggregating updates of the model whose current weights are ``reference``.

        ``previous`` is the report of the same model's last committed round (``None``
        for its first), for aggregators whose bound carries over between rounds.
        ``direction`` is the server's own update of the model on its pool (trained
        minus ``reference``), for aggregators that check where an update points.
        """
        ...


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


CHUNK = 1 << 20
"""Elements per block when distances are measured: bounds the temporary (4 MiB of
float32, reused for every update of a round) and stays in cache between the measure
and the fold of a block. Smaller blocks cost more in per-call overhead than they
save (``benchmarks/aggregation.py``)."""

DEFAULT_GROWTH = 2.0
"""Largest factor a bounded ``mean``'s scale may move between rounds (``bound-growth``)."""


CEILING_SCALE = {"statistics": 25.0}
"""Extra multiple of ``clip-ceiling`` for batch-norm statistics: a running variance
of 1 can reach 50 in one honest round on unnormalised inputs (measured first-round
moves on digits: learned parameters 0.14-0.32 of their norm, statistics 0.8)."""

DIRECTION = "direction"
"""The :class:`Clip` kind of an update dropped by the direction check: its ``distance``
is the update's cosine with the server's own update, its ``bound`` the threshold."""


def _is_parameter(key: str, value: np.ndarray) -> bool:
    return _floating(value) and entry_kind(key) == "parameters"


def _floating(value: np.ndarray) -> bool:
    return bool(np.issubdtype(value.dtype, np.floating))


def _flat(array: np.ndarray) -> np.ndarray:
    """Return a 1-d view of ``array`` (a copy only when it cannot be viewed flat)."""
    return array.reshape(-1)


def _torch_view(array: np.ndarray) -> torch.Tensor | None:
    """``array`` as a flat torch tensor on the same memory, or ``None`` if torch cannot view it."""
    if array.dtype not in _TORCH_DTYPES or not array.flags.c_contiguous or array.size == 0:
        return None
    flat = array.reshape(-1)
    try:
        if flat.flags.writeable:
            return torch.from_numpy(flat)
        with warnings.catch_warnings():  # read-only memory: it is only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(flat)
    except (TypeError, ValueError, RuntimeError):
        return None


def _block_dot(a: np.ndarray, b: np.ndarray, direction: np.ndarray) -> float:
    diff = np.subtract(a, b, dtype=np.float64)
    return float(np.vdot(diff, np.asarray(direction, dtype=np.float64)))


def _block_square(a: np.ndarray, b: np.ndarray) -> float:
    diff = np.subtract(a, b, dtype=np.float64)
    return float(np.vdot(diff, diff))


def squared_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Return ``sum((a - b) ** 2)``, block by block, without a temporary of ``a``'s size.

    float32 and float64 entries go through torch (the difference of a block of
    :data:`CHUNK` elements into one reused buffer, then its dot product, summed
    over blocks in float64); a block whose float32 square overflows is measured
    again in float64, so a finite update always has a finite (or ``inf`` only
    past float64's range) distance. Anything else goes through numpy in float64.
    """
    if a.shape != b.shape:
        raise AggregationError(f"cannot measure {a.shape} against {b.shape}")
    _, square, _ = measure_and_fold(a, b, None, 0.0, 0.0, None)
    return square


def measure_and_fold(
    value: np.ndarray,
    base: np.ndarray,
    total: np.ndarray | None,
    weight: float,
    square: float,
    limit: float | None,
    scratch: dict[torch.dtype, torch.Tensor] | None = None,
    direction: np.ndarray | None = None,
) -> tuple[int, float, float]:
    """Add ``sum((value - base) ** 2)`` to ``square``; fold blocks of ``value`` while in bounds.

    With numba installed, contiguous float32/float64 entries take one compiled pass
    (:mod:`strategies.core.fused`: blocks measured in the entry's precision, summed in
    float64, a block past float32's range again in float64; folded in the entry's
    precision).
    Otherwise blocks of :data:`CHUNK` elements are measured in turn (the difference into a
    reused buffer, then its dot product, in the entry's precision; a block whose
    float32 square overflows is measured again in float64). While the running
    ``square`` stays at most ``limit`` (a squared distance), each measured block is
    also added to ``total`` at ``weight`` (``total[block] += weight * value[block]``,
    in place, while the block is in cache). The first block that takes ``square``
    past ``limit`` and every block after it are only measured. With ``limit`` (or
    ``total``) ``None`` nothing is folded. ``scratch`` keeps the buffer between
    calls (one per dtype). With ``direction`` (an array of ``value``'s shape) the
    dot product ``(value - base) . direction`` is measured in the same pass.

    Returns
    -------
    tuple[int, float, float]
        How many leading elements (in C order) were folded, the new ``square``, and
        the dot product with ``direction`` (0 without one).
    """
    n = value.size
    if value.flags.c_contiguous and base.flags.c_contiguous and n > 0:
        flat_total = None if total is None or not total.flags.c_contiguous else _flat(total)
        flat_direction = (
            None if direction is None or not direction.flags.c_contiguous else _flat(direction)
        )
        if (total is None) == (flat_total is None) and (direction is None) == (
            flat_direction is None
        ):
            fused_result = fused.measure_fold(
                _flat(value), _flat(base), flat_total, weight, square, limit, flat_direction
            )
            if fused_result is not None:
                return fused_result
    v, b = _torch_view(value), _torch_view(base)
    t = None if total is None else _torch_view(total)
    d = None if direction is None else _torch_view(direction)
    fold = limit is not None and total is not None
    if (
        v is None
        or b is None
        or v.dtype != b.dtype
        or (fold and (t is None or t.dtype.itemsize < v.dtype.itemsize))
        or (direction is not None and (d is None or d.dtype != v.dtype))
    ):
        # other dtypes and layouts: measure in float64 blocks, fold nothing
        dot = 0.0
        if value.ndim == 0 or n <= CHUNK:
            if direction is not None:
                dot = _block_dot(value, base, direction)
            return 0, square + _block_square(value, base), dot
        rows = max(1, CHUNK // max(1, n // value.shape[0]))
        for start in range(0, value.shape[0], rows):
            rows_ = slice(start, start + rows)
            square += _block_square(value[rows_], base[rows_])
            if direction is not None:
                dot += _block_dot(value[rows_], base[rows_], direction[rows_])
        return 0, square, dot
    size = min(n, CHUNK)
    buf = None if scratch is None else scratch.get(v.dtype)
    if buf is None or buf.numel() < size:
        buf = torch.empty(size, dtype=v.dtype)
        if scratch is not None:
            scratch[v.dtype] = buf
    done = 0
    dot = 0.0
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        part = buf[: stop - start]
        torch.sub(v[start:stop], b[start:stop], out=part)
        block = float(torch.dot(part, part))
        if d is not None and direction is not None:
            along = float(torch.dot(part, d[start:stop]))
            if not math.isfinite(along):
                along = _block_dot(
                    _flat(value)[start:stop], _flat(base)[start:stop], _flat(direction)[start:stop]
                )
            dot += along
        if not math.isfinite(block):  # float32 overflow: measure this block in float64
            block = _block_square(_flat(value)[start:stop], _flat(base)[start:stop])
        square += block
        if fold and done == start and square <= limit:  # type: ignore[operator]
            # a float32 block is widened once (a block-sized temporary) and added in
            # the sum's float64: torch's mixed-dtype add_ casts element by element
            t[start:stop].add_(v[start:stop].to(t.dtype), alpha=weight)  # type: ignore[index,union-attr]
            done = stop
    return done, square, dot


def reference_norms(reference: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per kind of entry (:func:`entry_kind`), the L2 norm of the reference's floating entries."""
    squares: dict[str, float] = {}
    for key, value in reference.items():
        if _floating(value) and value.size:
            kind = entry_kind(key)
            squares[kind] = squares.get(kind, 0.0) + squared_distance(value, np.zeros_like(value))
    return {kind: math.sqrt(square) for kind, square in squares.items()}


def next_scale(accepted: Sequence[float], previous: float | None, growth: float) -> float:
    """Return the next round's clip scale from the distances a round accepted.

    The lower median of ``accepted`` (after clipping, so an update sent beyond the
    bound counts at the bound), kept within ``[previous / growth, previous *
    growth]`` when there is a previous scale: a majority of hostile nodes can move
    the bound by at most ``growth`` per round, and a minority only picks which
    honest distance is the median.

    Raises
    ------
    ValueError
        If ``accepted`` is empty or ``growth`` is not above 1.
    """
    if not growth > 1:
        raise ValueError(f"growth {growth!r} must be above 1")
    median = lower_median(accepted)
    if previous is None:
        return median
    return min(max(median, previous / growth), previous * growth)


POOLED = "all"
"""Suffix of the scale key that pools every slice in whole-model units (``parameters@all``)."""


def scale_key(kind: str, covered: int, size: int) -> str:
    """Return the key of the scale an update covering ``covered`` of ``size`` elements uses.

    A whole-model update uses the kind itself (``parameters``); a sub-model slice
    covering fewer elements uses ``parameters@<covered>``: slices of one width are
    measured against each other, not against wider or narrower ones (a narrow
    slice moves the model less than the whole model's update, so one shared scale
    would clip the wide slices of a mixed cohort).
    """
    return kind if covered >= size else f"{kind}@{covered}"


def parse_scale_key(key: str) -> tuple[str, int | None]:
    """Split a scale key into its kind and covered size (``None``: whole, or pooled).

    Raises
    ------
    ValueError
        If the key is not ``kind``, ``kind@all`` or ``kind@<positive integer>``.
    """
    kind, sep, rest = key.partition("@")
    if not sep or rest == POOLED:
        return kind, None
    if not rest.isdigit() or int(rest) <= 0:
        raise ValueError(f"scale key {key!r}: expected kind, kind@{POOLED} or kind@<size>")
    return kind, int(rest)


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
    """Return the dtype an entry of ``dtype`` is summed in: float64, whatever the entry.

    Float32 sums folded in arrival order are not associative, so the same seed gave
    other numbers when replies arrived in another order (a few in the third digit of
    the demo). Summed in float64 the order moves a sum by about 1e-16 of itself and
    the float32 result it is rounded to almost never (``tests/test_aggregation.py``
    folds the same updates in every order and compares bit for bit). The sums stay
    one per entry (O(model)); ``benchmarks/aggregation.py`` measures what the wider
    accumulator costs against torch's in-place float32 sum. Integer and boolean
    entries (``num_batches_tracked``) are summed in float64 too, which holds every
    int32 step count exactly.
    """
    return np.dtype(np.float64)


def add_scaled(total: np.ndarray, value: np.ndarray, weight: float) -> None:
    """Add ``weight * value`` to ``total`` in place, without a temporary of ``value``'s size.

    ``total`` may be a view (a slice of a larger sum). A float32 value into a
    float64 sum takes the compiled loop (:func:`strategies.core.fused.fold`) when
    both are contiguous; otherwise float32 or float64 values into a float32 or
    float64 total go through torch's fused in-place
    ``add_(value, alpha=weight)`` on the same memory (one pass, multi-threaded; a
    float32 value is widened element by element, no copy); anything else (integer
    entries, other dtypes, layouts torch cannot view) through numpy with one
    temporary.
    """
    if value.shape != total.shape:
        raise AggregationError(f"cannot add {value.shape} to {total.shape}")
    if (
        value.dtype != total.dtype
        and value.size > 0
        and value.flags.c_contiguous
        and total.flags.c_contiguous
        and fused.fold(_flat(value), _flat(total), weight)
    ):
        return
    if (
        value.dtype in _TORCH_DTYPES
        and total.dtype in _TORCH_DTYPES
        and value.dtype.itemsize <= total.dtype.itemsize
        and value.size > 0
    ):
        try:
            if value.flags.writeable:
                source = torch.from_numpy(value)
            else:
                # torch warns that it cannot mark the tensor read-only; it is only read
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    source = torch.from_numpy(value)
            target = torch.from_numpy(total)
            if source.dtype == target.dtype:
                target.add_(source, alpha=weight)
                return
            if not (source.is_contiguous() and target.is_contiguous()):
                target.add_(source.to(target.dtype), alpha=weight)  # a strided view: rare
                return
            flat_source, flat_target = source.view(-1), target.view(-1)
            for start in range(0, flat_source.numel(), CHUNK):  # widened block by block
                stop = start + CHUNK
                flat_target[start:stop].add_(flat_source[start:stop].to(target.dtype), alpha=weight)
            return
        except (TypeError, ValueError, RuntimeError):
            pass  # negative strides, foreign byte order: numpy below
    total += np.multiply(value, weight, dtype=total.dtype)


_TORCH_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_Checked = dict[str, tuple[np.ndarray, Index | None]]
_Buffered = tuple[int, _Checked, float, dict[str, float], float | None, dict[str, int]]
"""A buffered update: position, entries, weight, distances, cosine, covered sizes."""


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

    def target(self, key: str, where: Index | None) -> np.ndarray:
        """Return entry ``key``'s sum (allocated on first use), or its ``where`` slice."""
        total = self.sums.get(key)
        if total is None:
            ref = self.reference[key]
            total = self.sums[key] = np.zeros(ref.shape, dtype=sum_dtype(ref.dtype))
        return total if where is None else total[where]

    def pop(self, key: str) -> np.ndarray:
        """Return entry ``key``'s sum (zeros if nothing was added) and forget it."""
        if key in self.sums:
            return self.sums.pop(key)
        ref = self.reference[key]
        return np.zeros(ref.shape, dtype=sum_dtype(ref.dtype))


class Coverage:
    """Per entry, the weight that covers each element: a float, or an array once partial.

    Whole-entry weights stay one float64 scalar per entry; an entry that receives a
    partial update gets a float64 coverage array (:func:`sum_dtype`).
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

    Every update is added into one float64 running sum per entry as it arrives
    (:func:`sum_dtype`: the result does not depend on the arrival order), with no
    temporary of the model's size on the compiled path (:func:`add_scaled` otherwise);
    the weights are summed in float64. Memory: one sum per model entry, plus a
    coverage array for entries that received partial updates.

    With ``clip_factor > 0`` every update's L2 distance from the reference (the
    current global weights) is clipped to a bound, so that no node can move the
    model further than the cohort's honest nodes move it. Learned parameters and
    batch-norm statistics are measured and bounded separately (:func:`entry_kind`).
    The bound of a kind of entry is the smaller of

    - ``clip_factor`` times its *scale*: the lower median of the distances the
      model's last committed round *accepted* (after clipping, so what an attacker
      sent beyond the bound never enters it), moved by at most a factor
      ``growth`` per round (:func:`next_scale`): a minority of nodes can only pick
      which honest distance is the median, and a majority can move the bound by at
      most ``growth`` per round;
    - ``ceiling`` times the L2 norm of the reference's entries of that kind (a
      scale that does not come from any node: it bounds a node alone in its
      architecture group, and a model's first round).

    When the model has no scale yet (its first round) the round's updates are kept
    until :meth:`result`, which clips them against ``clip_factor`` times this
    round's own lower median (and the ceiling); otherwise each update is measured
    and folded as it arrives (:meth:`_stream`): one pass that computes the
    distance block by block and folds each block while the running distance is
    within the bound, and a correction for the blocks already folded when it is
    not (``benchmarks/aggregation.py`` measures the cost against torch's in-place
    sum).

    A clipped update ``reference + f * (update - reference)`` is folded as
    ``w * f * update + w * (1 - f) * reference``, so clipping allocates nothing.

    With a ``direction`` (FLTrust's idea, Cao et al. NDSS 2021: the server trains
    the model on its own trusted pool and compares), an update pointing away from
    the server's own update (cosine at most ``threshold``) is dropped whole. The
    bound limits how far an update moves the model; the direction check limits
    where: an update that reverses the honest direction (sign flips, IPM, riding
    the bound backwards) is refused instead of being let in at the bound. Unlike
    FLTrust, accepted updates keep their own (bounded) size and example weight, so
    a clean round is the plain bounded mean.

    Parameters
    ----------
    reference : Mapping[str, np.ndarray]
        The current global weights: names, shapes and dtypes of the result, and the
        values of entries no update covers.
    clip_factor : float
        Multiple of the scale an update may move the model (``0`` switches the
        bound off, ceiling included).
    previous : Mapping[str, float] | None
        The scale per kind of entry from the last committed round, or ``None``.
    max_distance : float | None
        An absolute bound instead (``norm-clip``): every kind of entry of every
        update is clipped to this L2 distance as it arrives.
    growth : float
        Largest factor the scale may move between two rounds (``> 1``).
    ceiling : float
        Multiple of the reference's own L2 norm (per kind) no update may exceed
        (``0``: no ceiling).
    direction : Mapping[str, np.ndarray] | None
        The server's own update of this model on its pool (trained minus
        reference), per entry; ``None`` (or a zero or non-finite one) switches the
        direction check off. Only learned parameters are compared.
    threshold : float
        An update whose learned parameters have a cosine of at most this with
        ``direction`` is dropped whole (recorded as a :class:`Clip` of kind
        :data:`DIRECTION`); it neither moves the model nor enters the scale.
    """

    def __init__(
        self,
        reference: Mapping[str, np.ndarray],
        *,
        clip_factor: float = 0.0,
        previous: Mapping[str, float] | None = None,
        max_distance: float | None = None,
        growth: float = DEFAULT_GROWTH,
        ceiling: float = 0.0,
        direction: Mapping[str, np.ndarray] | None = None,
        threshold: float = 0.0,
    ) -> None:
        self.reference = dict(reference)
        self.threshold = float(threshold)
        self.direction: dict[str, np.ndarray] | None = None
        self._direction_norms2: dict[str, float] = {}
        if direction is not None:
            keys = [k for k in self.reference if _is_parameter(k, self.reference[k])]
            good = all(
                k in direction
                and direction[k].shape == self.reference[k].shape
                and direction[k].dtype == self.reference[k].dtype
                for k in keys
            )
            norms2 = {
                k: squared_distance(direction[k], np.zeros_like(direction[k])) for k in keys if good
            }
            norm2 = sum(norms2.values())
            if good and keys and math.isfinite(norm2) and norm2 > 0:
                self.direction = {k: np.ascontiguousarray(direction[k]) for k in keys}
                self._direction_norms2 = norms2
        """Squared L2 norm of each entry of the direction (learned parameters)."""
        self.clip_factor = float(clip_factor)
        self.max_distance = max_distance
        self.growth = float(growth)
        self.previous: dict[str, float] = {}
        if previous and all(math.isfinite(d) and d > 0 for d in previous.values()):
            self.previous = {kind: float(d) for kind, d in previous.items()}
        self.ceilings: dict[str, float] = {}
        if self.clip_factor > 0 and ceiling > 0:
            for kind, norm in reference_norms(self.reference).items():
                if norm > 0:
                    self.ceilings[kind] = float(ceiling) * norm * CEILING_SCALE.get(kind, 1.0)
        self._sizes: dict[str, int] = {}
        """Per kind, the reference's floating elements (a whole-model update covers all)."""
        for key, value in self.reference.items():
            if _floating(value):
                kind = entry_kind(key)
                self._sizes[kind] = self._sizes.get(kind, 0) + int(value.size)
        self._sums = EntrySums(self.reference)
        self._cover = Coverage(self.reference)
        self._count = 0
        self._accepted: dict[str, list[float]] = {}
        """Per scale key (:func:`scale_key`), the distances this round accepted."""
        self._whole: dict[str, list[float]] = {}
        """Per kind, every accepted distance in whole-model units (:meth:`_bound`)."""
        self._sliced: set[str] = set()
        """Kinds of which a slice (an update covering part of the model) was accepted."""
        self._buffer: list[_Buffered] = []
        self._clips: list[Clip] = []
        self._result: dict[str, np.ndarray] | None = None
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._own: dict[str, np.ndarray] | None = None
        """The direction of the update being added, when it came with its own."""

    @property
    def count(self) -> int:
        """Number of updates folded in so far."""
        return self._count

    def _capped(self, kind: str, bound: float) -> float:
        ceiling = self.ceilings.get(kind)
        return bound if ceiling is None else min(bound, ceiling)

    def add(
        self,
        update: Mapping[str, np.ndarray],
        weight: float,
        *,
        index: Mapping[str, Index] | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Add ``weight * update`` (clipped, when bounded) to the sums, ``weight`` to the coverage.

        With ``direction`` (the server's own update of the slice this update was
        trained as, entries shaped like the update's) and a direction check on,
        the update is compared with it instead of the slice of the accumulator's
        direction: a narrow sub-model learns differently from the same part of the
        whole model.

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
        self._own = None
        if direction is not None and self.direction is not None:
            own = {
                k: np.ascontiguousarray(direction[k])
                for k, (v, _) in checked.items()
                if k in self.direction and k in direction
            }
            if all(  # finite: it comes from pool_direction, which checks that once
                k in own and own[k].shape == v.shape and own[k].dtype == v.dtype
                for k, (v, _) in checked.items()
                if k in self.direction
            ):
                self._own = own
        position = self._count
        self._count += 1
        if self.max_distance is None and self.clip_factor <= 0:
            self._fold(checked, w, {})
            return
        covered = self._covered(checked)
        bounds = {kind: self._bound(kind, n) for kind, n in covered.items()}
        if any(b is None for b in bounds.values()):
            distances, cosine = self._measure(checked)
            self._buffer.append((position, checked, w, distances, cosine, covered))
            return
        self._stream(
            position,
            checked,
            w,
            {k: float(b) for k, b in bounds.items() if b is not None},
            covered,
        )

    def _measure(self, checked: _Checked) -> tuple[dict[str, float], float | None]:
        """Return the distances per kind and the cosine with the direction (if any)."""
        squares: dict[str, float] = {}
        dot = norm2 = 0.0
        for key, (value, where) in checked.items():
            if not _floating(value):
                continue
            ref = self.reference[key]
            base = ref if where is None else ref[where]
            along = self._along(key, where)
            kind = entry_kind(key)
            _, squares[kind], part = measure_and_fold(
                value, base, None, 0.0, squares.get(kind, 0.0), None, self._scratch, along
            )
            if along is not None:
                dot += part
                norm2 += squared_distance(along, np.zeros_like(along))
        distances = {kind: math.sqrt(square) for kind, square in squares.items()}
        return distances, self._cosine(dot, distances, norm2)

    def _along(self, key: str, where: Index | None) -> np.ndarray | None:
        """Return the part of the direction that entry ``key`` (at ``where``) is compared with."""
        if self.direction is None or key not in self.direction:
            return None
        if self._own is not None:
            return self._own[key]
        along = self.direction[key]
        return along if where is None else along[where]

    def _cosine(self, dot: float, distances: Mapping[str, float], norm2: float) -> float | None:
        """Cosine of an update's learned parameters with the direction (``None``: unknown)."""
        if self.direction is None:
            return None
        distance = distances.get("parameters", 0.0)
        if distance <= 0 or norm2 <= 0 or not math.isfinite(distance):
            return None
        return max(-1.0, min(1.0, dot / (distance * math.sqrt(norm2))))

    def _refused(self, position: int, cosine: float | None) -> bool:
        """Return whether the direction check drops the update (and record it)."""
        if cosine is None or cosine > self.threshold:
            return False
        self._clips.append(Clip(position, DIRECTION, cosine, self.threshold))
        return True

    def _accept(
        self,
        position: int,
        distances: Mapping[str, float],
        bounds: Mapping[str, float],
        covered: Mapping[str, int],
    ) -> dict[str, float]:
        """Record what is accepted of each kind (per slice class) and return the clip factors."""
        factors: dict[str, float] = {}
        for kind, distance in distances.items():
            bound = bounds.get(kind, 0.0)
            if bound > 0 and distance > bound:
                factors[kind] = bound / distance
                self._clips.append(Clip(position, kind, distance, bound))
                distance = bound
            if distance > 0:
                size, n = self._sizes.get(kind, 0), covered.get(kind, 0)
                self._accepted.setdefault(scale_key(kind, n, size), []).append(distance)
                if n > 0:  # every update, in whole-model units: the pooled scale
                    self._whole.setdefault(kind, []).append(distance * math.sqrt(size / n))
                if 0 < n < size:
                    self._sliced.add(kind)
        return factors

    def _stream(
        self,
        position: int,
        checked: _Checked,
        w: float,
        bounds: Mapping[str, float],
        covered: Mapping[str, int],
    ) -> None:
        """Measure and fold one update in one pass over it (see the class docstring)."""
        squares: dict[str, float] = {}
        dot = norm2 = 0.0
        folded: dict[str, int] = {}  # per key: elements folded at weight w (a prefix)
        over: set[str] = set()  # kinds whose running distance passed their bound
        for key, (value, where) in checked.items():
            ref = self.reference[key]
            if not _floating(value):
                self._sums.add(key, value, w, where)
                continue
            kind = entry_kind(key)
            bound = bounds[kind]
            base = ref if where is None else ref[where]
            total = self._sums.target(key, where)
            along = self._along(key, where)
            done, square, part = measure_and_fold(
                value,
                base,
                total,
                w,
                squares.get(kind, 0.0),
                None if kind in over else bound * bound,
                self._scratch,
                along,
            )
            if along is not None:
                dot += part
                norm2 += (
                    self._direction_norms2[key]
                    if where is None and self._own is None
                    else squared_distance(along, np.zeros_like(along))
                )
            squares[kind] = square
            folded[key] = done
            if done < value.size:
                over.add(kind)
        distances = {kind: math.sqrt(s) for kind, s in squares.items()}
        if self._refused(position, self._cosine(dot, distances, norm2)):
            for key, (value, where) in checked.items():  # take back what went in
                if not _floating(value):
                    self._sums.add(key, value, -w, where)
                elif folded[key]:
                    flat_total = _flat(self._sums.target(key, where))
                    add_scaled(flat_total[: folded[key]], _flat(value)[: folded[key]], -w)
            return
        factors = self._accept(position, distances, bounds, covered)
        for key, (value, where) in checked.items():
            if not _floating(value):
                self._cover.add(key, w, where)
                continue
            factor = factors.get(entry_kind(key))
            if factor is not None:
                ref = self.reference[key]
                base = ref if where is None else ref[where]
                total = self._sums.target(key, where)
                flat_total, flat_value = _flat(total), _flat(value)
                done = folded[key]
                # the first `done` elements went in at w: take w (1 - f) of them back out;
                # the rest go in at w f; the reference at w (1 - f) (one pass if compiled)
                if not fused.correct(
                    flat_value, base, flat_total, done, -w * (1 - factor), w * factor
                ):
                    if done:
                        add_scaled(flat_total[:done], flat_value[:done], -w * (1 - factor))
                    if done < value.size:
                        add_scaled(flat_total[done:], flat_value[done:], w * factor)
                    add_scaled(total, base, w * (1 - factor))
            elif folded[key] < value.size:  # not over after all (another entry was)
                flat_total, flat_value = _flat(self._sums.target(key, where)), _flat(value)
                add_scaled(flat_total[folded[key] :], flat_value[folded[key] :], w)
            self._cover.add(key, w, where)

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
        """Clip and fold the buffered updates against this round's own scales.

        Per kind, an update of a slice class (:func:`scale_key`) that at least two
        buffered updates share is bounded by that class's lower median distance; an
        update alone in its class by the lower median of the *other* updates' distances
        in whole-model units, converted to its size (so its bound never comes from
        itself); an update alone in the round by its own distance (and the ceiling).
        """
        if not self._buffer:
            return
        kept = [item for item in self._buffer if not self._refused(item[0], item[4])]
        members: dict[str, list[float]] = {}
        whole: dict[str, list[tuple[int, float]]] = {}
        for i, (_, _, _, distances, _, covered) in enumerate(kept):
            for kind, distance in distances.items():
                size, n = self._sizes.get(kind, 0), covered.get(kind, 0)
                if distance > 0 and n > 0:
                    members.setdefault(scale_key(kind, n, size), []).append(distance)
                    whole.setdefault(kind, []).append((i, distance * math.sqrt(size / n)))
        for i, (position, checked, w, distances, _, covered) in enumerate(kept):
            bounds: dict[str, float] = {}
            for kind in distances:
                size, n = self._sizes.get(kind, 0), covered.get(kind, 0)
                own = members.get(scale_key(kind, n, size), [])
                others = [x for j, x in whole.get(kind, []) if j != i]
                if len(own) >= 2:
                    scale = lower_median(own)
                elif others and n > 0:
                    scale = lower_median(others) * math.sqrt(n / size)
                elif own:
                    scale = own[0]
                else:
                    continue  # nothing moved: no bound needed
                bounds[kind] = self._capped(kind, self.clip_factor * scale)
            self._fold(checked, w, self._accept(position, distances, bounds, covered))
        self._buffer = []

    def _bound(self, kind: str, covered: int) -> float | None:
        """Return the streaming bound of an update's ``kind`` (``None``: unknown, buffer it).

        The scale of the update's own slice class (:func:`scale_key`) when the last
        round had one; else the pooled whole-model scale (``kind@all``, or the
        whole-model class's) converted to the slice's size, ``sqrt(covered / size)``.
        """
        if self.max_distance is not None:
            return self.max_distance
        if self.clip_factor <= 0 or not self.previous:
            return None
        size = self._sizes.get(kind, 0)
        key = scale_key(kind, covered, size)
        if key in self.previous:
            return self._capped(kind, self.clip_factor * self.previous[key])
        pooled = self.previous.get(f"{kind}@{POOLED}", self.previous.get(kind))
        if pooled is None or size <= 0:
            return None
        return self._capped(kind, self.clip_factor * pooled * math.sqrt(covered / size))

    def _previous_scale(self, kind: str, key: str) -> float | None:
        """Return the last round's scale of ``key``, else the pooled one converted to it."""
        if key in self.previous:
            return self.previous[key]
        _, covered = parse_scale_key(key)
        pooled = self.previous.get(f"{kind}@{POOLED}", self.previous.get(kind))
        size = self._sizes.get(kind, 0)
        if pooled is None or covered is None or size <= 0:
            return pooled
        return pooled * math.sqrt(covered / size)

    def _covered(self, checked: _Checked) -> dict[str, int]:
        """Per kind, how many of the reference's floating elements the update covers."""
        covered: dict[str, int] = {}
        for key, (value, _) in checked.items():
            if _floating(value):
                kind = entry_kind(key)
                covered[kind] = covered.get(kind, 0) + int(value.size)
        return covered

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
        """Return the next round's scale per kind of entry and the clipped updates.

        The scale is :func:`next_scale` of the distances this round accepted (what
        was folded, after clipping) and the last round's scale.
        """
        medians: dict[str, float] = {}
        for key, accepted in sorted(self._accepted.items()):
            kind, size = parse_scale_key(key)
            if size is not None and len(accepted) < 2:
                continue  # a slice alone in its class: never its own scale
            if size is None and kind in self._sliced and len(accepted) < 2:
                continue  # a whole model alone among slices: the same
            medians[key] = next_scale(accepted, self._previous_scale(kind, key), self.growth)
        for kind in sorted(self._sliced):
            key = f"{kind}@{POOLED}"
            anchor = self._previous_scale(kind, key)
            medians[key] = next_scale(self._whole[kind], anchor, self.growth)
        for key, scale in self.previous.items():  # a class nobody moved keeps its scale
            medians.setdefault(key, scale)
        return AccumulatorReport(medians=medians, clips=tuple(self._clips))


@dataclass(frozen=True)
class MeanAggregator:
    """Example-weighted mean (FedAvg), streaming, with per-entry coverage.

    ``clip_factor > 0`` bounds each update's distance from the global model by that
    multiple of the accepted median distance of the last round, moved by at most
    ``growth`` per round, and by ``ceiling`` times the global model's own norm (see
    :class:`MeanAccumulator`).
    """

    clip_factor: float = 0.0
    name: str = "mean"
    growth: float = DEFAULT_GROWTH
    ceiling: float = 0.0
    threshold: float = 0.0

    def accumulator(
        self,
        reference: Mapping[str, np.ndarray],
        *,
        previous: AccumulatorReport | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
    ) -> Accumulator:
        """Return a fresh :class:`MeanAccumulator` bounded by the previous round's scale."""
        return MeanAccumulator(
            reference,
            clip_factor=self.clip_factor,
            previous=None if previous is None else previous.medians,
            growth=self.growth,
            ceiling=self.ceiling,
            direction=direction,
            threshold=self.threshold,
        )


@dataclass(frozen=True)
class AggregatorSettings:
    """The run-config knobs of the aggregators (:mod:`strategies.core.robust`).

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
    growth : float
        ``bound-growth``: largest factor ``mean``'s clip scale moves per round.
    ceiling : float
        ``clip-ceiling``: ``mean`` never lets an update move the global model by more
        than this multiple of the model's own L2 norm, per kind of entry (0: off).
    threshold : float
        ``trust-threshold``: ``mean`` drops an update whose cosine with the server's
        own update on its pool is at most this (when the server computes one).
    """

    clip_factor: float = 0.0
    trim_fraction: float = 0.1
    krum_byzantine: int = 1
    clip_norm: float = 10.0
    growth: float = DEFAULT_GROWTH
    ceiling: float = 0.0
    threshold: float = 0.0

    @classmethod
    def from_run(cls, run: RunConfig) -> AggregatorSettings:
        """Take the settings from a parsed run config."""
        return cls(
            clip_factor=run.clip_factor,
            trim_fraction=run.trim_fraction,
            krum_byzantine=run.krum_byzantine,
            clip_norm=run.clip_norm,
            growth=run.bound_growth,
            ceiling=run.clip_ceiling,
            threshold=run.trust_threshold,
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


register_aggregator(
    "mean",
    lambda settings: MeanAggregator(
        settings.clip_factor,
        growth=settings.growth,
        ceiling=settings.ceiling,
        threshold=settings.threshold,
    ),
)
