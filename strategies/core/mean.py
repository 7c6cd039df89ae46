"""``mean``: the example-weighted mean (FedAvg), bounded by default.

:class:`MeanAccumulator` folds every accepted update into float64 sums as it
arrives (:mod:`strategies.core.sums`). With ``clip-factor > 0`` (the default) each
update's distance from the global model is bounded by a multiple of the scale the
last round accepted, per kind of entry and per slice size (the scales:
:mod:`strategies.core.scales`), its direction is checked against the server's own
update (:mod:`strategies.core.direction`), and the bound moves by at most
``bound-growth`` a round (:func:`~strategies.core.scales.next_scale`);
``benchmarks/aggregation.py`` measures what the bound costs against the plain mean
and torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from strategies.core import fused
from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import (
    DEFAULT_GROWTH,
    DIRECTION,
    UNMOVED,
    Accumulator,
    AccumulatorReport,
    Clip,
    Index,
    entry_kind,
    register_aggregator,
)
from strategies.core.direction import DirectionCheck
from strategies.core.measure import flat, is_floating, measure_and_fold, squared_distance
from strategies.core.scales import ScaleBook, covered_sizes, parse_scale_key
from strategies.core.sums import (
    Checked,
    Coverage,
    EntrySums,
    add_clipped,
    add_scaled,
    check_update,
)

# parse_scale_key is imported from here by strategies.core.groups
__all__ = ["MeanAccumulator", "MeanAggregator", "parse_scale_key"]


FIRST_ROUND_BUFFER = 32
"""The most updates a bounded ``mean`` holds while a model has no scale yet (its first
round). The first this many are clipped against their own lower median (and the
ceiling) and folded, that median becomes the round's scale, and every later update of
the round streams against it as in any other round: the server's memory in a first
round is this many models, not one per node. A federation of this many nodes or fewer
is bounded exactly as if every update were held."""

_Buffered = tuple[int, Checked, float, dict[str, float], float | None, dict[str, int], float]
"""A buffered update: position, entries, weight, distances, cosine, covered sizes, stretch."""


@dataclass(frozen=True)
class _Streamed:
    """An update streamed against known bounds (see :meth:`MeanAccumulator.add`)."""

    position: int
    checked: Checked
    w: float
    bounds: dict[str, float]
    covered: dict[str, int]
    own: Mapping[str, np.ndarray] | None
    stretch: float = 1.0


@dataclass
class _Measured:
    """What one pass measured of an update: per kind, and per entry what it folded."""

    squares: dict[str, float] = field(default_factory=dict)
    dot: float = 0.0
    norm2: float = 0.0
    folded: dict[str, int] = field(default_factory=dict)
    """Per entry, the elements folded at the update's weight (a prefix)."""
    over: set[str] = field(default_factory=set)
    """Kinds whose running distance passed their bound."""

    def record(
        self, key: str, kind: str, size: int, done: int, square: float, dot: float, norm2: float
    ) -> None:
        """Record one entry's pass: its running square, dot, direction norm and folded prefix."""
        self.squares[kind] = square
        self.dot += dot
        self.norm2 += norm2
        self.folded[key] = done
        if done < size:
            self.over.add(kind)


def _add_from(total: np.ndarray, value: np.ndarray, start: int, weight: float) -> None:
    """Add ``weight * value`` to ``total`` from flat (C-order) element ``start`` on, in place.

    ``total`` may be a strided view (a sub-model slice of a sum): its flat
    ``reshape`` would be a copy, and an add into it lost. Only a contiguous total can
    have been folded in part (``start > 0``: the measuring pass folds into flat
    views only), so a strided one is added to whole, through :func:`add_scaled`,
    which writes into views.

    Raises
    ------
    AggregationError
        If ``start`` is past 0 on a total that cannot be viewed flat.
    """
    if start >= value.size:
        return
    if start == 0:
        add_scaled(total, value, weight)
        return
    if not total.flags.c_contiguous:
        raise AggregationError(
            f"an update folded {start} elements into a strided sum: it cannot be completed"
        )
    add_scaled(flat(total)[start:], flat(value)[start:], weight)


def _same_entries(a: Checked, b: Checked) -> bool:
    """Return whether two checked updates hold the same entries, in order, of one dtype each."""
    return list(a) == list(b) and all(a[k][0].dtype == b[k][0].dtype for k in a)


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
      model's last committed round *accepted* (each as sent, at most ``growth``
      times its bound: :func:`~strategies.core.scales.scale_evidence`), moved by at
      most a factor ``growth`` per round (:func:`~strategies.core.scales.next_scale`):
      a minority of nodes can only pick which honest distance is the median, and a
      majority can move the bound by at most ``growth`` per round;
    - ``ceiling`` times the L2 norm of the reference's entries of that kind (a
      scale that does not come from any node: it bounds a node alone in its
      architecture group, and a model's first round);
    - with a ``cohort`` scale (group-averaging schemes, run-config
      ``cohort-bound``), ``clip_factor`` times it times the reference's norm of the
      kind: the whole cohort's lower median distance relative to a model's norm,
      so that a node in a group of two or three cannot pick its group's bound.

    A bounded mean also drops an update whose learned parameters are exactly the
    reference's (distance 0: a free-rider, or a node whose training did not run),
    recorded as a :class:`Clip` of kind :data:`~strategies.core.aggregators.UNMOVED`:
    it carries no step, and its weight would only shrink every other update's (in
    a group of two, its partner's by half). The plain mean (``clip_factor=0``)
    counts it as any other.

    With run-config ``bound-stretch`` (off by default), each update's bound from
    the scale is stretched by its share of the round's examples (``stretch`` in
    :meth:`add`, :func:`~strategies.core.validation.bound_stretch`): a node that
    trained on twice a typical node's examples may move the model twice as far, and
    its distance counts towards the next scale halved. The ceiling is not stretched.

    When the model has no scale yet (its first round) the round's updates are kept
    until :meth:`result`, which clips them against ``clip_factor`` times this
    round's own lower median (and the ceiling), or until :data:`FIRST_ROUND_BUFFER`
    are kept, which are folded so and whose median becomes the scale the rest of
    the round streams against (the memory stays that many models, whatever the
    number of nodes; the next round's scale is still the lower median of what the
    whole round sent, :meth:`~strategies.core.scales.ScaleBook.adopt`, so a minority
    that replies first cannot set it); otherwise each update is measured
    and folded as it arrives (:meth:`_stream`): one pass that computes the
    distance block by block and folds each block while the running distance is
    within the bound, and a correction for the blocks already folded when it is
    not (``benchmarks/aggregation.py`` measures the cost against torch's in-place
    sum). Two updates of the same whole entries are measured and folded together
    (:meth:`_stream_or_hold`), each against its own bound and direction verdict,
    so an update may wait in the accumulator for the next one.

    A clipped update ``reference + f * (update - reference)`` is computed block by
    block, rounded to the update's dtype and folded as one term ``w * clipped``
    (:func:`~strategies.core.sums.clipped`): the mean does not depend on the order
    the updates arrive in.

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
        :data:`DIRECTION`); it neither moves the model nor enters the next round's
        scale. In the first round (no scale yet) its size still counts among the
        round's own sizes that set this round's bounds: when the check drops
        every honest update of a small group, the one left (an attacker whose
        random direction passed) is bounded by the group's sizes, not alone by
        its own (NeFL's per-slice normalisation, 2 of 3 dropped: a dense +-1e30
        update was bounded by the ceiling and took the slice to chance).
    cohort : Mapping[str, float] | None
        Per kind, the whole cohort's scale relative to a model's norm, from a
        :class:`~strategies.core.groups.GroupModels` of several architecture groups
        (run-config ``cohort-bound``): every bound of the kind is also at most
        ``clip_factor`` times it times the reference's norm of that kind
        (:class:`~strategies.core.scales.ScaleBook`). ``None``: no such bound.
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
        cohort: Mapping[str, float] | None = None,
    ) -> None:
        self.reference = dict(reference)
        self.scales = ScaleBook(
            self.reference,
            clip_factor=clip_factor,
            previous=previous,
            max_distance=max_distance,
            growth=growth,
            ceiling=ceiling,
            cohort=cohort,
        )
        """The bounds and what this round accepted (:mod:`strategies.core.scales`)."""
        self.check = DirectionCheck(self.reference, direction, threshold)
        """The direction check (:mod:`strategies.core.direction`)."""
        self._sums = EntrySums(self.reference)
        self._cover = Coverage(self.reference)
        self._count = 0
        self._buffer: list[_Buffered] = []
        self._clips: list[Clip] = []
        self._result: dict[str, np.ndarray] | None = None
        self._held: _Streamed | None = None
        self._plain_held: tuple[Checked, float] | None = None
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

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
        direction: Mapping[str, np.ndarray] | None = None,
        stretch: float = 1.0,
    ) -> None:
        """Add ``weight * update`` (clipped, when bounded) to the sums, ``weight`` to the coverage.

        With ``direction`` (the server's own update of the slice this update was
        trained as, entries shaped like the update's) and a direction check on,
        the update is compared with it instead of the slice of the accumulator's
        direction: a narrow sub-model learns differently from the same part of the
        whole model.

        ``stretch`` (:func:`~strategies.core.validation.bound_stretch`, positive): the
        multiple of the scale's bound this update may move the model by, and what
        its distance is divided by before it counts towards the next scale.

        The update's arrays are read, not copied, and an update may be folded at the
        next call or at :meth:`result` (in a pair: :meth:`_stream_or_hold`,
        :meth:`_fold_or_hold`): the caller must not change them after the call.

        Raises
        ------
        AggregationError
            If the weight or the stretch is not finite and positive, an entry is
            unknown or of the wrong dtype or shape (nothing is added then), or
            :meth:`result` was already taken.
        """
        if self._result is not None:
            raise AggregationError("this round's result was already taken; start a new one")
        w = float(weight)
        if not np.isfinite(w) or w <= 0:
            raise AggregationError(f"weight {weight!r} must be finite and positive")
        s = float(stretch)
        if not np.isfinite(s) or s <= 0:
            raise AggregationError(f"stretch {stretch!r} must be finite and positive")
        checked = check_update(self.reference, update, index)
        own = self.check.own(checked, direction)
        position = self._count
        self._count += 1
        if not self.scales.bounded:
            self._fold_or_hold(checked, w)
            return
        covered = covered_sizes(checked)
        bounds = {kind: self.scales.bound(kind, n, s) for kind, n in covered.items()}
        if any(b is None for b in bounds.values()):
            distances, cosine = self._measure(checked, own)
            self._buffer.append((position, checked, w, distances, cosine, covered, s))
            if len(self._buffer) >= FIRST_ROUND_BUFFER:
                self._flush()  # a scale from the first ones; the rest stream against it
                self.scales.adopt()
            return
        self._stream_or_hold(
            _Streamed(
                position,
                checked,
                w,
                {k: float(b) for k, b in bounds.items() if b is not None},
                covered,
                own,
                s,
            )
        )

    def _measure(
        self, checked: Checked, own: Mapping[str, np.ndarray] | None
    ) -> tuple[dict[str, float], float | None]:
        """Return the distances per kind and the cosine with the direction (if any)."""
        squares: dict[str, float] = {}
        dot = norm2 = 0.0
        for key, (value, where) in checked.items():
            if not is_floating(value):
                continue
            ref = self.reference[key]
            base = ref if where is None else ref[where]
            along = self.check.along(key, where, own)
            kind = entry_kind(key)
            _, squares[kind], part = measure_and_fold(
                value, base, None, 0.0, squares.get(kind, 0.0), None, self._scratch, along
            )
            if along is not None:
                dot += part
                norm2 += squared_distance(along, np.zeros_like(along))
        distances = {kind: math.sqrt(square) for kind, square in squares.items()}
        return distances, self.check.cosine(dot, distances, norm2)

    def _refused(self, position: int, cosine: float | None, distances: Mapping[str, float]) -> bool:
        """Return whether the update is dropped whole (and record why).

        An update whose learned parameters did not move at all (distance exactly 0)
        is dropped as :data:`UNMOVED`: it carries no step, only a weight that would
        shrink every other node's step (a free-rider in a group of two halves its
        partner's). Otherwise the direction check decides (:data:`DIRECTION`).
        """
        if distances.get("parameters", -1.0) == 0.0:
            self._clips.append(Clip(position, UNMOVED, 0.0, 0.0))
            return True
        if cosine is None or cosine > self.check.threshold:
            return False
        self._clips.append(Clip(position, DIRECTION, cosine, self.check.threshold))
        return True

    def _accept(
        self,
        position: int,
        distances: Mapping[str, float],
        bounds: Mapping[str, float],
        covered: Mapping[str, int],
        stretch: float = 1.0,
    ) -> dict[str, float]:
        """Record what is accepted of each kind (per slice class) and return the clip factors."""
        factors, clips = self.scales.accept(position, distances, bounds, covered, stretch)
        self._clips.extend(clips)
        return factors

    def _stream_or_hold(self, streamed: _Streamed) -> None:
        """Stream an update, in a pair with the one held when both allow it.

        Two updates of the same whole entries are measured and folded in one pass
        (:meth:`_stream_pair`): what one update at a time reads twice (the sums, the
        global entry, the direction) is then read once. An update waits for a
        partner until the next one arrives or anything reads the round
        (:meth:`result`, :meth:`report`): one more update held, the price of the
        pairs (the plain unbounded mean folds each as it comes and holds none).
        """
        if not self._pairable(streamed):
            self._settle_held()
            self._stream(streamed)
            return
        held, self._held = self._held, None
        if held is None:
            self._held = streamed
        elif _same_entries(held.checked, streamed.checked):
            self._stream_pair(held, streamed)
        else:
            self._stream(held)
            self._held = streamed

    @staticmethod
    def _pairable(streamed: _Streamed) -> bool:
        """Return whether an update may wait for a partner: whole entries, the shared direction."""
        return (
            streamed.own is None
            and fused.available()
            and all(where is None for _, where in streamed.checked.values())
        )

    def _settle_held(self) -> None:
        """Fold the update held for a partner, alone (before anything reads the round)."""
        held, self._held = self._held, None
        if held is not None:
            self._stream(held)
        plain, self._plain_held = self._plain_held, None
        if plain is not None:
            self._fold(*plain, {})

    def _fold_or_hold(self, checked: Checked, w: float) -> None:
        """Fold an unbounded update, in a pair with the one held when both allow it.

        Two updates of the same whole entries go into each float64 sum in one pass
        (:func:`~strategies.core.fused.fold_pair`): the sum, 16 of the 20 bytes a fold
        moves per element, is read and written once for the two. An update waits for
        its partner until the next one arrives or the round is read.
        """
        pairable = fused.available() and all(where is None for _, where in checked.values())
        held, self._plain_held = self._plain_held, None
        if not pairable:
            if held is not None:
                self._fold(*held, {})
            self._fold(checked, w, {})
        elif held is None:
            self._plain_held = (checked, w)
        elif _same_entries(held[0], checked):
            self._fold_pair(held, (checked, w))
        else:
            self._fold(*held, {})
            self._plain_held = (checked, w)

    def _fold_pair(self, first: tuple[Checked, float], second: tuple[Checked, float]) -> None:
        """Fold two unbounded updates of the same whole entries, each entry in one pass."""
        (one, w1), (two, w2) = first, second
        for key, (value, _) in one.items():
            other = two[key][0]
            total = self._sums.target(key, None)
            if not (
                is_floating(value)
                and value.flags.c_contiguous
                and other.flags.c_contiguous
                and fused.fold_pair(flat(value), flat(other), flat(total), (w1, w2))
            ):
                self._sums.add(key, value, w1, None)
                self._sums.add(key, other, w2, None)
            self._cover.add(key, w1, None)
            self._cover.add(key, w2, None)

    def _measure_entry(
        self, streamed: _Streamed, measured: _Measured, key: str, value: np.ndarray
    ) -> None:
        """Measure one floating entry of an update and fold it while in bounds."""
        where = streamed.checked[key][1]
        ref = self.reference[key]
        kind = entry_kind(key)
        bound = streamed.bounds[kind]
        base = ref if where is None else ref[where]
        along = self.check.along(key, where, streamed.own)
        done, square, part = measure_and_fold(
            value,
            base,
            self._sums.target(key, where),
            streamed.w,
            measured.squares.get(kind, 0.0),
            None if kind in measured.over else bound * bound,
            self._scratch,
            along,
        )
        norm2 = 0.0
        if along is not None:
            norm2 = (
                self.check.norms2[key]
                if where is None and streamed.own is None
                else squared_distance(along, np.zeros_like(along))
            )
        measured.record(key, kind, value.size, done, square, part, norm2)

    def _stream(self, streamed: _Streamed) -> None:
        """Measure and fold one update in one pass over it (see the class docstring)."""
        measured = _Measured()
        for key, (value, where) in streamed.checked.items():
            if is_floating(value):
                self._measure_entry(streamed, measured, key, value)
            else:
                self._sums.add(key, value, streamed.w, where)
        self._settle(streamed, measured)

    def _stream_pair(self, first: _Streamed, second: _Streamed) -> None:
        """Measure and fold two updates of the same whole entries in one pass over both.

        The global entry, the direction and the sums are read once for the two
        (:func:`strategies.core.fused.measure_fold_pair`); each update keeps its own
        bound, folded prefix, clip and direction verdict, as if streamed alone.
        """
        measured = (_Measured(), _Measured())
        pair = (first, second)
        for key, (value, _) in first.checked.items():
            other = second.checked[key][0]
            if not is_floating(value):
                for streamed in pair:
                    self._sums.add(key, streamed.checked[key][0], streamed.w, None)
                continue
            kind = entry_kind(key)
            along = self.check.along(key, None, None)
            total = self._sums.target(key, None)
            ref = self.reference[key]
            result = None
            if all(a.flags.c_contiguous for a in (value, other, ref, total)) and (
                along is None or along.flags.c_contiguous
            ):
                result = fused.measure_fold_pair(
                    flat(value),
                    flat(other),
                    flat(ref),
                    flat(total),
                    (first.w, second.w),
                    (measured[0].squares.get(kind, 0.0), measured[1].squares.get(kind, 0.0)),
                    tuple(  # type: ignore[arg-type]
                        None if kind in m.over else s.bounds[kind] ** 2
                        for m, s in zip(measured, pair, strict=True)
                    ),
                    None if along is None else flat(along),
                )
            if result is None:  # a layout the compiled pair does not take: one by one
                self._measure_entry(first, measured[0], key, value)
                self._measure_entry(second, measured[1], key, other)
                continue
            done1, done2, square1, square2, dot1, dot2 = result
            norm2 = 0.0 if along is None else self.check.norms2[key]
            measured[0].record(key, kind, value.size, done1, square1, dot1, norm2)
            measured[1].record(key, kind, value.size, done2, square2, dot2, norm2)
        self._settle(first, measured[0])
        self._settle(second, measured[1])

    def _settle(self, streamed: _Streamed, measured: _Measured) -> None:
        """Drop, clip or keep a measured update: take back, re-weight or finish its folds."""
        position, checked, w = streamed.position, streamed.checked, streamed.w
        folded = measured.folded
        distances = {kind: math.sqrt(s) for kind, s in measured.squares.items()}
        cosine = self.check.cosine(measured.dot, distances, measured.norm2)
        if self._refused(position, cosine, distances):
            for key, (value, where) in checked.items():  # take back what went in
                if not is_floating(value):
                    self._sums.add(key, value, -w, where)
                elif folded[key]:
                    flat_total = flat(self._sums.target(key, where))
                    add_scaled(flat_total[: folded[key]], flat(value)[: folded[key]], -w)
            return
        factors = self._accept(
            position, distances, streamed.bounds, streamed.covered, streamed.stretch
        )
        for key, (value, where) in checked.items():
            if not is_floating(value):
                self._cover.add(key, w, where)
                continue
            factor = factors.get(entry_kind(key))
            if factor is not None:
                ref = self.reference[key]
                base = ref if where is None else ref[where]
                total = self._sums.target(key, where)
                done = folded[key]
                # the first `done` elements went in at w unclipped: take them back out;
                # the clipped update goes in at w as one term (sums.clipped: the sum
                # then does not depend on the arrival order); one pass if compiled (a
                # strided slice of the sum has no flat view to pass it)
                if not (
                    total.flags.c_contiguous
                    and fused.correct(flat(value), base, flat(total), done, w, factor)
                ):
                    if done:
                        add_scaled(flat(total)[:done], flat(value)[:done], -w)
                    add_clipped(total, value, base, factor, w)
            elif folded[key] < value.size:  # not over after all (another entry was)
                _add_from(self._sums.target(key, where), value, folded[key], w)
            self._cover.add(key, w, where)

    def _fold(self, checked: Checked, w: float, factors: Mapping[str, float]) -> None:
        for key, (value, where) in checked.items():
            ref = self.reference[key]
            factor = factors.get(entry_kind(key))
            if factor is None or not np.issubdtype(ref.dtype, np.floating):
                self._sums.add(key, value, w, where)
            else:  # w * (ref + f * (value - ref)), one term (sums.clipped)
                base = ref if where is None else ref[where]
                add_clipped(self._sums.target(key, where), value, base, factor, w)
            self._cover.add(key, w, where)

    def _flush(self) -> None:
        """Clip and fold the buffered updates against this round's own scales.

        The bounds: :meth:`strategies.core.scales.ScaleBook.round_bounds`.
        """
        if not self._buffer:
            return
        # the bounds from every measured update's size, the folds from those the
        # direction check keeps (see the class docstring)
        bounds = self.scales.round_bounds([(item[3], item[5], item[6]) for item in self._buffer])
        refused = [self._refused(item[0], item[4], item[3]) for item in self._buffer]
        for (position, checked, w, distances, _, covered, s), own_bounds, dropped in zip(
            self._buffer, bounds, refused, strict=True
        ):
            if not dropped:
                factors = self._accept(position, distances, own_bounds, covered, s)
                self._fold(checked, w, factors)
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
        self._settle_held()
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

        The scale is :func:`~strategies.core.scales.next_scale` of the distances this
        round accepted (each as sent, at most ``growth`` x its bound) and the last
        round's scale.
        """
        self._settle_held()
        return AccumulatorReport(
            medians=self.scales.medians(),
            clips=tuple(self._clips),
            relative=self.scales.relative(),
        )


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
        """Return a fresh :class:`MeanAccumulator` bounded by the previous round's scale.

        And by the cohort's relative scale when ``previous`` carries one
        (:attr:`AccumulatorReport.cohort`).
        """
        return MeanAccumulator(
            reference,
            clip_factor=self.clip_factor,
            previous=None if previous is None else previous.medians,
            growth=self.growth,
            ceiling=self.ceiling,
            direction=direction,
            threshold=self.threshold,
            cohort=None if previous is None else previous.cohort,
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
