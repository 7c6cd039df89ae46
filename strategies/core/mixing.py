"""Pre-aggregation: mixing the round's updates before a robust rule combines them.

Robust rules (median, trimmed mean, Krum, centered clipping) assume the honest
updates are close to each other. On skewed data they are not, and an attacker that
hides among them (Mimic, "a little is enough") passes. Mixing first makes the honest
inputs of the rule closer (Karimireddy et al., ICLR 2022; Allouah et al., AISTATS
2023), selected by run-config ``pre-aggregation``:

- ``nnm`` (nearest-neighbour mixing): each update is replaced by the mean of its
  ``k - f`` nearest updates (itself included), ``f`` = ``krum-byzantine``;
- ``bucketing``: the updates are shuffled and the mean of each bucket of
  ``bucket-size`` becomes one input (a last, smaller bucket too).

Both work on the round's stack of flattened updates, so they need an aggregator that
keeps the round's updates (``median``, ``trimmed-mean``, ``krum``, ``multi-krum``,
``centered-clip``); the streaming ``mean`` and ``norm-clip`` refuse them.

Same seed, same numbers: the bucketing shuffle is drawn from the run's ``seed`` and
the current global model (so it changes every round, and no client chooses it), over
the updates put in an order of their contents first (so the order in which replies
arrived does not matter).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from strategies.core.aggregation import AggregationError
from tessera.config.choices import PRE_AGGREGATIONS, PreAggregation

__all__ = [
    "PRE_AGGREGATIONS",
    "Mixing",
    "PreAggregation",
    "bucket_means",
    "bucket_order",
    "content_order",
    "nearest_neighbour_mixing",
    "pairwise_sq_distances",
]


# ------------------------------------------------------------------------- pure maths
def pairwise_sq_distances(stack: np.ndarray, center: np.ndarray | None = None) -> np.ndarray:
    """Squared L2 distances between the rows of ``stack`` (``(k, P)`` -> ``(k, k)``).

    With ``center`` (the global model) the rows are taken relative to it first
    (distances do not change): rows of weights are far from the origin and close to
    each other, and the Gram-matrix form ``|a|^2 + |b|^2 - 2 a.b`` would cancel most
    of their digits. (Not their mean: one absurd row would move it.) The diagonal is
    exactly 0 and nothing is negative.
    """
    centred = stack if center is None else stack - center
    sq = np.einsum("ij,ij->i", centred, centred)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (centred @ centred.T), 0.0)
    np.fill_diagonal(dist, 0.0)
    return np.asarray(dist)


def nearest_neighbour_mixing(
    stack: np.ndarray, byzantine: int, center: np.ndarray | None = None
) -> np.ndarray:
    """Replace each row by the mean of its ``k - f`` nearest rows, itself included.

    ``center``: see :func:`pairwise_sq_distances`.

    Ties are broken by row order (a stable sort), so the result does not depend on
    the sorting algorithm.

    Raises
    ------
    AggregationError
        If ``f`` is negative or not below the number of rows.
    """
    k = stack.shape[0]
    if not 0 <= byzantine < k:
        raise AggregationError(
            f"nearest-neighbour mixing with f={byzantine} needs more than {byzantine} updates, "
            f"got {k}; lower run-config 'krum-byzantine' or wait for more replies"
        )
    dist = pairwise_sq_distances(stack, center)
    nearest = np.argsort(dist, axis=1, kind="stable")[:, : k - byzantine]
    out = np.empty_like(stack)
    for i, rows in enumerate(nearest):  # one row at a time: k x P memory, not k^2 x P
        out[i] = stack[np.sort(rows)].mean(axis=0)
    return out


def bucket_means(stack: np.ndarray, size: int, order: np.ndarray) -> np.ndarray:
    """Means of consecutive buckets of ``size`` rows taken in ``order`` (a last, smaller one too).

    Raises
    ------
    AggregationError
        If ``size`` is not positive or ``order`` is not a permutation of the rows.
    """
    k = stack.shape[0]
    if size < 1:
        raise AggregationError(
            f"bucket size {size} must be at least 1; set run-config 'bucket-size'"
        )
    if sorted(order.tolist()) != list(range(k)):
        raise AggregationError("bucketing needs a permutation of the updates")
    shuffled = stack[order]
    return np.stack([shuffled[i : i + size].mean(axis=0) for i in range(0, k, size)])


def content_order(stack: np.ndarray) -> np.ndarray:
    """Return an order of the rows fixed by their contents (CRC-32 and Adler-32 of their bytes).

    Two rounds that received the same updates in another order put them in the same
    order here (rows whose two checksums both agree are, in practice, equal, and then
    their order does not matter).
    """
    keys = []
    for row in stack:
        data = np.ascontiguousarray(row).data
        keys.append((zlib.crc32(data), zlib.adler32(data)))
    return np.asarray(sorted(range(len(keys)), key=lambda i: keys[i]), dtype=np.intp)


def bucket_order(stack: np.ndarray, seed: int, reference: np.ndarray) -> np.ndarray:
    """Return the bucketing shuffle: the content order permuted by ``seed`` and the global model."""
    salt = zlib.crc32(np.ascontiguousarray(reference).tobytes())
    rng = np.random.default_rng([seed, salt])
    canonical = content_order(stack)
    return np.asarray(canonical[rng.permutation(len(canonical))])


# ------------------------------------------------------------------------ the setting
@dataclass(frozen=True)
class Mixing:
    """The run's pre-aggregation (run-config ``pre-aggregation`` and its keys).

    Attributes
    ----------
    kind : PreAggregation
        ``none``, ``nnm`` or ``bucketing``.
    byzantine : int
        The ``f`` of ``nnm`` (``krum-byzantine``).
    bucket_size : int
        Updates per bucket (``bucket-size``).
    seed : int
        The run's ``seed`` (the bucketing shuffle).
    """

    kind: PreAggregation = "none"
    byzantine: int = 1
    bucket_size: int = 2
    seed: int = 0

    def apply(self, stack: np.ndarray, reference: np.ndarray) -> np.ndarray:
        """Mix the ``(k, P)`` stack of flattened updates; ``reference`` is the global model's.

        Raises
        ------
        AggregationError
            If the mixing cannot apply to this many updates.
        """
        if self.kind == "nnm":
            return nearest_neighbour_mixing(stack, self.byzantine, reference)
        if self.kind == "bucketing":
            return bucket_means(stack, self.bucket_size, bucket_order(stack, self.seed, reference))
        return stack
