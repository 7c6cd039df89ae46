"""Per-entry running sums in float64 and the coverage of each element.

Every update is added to one float64 sum per global entry as it arrives
(:func:`sum_dtype`): float32 sums folded in arrival order are not associative, and
a seeded run must give the same numbers whatever order the replies arrive in.
:func:`check_update` pairs each entry with the index it covers before anything is
added, so a bad update leaves the sums as they were.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from strategies.core import fused
from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import Index
from strategies.core.measure import CHUNK, TORCH_DTYPES, flat


def check_index(key: str, index: Index, value: np.ndarray, ref: np.ndarray) -> Index:
    """Return ``index`` if it places ``value`` inside ``ref`` as a range per dimension.

    Raises
    ------
    AggregationError
        If it has another number of dimensions, a step, or spans another shape.
    """
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
        and fused.fold(flat(value), flat(total), weight)
    ):
        return
    if (
        value.dtype in TORCH_DTYPES
        and total.dtype in TORCH_DTYPES
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


def clipped(value: np.ndarray, base: np.ndarray, factor: float) -> np.ndarray:
    """Return ``base + factor * (value - base)`` in float64, rounded once to ``value``'s dtype.

    The clipped update, as a node would have sent it had it clipped itself. It is
    added to the sums as one term (``weight * clipped``), not as ``weight * factor *
    value`` plus ``weight * (1 - factor) * base``: in the two-term form an element
    the node left unchanged came back as ``base`` to within a float64 rounding, and
    the mean of two nodes, exactly halfway between two float32 values when
    computed exactly, was rounded up or down by the order the two arrived in (the
    README demo's two-node group moved in the eighth digit, and a few rounds later
    its accuracies in the third). Whole-valued weights times float32 values are
    exact in float64, and so are most sums of them: with one term per update the
    sum no longer depends on the order (``tests/test_aggregation.py``).

    >>> clipped(np.array([1.0, 3.0], np.float32), np.array([1.0, 1.0], np.float32), 0.25)
    array([1. , 1.5], dtype=float32)
    """
    out = value.astype(np.float64)
    out -= base
    out *= factor
    out += base
    result: np.ndarray = out.astype(value.dtype)
    return result


CLIP_BLOCK = 1 << 13
"""Elements per block :func:`add_clipped` clips at a time: its temporaries (12 bytes an
element) stay under 100 KiB, so streaming holds two updates and little more
(``tests/test_bounded_mean.py``); the per-block overhead is a few microseconds."""


def add_clipped(
    total: np.ndarray, value: np.ndarray, base: np.ndarray, factor: float, weight: float
) -> None:
    """Add ``weight * clipped(value, base, factor)`` to ``total`` in place.

    Block by block (:data:`CLIP_BLOCK` elements) when all three
    are contiguous, so the temporaries stay a block's size; a strided ``total`` (a
    sub-model slice of a sum) takes one temporary of the entry's size.
    """
    if not (total.flags.c_contiguous and value.flags.c_contiguous and base.flags.c_contiguous):
        add_scaled(total, clipped(value, base, factor), weight)
        return
    flat_total, flat_value, flat_base = flat(total), flat(value), flat(base)
    for start in range(0, flat_value.size, CLIP_BLOCK):
        stop = start + CLIP_BLOCK
        add_scaled(
            flat_total[start:stop],
            clipped(flat_value[start:stop], flat_base[start:stop], factor),
            weight,
        )


Checked = dict[str, tuple[np.ndarray, Index | None]]


def check_update(
    reference: Mapping[str, np.ndarray],
    update: Mapping[str, np.ndarray],
    index: Mapping[str, Index] | None,
) -> Checked:
    """Pair every entry of ``update`` with its index, checking names, dtypes and shapes.

    An entry without an index must have the reference's shape; an index that spans
    the whole entry is dropped (``None``).

    Raises
    ------
    AggregationError
        If an entry is unknown, of another dtype, or does not fit its index.
    """
    checked: Checked = {}
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
            where = check_index(key, where, value, ref)
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
