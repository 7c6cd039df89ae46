"""``mean``: the example-weighted mean (FedAvg), bounded by default.

:class:`MeanAccumulator` folds every accepted update into float64 sums as it
arrives (:mod:`strategies.core.sums`). With ``clip-factor > 0`` (the default) each
update's distance from the global model is bounded by a multiple of the scale the
last round accepted, per kind of entry and per slice size (:func:`scale_key`), its
direction is checked against the server's own update, and the bound moves by at
most ``bound-growth`` a round (:func:`next_scale`); ``benchmarks/aggregation.py``
measures what the bound costs against the plain mean and torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from strategies.core import fused
from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import (
    DEFAULT_GROWTH,
    DIRECTION,
    Accumulator,
    AccumulatorReport,
    Clip,
    Index,
    entry_kind,
    lower_median,
    register_aggregator,
)
from strategies.core.measure import (
    flat,
    is_floating,
    is_parameter,
    measure_and_fold,
    reference_norms,
    squared_distance,
)
from strategies.core.sums import Checked, Coverage, EntrySums, add_scaled, check_update

CEILING_SCALE = {"statistics": 25.0}
"""Extra multiple of ``clip-ceiling`` for batch-norm statistics: a running variance
of 1 can reach 50 in one honest round on unnormalised inputs (measured first-round
moves on digits: learned parameters 0.14-0.32 of their norm, statistics 0.8)."""


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


_Buffered = tuple[int, Checked, float, dict[str, float], float | None, dict[str, int]]
"""A buffered update: position, entries, weight, distances, cosine, covered sizes."""


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
            keys = [k for k in self.reference if is_parameter(k, self.reference[k])]
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
            if is_floating(value):
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

    def _measure(self, checked: Checked) -> tuple[dict[str, float], float | None]:
        """Return the distances per kind and the cosine with the direction (if any)."""
        squares: dict[str, float] = {}
        dot = norm2 = 0.0
        for key, (value, where) in checked.items():
            if not is_floating(value):
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
        checked: Checked,
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
            if not is_floating(value):
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
                if not is_floating(value):
                    self._sums.add(key, value, -w, where)
                elif folded[key]:
                    flat_total = flat(self._sums.target(key, where))
                    add_scaled(flat_total[: folded[key]], flat(value)[: folded[key]], -w)
            return
        factors = self._accept(position, distances, bounds, covered)
        for key, (value, where) in checked.items():
            if not is_floating(value):
                self._cover.add(key, w, where)
                continue
            factor = factors.get(entry_kind(key))
            if factor is not None:
                ref = self.reference[key]
                base = ref if where is None else ref[where]
                total = self._sums.target(key, where)
                flat_total, flat_value = flat(total), flat(value)
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
                flat_total, flat_value = flat(self._sums.target(key, where)), flat(value)
                add_scaled(flat_total[folded[key] :], flat_value[folded[key] :], w)
            self._cover.add(key, w, where)

    def _fold(self, checked: Checked, w: float, factors: Mapping[str, float]) -> None:
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

    def _covered(self, checked: Checked) -> dict[str, int]:
        """Per kind, how many of the reference's floating elements the update covers."""
        covered: dict[str, int] = {}
        for key, (value, _) in checked.items():
            if is_floating(value):
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


register_aggregator(
    "mean",
    lambda settings: MeanAggregator(
        settings.clip_factor,
        growth=settings.growth,
        ceiling=settings.ceiling,
        threshold=settings.threshold,
    ),
)
