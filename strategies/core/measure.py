"""Distances of updates from the global model, measured block by block (and folded).

:func:`measure_and_fold` is the bounded ``mean``'s hot path: per entry it measures
an update's L2 distance from the reference (and its dot product with the server's
direction) in blocks of :data:`CHUNK` elements, and adds each block to the sums
while the running distance is still within the bound, so an update that needs no
clipping costs one pass. With numba it is one compiled loop
(:mod:`strategies.core.fused`); otherwise torch, block by block.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from strategies.core import fused
from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import Index, entry_kind

CHUNK = 1 << 20
"""Elements per block when distances are measured: bounds the temporary (4 MiB of
float32, reused for every update of a round) and stays in cache between the measure
and the fold of a block. Smaller blocks cost more in per-call overhead than they
save (``benchmarks/aggregation.py``)."""


def is_parameter(key: str, value: np.ndarray) -> bool:
    """Return whether an entry is a learned floating parameter (not statistics, not a count)."""
    return is_floating(value) and entry_kind(key) == "parameters"


def is_floating(value: np.ndarray) -> bool:
    """Return whether an entry holds floating values (real: float16 to longdouble).

    The dtype's kind, not :func:`numpy.issubdtype`: the same answer at a tenth of the
    cost, and the bounded mean asks it several times per entry of every update.
    """
    return value.dtype.kind == "f"


def flat(array: np.ndarray) -> np.ndarray:
    """Return a 1-d view of ``array`` (a copy only when it cannot be viewed flat)."""
    return array.reshape(-1)


TORCH_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""Entry dtypes torch takes on the same memory."""


def torch_view(array: np.ndarray) -> torch.Tensor | None:
    """``array`` as a flat torch tensor on the same memory, or ``None`` if torch cannot view it."""
    if array.dtype not in TORCH_DTYPES or not array.flags.c_contiguous or array.size == 0:
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


def block_dot(a: np.ndarray, b: np.ndarray, direction: np.ndarray) -> float:
    """Return ``(a - b) . direction`` in float64 (one temporary of the block's size)."""
    diff = np.subtract(a, b, dtype=np.float64)
    return float(np.vdot(diff, np.asarray(direction, dtype=np.float64)))


def block_square(a: np.ndarray, b: np.ndarray) -> float:
    """Return ``||a - b||^2`` in float64 (one temporary of the block's size)."""
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
        flat_total = None if total is None or not total.flags.c_contiguous else flat(total)
        flat_direction = (
            None if direction is None or not direction.flags.c_contiguous else flat(direction)
        )
        if (total is None) == (flat_total is None) and (direction is None) == (
            flat_direction is None
        ):
            fused_result = fused.measure_fold(
                flat(value), flat(base), flat_total, weight, square, limit, flat_direction
            )
            if fused_result is not None:
                return fused_result
    v, b = torch_view(value), torch_view(base)
    t = None if total is None else torch_view(total)
    d = None if direction is None else torch_view(direction)
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
                dot = block_dot(value, base, direction)
            return 0, square + block_square(value, base), dot
        rows = max(1, CHUNK // max(1, n // value.shape[0]))
        for start in range(0, value.shape[0], rows):
            rows_ = slice(start, start + rows)
            square += block_square(value[rows_], base[rows_])
            if direction is not None:
                dot += block_dot(value[rows_], base[rows_], direction[rows_])
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
                along = block_dot(
                    flat(value)[start:stop], flat(base)[start:stop], flat(direction)[start:stop]
                )
            dot += along
        if not math.isfinite(block):  # float32 overflow: measure this block in float64
            block = block_square(flat(value)[start:stop], flat(base)[start:stop])
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
        if is_floating(value) and value.size:
            kind = entry_kind(key)
            squares[kind] = squares.get(kind, 0.0) + squared_distance(value, np.zeros_like(value))
    return {kind: math.sqrt(square) for kind, square in squares.items()}


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
