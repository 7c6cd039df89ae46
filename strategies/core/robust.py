"""Robust aggregators behind the Aggregator seam: median, trimmed mean, (multi-)Krum, norm clip.

Selected by run-config ``aggregator``; each limits how far a few hostile or broken
updates can move the global model.

``norm-clip`` streams like ``mean``: each update's difference to the current global
weights is scaled down to at most ``clip-norm`` (L2 over all entries) before the
example-weighted mean, so memory stays one accumulator per model.

``median``, ``trimmed-mean``, ``krum`` and ``multi-krum`` need every update of the
round at once: they keep the round's updates of a model in memory, flattened to
float64, and stack (and sort or copy) them at the end of the round: k updates of P
parameters peak at about 24 k P bytes (measured by ``benchmarks/robustness.py``:
2.3 GiB for 100 updates of 1M parameters). They ignore the
example weights (a node's claimed size cannot buy influence) and need full updates
(no per-entry coverage).

- ``median``: coordinate-wise median.
- ``trimmed-mean``: per coordinate, drop the ``ceil(trim-fraction x k)`` largest and
  smallest values and average the rest (Yin et al., 2018).
- ``krum``: the update whose summed squared distance to its ``k - f - 2`` nearest
  others is smallest, with ``f`` = ``krum-byzantine`` (Blanchard et al., 2017);
  ``multi-krum`` averages the ``k - f`` best-scored updates.
- ``centered-clip``: centered clipping (Karimireddy et al., ICML 2021): starting from
  the global model, ``cc-iterations`` times move the centre by the mean of the
  updates' differences from it, each clipped to L2 radius ``cc-tau`` (0: the median
  distance of the round's updates from the global model, as they came, so the
  honest majority sets the radius: :func:`median_radius`).

Run-config ``pre-aggregation`` (``nnm``, ``bucketing``; :mod:`strategies.core.mixing`)
mixes the kept updates before any of these rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import (
    Accumulator,
    AccumulatorReport,
    AggregatorSettings,
    Index,
    register_aggregator,
)
from strategies.core.mean import MeanAccumulator
from strategies.core.mixing import Mixing, pairwise_sq_distances

NO_MIXING = Mixing()
"""The buffered rules' default: the updates as they came."""


# ------------------------------------------------------------------------- pure maths
def flatten(update: Mapping[str, np.ndarray], keys: Sequence[str]) -> np.ndarray:
    """Concatenate the floating entries ``keys`` of ``update`` into one float64 vector."""
    return np.concatenate([np.asarray(update[k], dtype=np.float64).ravel() for k in keys])


def coordinate_median(stack: np.ndarray) -> np.ndarray:
    """Median over axis 0 of ``(k, ...)``."""
    return np.asarray(np.median(stack, axis=0))


def trimmed_mean(stack: np.ndarray, trim: int) -> np.ndarray:
    """Mean over axis 0 after dropping the ``trim`` smallest and largest per coordinate.

    Raises
    ------
    AggregationError
        If nothing would be left (``2 * trim >= k``).
    """
    k = stack.shape[0]
    if trim < 0 or 2 * trim >= k:
        raise AggregationError(
            f"trimming {trim} from each end of {k} updates leaves nothing; lower run-config "
            "'trim-fraction' or wait for more replies"
        )
    ordered = np.sort(stack, axis=0)
    return np.asarray(ordered[trim : k - trim].mean(axis=0))


def krum_scores(
    vectors: np.ndarray, byzantine: int, center: np.ndarray | None = None
) -> np.ndarray:
    """Krum score of each row: summed squared distance to its ``k - f - 2`` nearest rows.

    ``center`` (the global model) keeps the distances' digits
    (:func:`strategies.core.mixing.pairwise_sq_distances`).

    Raises
    ------
    AggregationError
        If ``k <= 2 f + 2`` (Krum's condition).
    """
    k = vectors.shape[0]
    if k <= 2 * byzantine + 2:
        raise AggregationError(
            f"Krum with f={byzantine} needs more than {2 * byzantine + 2} updates, got {k}; "
            "lower run-config 'krum-byzantine' or wait for more replies"
        )
    dist = pairwise_sq_distances(vectors, center)
    np.fill_diagonal(dist, np.inf)
    nearest = np.sort(dist, axis=1)[:, : k - byzantine - 2]
    return np.asarray(nearest.sum(axis=1))


def centered_clipping(
    stack: np.ndarray, center: np.ndarray, tau: float, iterations: int
) -> np.ndarray:
    """Centered clipping: ``iterations`` times, ``v += mean_i clip(x_i - v, tau)``.

    ``clip(d, tau)`` scales ``d`` down to L2 norm ``tau`` if longer; ``v`` starts at
    ``center``. See :func:`median_radius` for the radius the aggregator uses when
    run-config ``cc-tau`` is 0.

    Raises
    ------
    AggregationError
        If there is nothing to combine, ``tau`` is not positive and finite or
        ``iterations`` is below 1.
    """
    if stack.shape[0] == 0:
        raise AggregationError("nothing to aggregate: no update was added")
    if iterations < 1:
        raise AggregationError(
            f"centered clipping needs at least one iteration, got {iterations}; "
            "set run-config 'cc-iterations'"
        )
    if not (math.isfinite(tau) and tau > 0):
        raise AggregationError(
            f"centered clipping needs a positive, finite radius, got {tau:g}; set run-config "
            "'cc-tau' (0: the median distance of the round's updates)"
        )
    v = np.array(center, dtype=np.float64, copy=True)
    for _ in range(iterations):
        diff = stack - v
        norms = np.sqrt(np.einsum("ij,ij->i", diff, diff))
        with np.errstate(divide="ignore", invalid="ignore"):
            factors = np.where(norms > tau, tau / norms, 1.0)
        v = v + (diff * factors[:, None]).mean(axis=0)
    return v


def median_radius(rows: np.ndarray, center: np.ndarray) -> float:
    """Return the lower median of the rows' L2 distances from ``center``.

    ``centered-clip``'s radius when ``cc-tau`` is 0, taken from the round's updates as
    they came (before any mixing): while attackers are a minority the median is an
    honest node's distance, however far they send theirs. (Taken after bucketing
    it is not: with 3 attackers in 10 and buckets of 2, most buckets can hold one.)
    """
    diff = rows - center
    norms = np.sort(np.sqrt(np.einsum("ij,ij->i", diff, diff)))
    return float(norms[(len(norms) - 1) // 2])


def clip_to_norm(delta: np.ndarray, max_norm: float) -> tuple[np.ndarray, float]:
    """Scale ``delta`` down to L2 norm ``max_norm`` if larger; return it and the factor."""
    norm = float(np.linalg.norm(delta))
    if norm <= max_norm or norm == 0.0:
        return delta, 1.0
    factor = max_norm / norm
    return delta * factor, factor


# ---------------------------------------------------------------------- accumulators
class BufferedAccumulator:
    """Keeps the round's updates and combines them at the end (see the module docstring).

    Parameters
    ----------
    reference : Mapping[str, np.ndarray]
        The current global weights (names, shapes, dtypes of the result).
    combine : Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
        Maps the ``(k', P)`` float64 stack of flattened floating entries after the
        mixing, the flattened global model (``(P,)``) and the ``(k, P)`` stack as the
        updates came (before the mixing) to ``(P,)``.
    mixing : Mixing
        The pre-aggregation applied to the stack first (none by default).
    """

    def __init__(
        self,
        reference: Mapping[str, np.ndarray],
        combine: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
        mixing: Mixing | None = None,
    ) -> None:
        self.reference = dict(reference)
        self.combine = combine
        self.mixing = mixing if mixing is not None else Mixing()
        self.keys = [k for k, v in self.reference.items() if np.issubdtype(v.dtype, np.floating)]
        self._rows: list[np.ndarray] = []

    @property
    def count(self) -> int:
        """Number of updates kept so far."""
        return len(self._rows)

    def add(
        self,
        update: Mapping[str, np.ndarray],
        weight: float,
        *,
        index: Mapping[str, Index] | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
        stretch: float = 1.0,
    ) -> None:
        """Keep one full update (the weight, ``direction`` and ``stretch`` are ignored).

        Raises
        ------
        AggregationError
            If the update is partial or does not match the global weights.
        """
        if index:
            raise AggregationError("this aggregator needs full updates (no per-entry coverage)")
        if set(update) != set(self.reference):
            raise AggregationError(
                f"update has entries {sorted(set(update) ^ set(self.reference))[:5]} that "
                "differ from the global model's"
            )
        for key, ref in self.reference.items():
            value = update[key]
            if value.shape != ref.shape or value.dtype != ref.dtype:
                raise AggregationError(
                    f"entry '{key}' is {value.dtype}{value.shape}, expected {ref.dtype}{ref.shape}"
                )
        self._rows.append(flatten(update, self.keys))

    def report(self) -> AccumulatorReport:
        """Nothing is measured or clipped: the combination rule itself is the defence."""
        return AccumulatorReport()

    def result(self) -> dict[str, np.ndarray]:
        """Combine the kept updates; non-floating entries keep the reference.

        Raises
        ------
        AggregationError
            If no update was kept, or the rule cannot combine this many.
        """
        if not self._rows:
            raise AggregationError("nothing to aggregate: no update was added")
        center = flatten(self.reference, self.keys)
        rows = np.stack(self._rows)
        combined = self.combine(self.mixing.apply(rows, center), center, rows)
        out: dict[str, np.ndarray] = {}
        offset = 0
        for key, ref in self.reference.items():
            if key in self.keys:
                size = ref.size
                out[key] = combined[offset : offset + size].reshape(ref.shape).astype(ref.dtype)
                offset += size
            else:
                out[key] = ref.copy()
        return out


class NormClipAccumulator(MeanAccumulator):
    """Example-weighted mean of updates whose distance to the global model is clipped.

    Learned parameters and batch-norm statistics are each clipped to ``max_norm``
    (:func:`strategies.core.aggregators.entry_kind`); partial updates (per-entry coverage)
    are measured and clipped on the part of the global model they cover.
    """

    def __init__(self, reference: Mapping[str, np.ndarray], max_norm: float) -> None:
        super().__init__(reference, max_distance=max_norm)

    @property
    def clipped(self) -> int:
        """Number of clips so far (one per kind of entry scaled down)."""
        self._settle_held()
        return len(self._clips)


# ------------------------------------------------------------------------ aggregators
@dataclass(frozen=True, kw_only=True)
class BufferedAggregator:
    """An aggregator that keeps the round's updates, mixes them, then combines them.

    Subclasses give the rule (:meth:`combine`); :attr:`mixing` is the run's
    pre-aggregation (keyword-only, so a subclass's own fields come first).
    """

    mixing: Mixing = NO_MIXING

    def combine(self, stack: np.ndarray, center: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """Combine the mixed ``(k', P)`` stack (see :class:`BufferedAccumulator`)."""
        raise NotImplementedError

    def accumulator(
        self,
        reference: Mapping[str, np.ndarray],
        *,
        previous: AccumulatorReport | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
    ) -> Accumulator:
        """Return a buffered accumulator combining by :meth:`combine`."""
        return BufferedAccumulator(reference, self.combine, self.mixing)


@dataclass(frozen=True)
class MedianAggregator(BufferedAggregator):
    """Coordinate-wise median (buffers the round's updates)."""

    name: str = "median"

    def combine(self, stack: np.ndarray, center: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """Return the coordinate-wise median."""
        return coordinate_median(stack)


@dataclass(frozen=True)
class TrimmedMeanAggregator(BufferedAggregator):
    """Coordinate-wise trimmed mean (buffers the round's updates)."""

    trim_fraction: float = 0.1
    name: str = "trimmed-mean"

    def combine(self, stack: np.ndarray, center: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """Return the trimmed mean, ``ceil(trim_fraction x k)`` cut from each end."""
        return trimmed_mean(stack, math.ceil(self.trim_fraction * stack.shape[0]))


@dataclass(frozen=True)
class KrumAggregator(BufferedAggregator):
    """Krum (one update) or multi-Krum (mean of the ``k - f`` best) (buffers updates)."""

    byzantine: int = 1
    multi: bool = False
    name: str = "krum"

    def combine(self, stack: np.ndarray, center: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """Return the best-scored update (Krum) or the mean of the ``k - f`` best."""
        scores = krum_scores(stack, self.byzantine, center)
        if not self.multi:
            return np.asarray(stack[int(np.argmin(scores))])
        best = np.argsort(scores, kind="stable")[: stack.shape[0] - self.byzantine]
        return np.asarray(stack[best].mean(axis=0))


@dataclass(frozen=True)
class CenteredClipAggregator(BufferedAggregator):
    """Centered clipping around the global model (buffers the round's updates).

    Like the other buffered rules it ignores the example weights. It departs from
    Karimireddy et al. (2021) in one point: the centre starts at the global model
    each round (ByzFL's default, no server momentum), because the clients' local
    training already averages over many steps.
    """

    tau: float = 0.0
    iterations: int = 3
    name: str = "centered-clip"

    def combine(self, stack: np.ndarray, center: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """Return centered clipping's centre (radius ``tau``, or :func:`median_radius`)."""
        radius = self.tau if self.tau > 0 else median_radius(raw, center)
        if radius == 0.0:  # the median update did not move: neither does the model
            return center
        return centered_clipping(stack, center, radius, self.iterations)


@dataclass(frozen=True)
class NormClipAggregator:
    """Example-weighted mean of updates clipped to ``max_norm`` (streams)."""

    max_norm: float = 10.0
    name: str = "norm-clip"

    def accumulator(
        self,
        reference: Mapping[str, np.ndarray],
        *,
        previous: AccumulatorReport | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
    ) -> Accumulator:
        """Return a clipping accumulator."""
        return NormClipAccumulator(reference, self.max_norm)


def mixing_of(settings: AggregatorSettings) -> Mixing:
    """Return the pre-aggregation the settings ask for."""
    return Mixing(
        kind=settings.pre_aggregation,
        byzantine=settings.krum_byzantine,
        bucket_size=settings.bucket_size,
        seed=settings.seed,
    )


register_aggregator("median", lambda s: MedianAggregator(mixing=mixing_of(s)), mixes=True)
register_aggregator(
    "trimmed-mean",
    lambda s: TrimmedMeanAggregator(s.trim_fraction, mixing=mixing_of(s)),
    mixes=True,
)
register_aggregator(
    "krum", lambda s: KrumAggregator(s.krum_byzantine, mixing=mixing_of(s)), mixes=True
)
register_aggregator(
    "multi-krum",
    lambda s: KrumAggregator(s.krum_byzantine, multi=True, name="multi-krum", mixing=mixing_of(s)),
    mixes=True,
)
register_aggregator(
    "centered-clip",
    lambda s: CenteredClipAggregator(s.cc_tau, s.cc_iterations, mixing=mixing_of(s)),
    mixes=True,
)
register_aggregator("norm-clip", lambda s: NormClipAggregator(s.clip_norm))
