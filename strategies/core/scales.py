"""The bounded ``mean``'s scales: how far an update may move the model, round to round.

The bound of a kind of entry (:func:`~strategies.core.aggregators.entry_kind`) is
``clip-factor`` times its *scale*, the lower median of the distances the last
committed round accepted (what each sent, at most ``bound-growth`` x its bound:
:func:`scale_evidence`), moved by at most ``bound-growth`` a round
(:func:`next_scale`), and at most ``clip-ceiling`` times the global model's own norm.
Sub-model slices of one width are measured against each other (:func:`scale_key`),
and every update also counts in whole-model units towards the pooled scale
(``kind@all``). With ``bound-stretch`` (off by default) a node's bound grows with
its share of the round's examples (:func:`~strategies.core.validation.bound_stretch`):
its distance counts towards the scale divided by its stretch, so a scale is a
typical node's distance. The scales are the accumulator's checkpoint state: one round's
:meth:`ScaleBook.medians` are the next round's ``previous``.

:class:`ScaleBook` keeps that bookkeeping for one round of
:class:`strategies.core.mean.MeanAccumulator`: the bounds it streams with, what each
update had accepted, the bounds of a first round's buffered updates, and the scales it
reports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from strategies.core.aggregators import Clip, entry_kind, lower_median
from strategies.core.measure import is_floating, reference_norms
from strategies.core.sums import Checked

CEILING_SCALE = {"statistics": 25.0}
"""Extra multiple of ``clip-ceiling`` for batch-norm statistics: a running variance
of 1 can reach 50 in one honest round on unnormalised inputs (measured first-round
moves on digits: learned parameters 0.14-0.32 of their norm, statistics 0.8)."""


def next_scale(accepted: Sequence[float], previous: float | None, growth: float) -> float:
    """Return the next round's clip scale from the distances a round accepted.

    The lower median of ``accepted`` (what each accepted update sent, at most
    ``growth`` x its bound: :func:`scale_evidence`), kept within ``[previous /
    growth, previous * growth]`` when there is a previous scale: a majority of
    hostile nodes can move the bound by at most ``growth`` per round (and never past
    ``clip-ceiling``), and a minority only picks which honest distance is the
    median.

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


def scale_evidence(sent: float, bound: float, growth: float) -> float:
    """Return what a distance tells the next scale: ``sent``, at most ``growth`` x ``bound``.

    The update itself is folded clipped to ``bound``; its evidence for the scale is
    what it sent, so that a class whose honest updates all outgrow the bound moves
    its scale up (by at most ``growth`` a round, :func:`next_scale`). Counting a
    clipped update *at* the bound instead made the scale a ratchet at
    ``clip-factor=1``: every accepted distance is then at most the scale, so their
    median can only fall or hold, and a slice class whose scale once fell (a small
    update in a class of two) never followed its clients again. The cap keeps the
    evidence finite and no larger than the clamp lets it act.

    >>> scale_evidence(3.0, 1.0, 2.0), scale_evidence(1.5, 1.0, 2.0), scale_evidence(0.5, 1.0, 2.0)
    (2.0, 1.5, 0.5)
    """
    return min(sent, growth * bound) if bound > 0 else sent


def cohort_cap(clip_factor: float, relative: float, norm: float) -> float | None:
    """Return the bound the cohort's relative scale sets on a model of ``norm``, or ``None``.

    ``clip_factor x relative x norm``: the cohort's lower median distance relative
    to a model's norm (:func:`cohort_scale`), applied to this model. ``None`` when
    any factor is not finite and positive (no bound from the cohort).

    >>> cohort_cap(1.0, 0.25, 20.0), cohort_cap(3.0, 0.25, 20.0)
    (5.0, 15.0)
    >>> cohort_cap(1.0, float("nan"), 20.0) is None, cohort_cap(1.0, 0.05, 0.0) is None
    (True, True)
    """
    values = (float(clip_factor), float(relative), float(norm))
    if not all(math.isfinite(v) and v > 0 for v in values):
        return None
    return values[0] * values[1] * values[2]


def cohort_scale(relative: Sequence[float], previous: float | None, growth: float) -> float | None:
    """Return the cohort's next relative scale from its updates' relative distances.

    The lower median of ``relative`` (each accepted update's distance over its own
    model's norm, :meth:`ScaleBook.relative`, pooled over every architecture group
    of the round), moved by at most ``growth`` from ``previous``
    (:func:`next_scale`): in a group of two or three a hostile node picks which
    distance is its group's median, but of the whole cohort's it can only pick which
    honest one is, and a majority moves it by at most ``growth`` a round. ``None``
    when no distance is finite and positive.

    >>> cohort_scale([0.02, 0.5, 0.03, 0.04, 0.01], None, 2.0)
    0.03
    >>> cohort_scale([0.02, 0.5, 0.03, 0.04, 0.01], 0.01, 2.0)
    0.02
    >>> cohort_scale([], 0.01, 2.0) is None
    True
    """
    usable = [float(r) for r in relative if math.isfinite(r) and r > 0]
    if not usable:
        return None
    if previous is not None and not (math.isfinite(previous) and previous > 0):
        previous = None
    return next_scale(usable, previous, growth)


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


def covered_sizes(checked: Checked) -> dict[str, int]:
    """Per kind, how many of the reference's floating elements the update covers."""
    covered: dict[str, int] = {}
    for key, (value, _) in checked.items():
        if is_floating(value):
            kind = entry_kind(key)
            covered[kind] = covered.get(kind, 0) + int(value.size)
    return covered


class ScaleBook:
    """One round's bounds and accepted distances, per kind of entry and slice class.

    Parameters
    ----------
    reference : Mapping[str, np.ndarray]
        The current global weights (their floating sizes per kind, their norms for
        the ceiling).
    clip_factor : float
        Multiple of the scale an update may move the model (``0``: no bound).
    previous : Mapping[str, float] | None
        The scale per key from the last committed round (ignored unless every one
        is finite and positive).
    max_distance : float | None
        An absolute bound instead (``norm-clip``).
    growth : float
        Largest factor the scale may move between two rounds (``> 1``).
    ceiling : float
        Multiple of the reference's own L2 norm (per kind) no update may exceed
        (``0``: no ceiling).
    cohort : Mapping[str, float] | None
        Per kind, the whole cohort's scale relative to a model's norm
        (:meth:`strategies.core.groups.GroupModels.pooled_scale`): every bound of the
        kind is at most ``clip_factor`` times it times the reference's norm of the
        kind (:func:`cohort_cap`), like the ceiling; ``None`` or empty: no such bound.
    """

    def __init__(
        self,
        reference: Mapping[str, np.ndarray],
        *,
        clip_factor: float,
        previous: Mapping[str, float] | None,
        max_distance: float | None,
        growth: float,
        ceiling: float,
        cohort: Mapping[str, float] | None = None,
    ) -> None:
        self.clip_factor = float(clip_factor)
        self.max_distance = max_distance
        self.growth = float(growth)
        self.previous: dict[str, float] = {}
        if previous and all(math.isfinite(d) and d > 0 for d in previous.values()):
            self.previous = {kind: float(d) for kind, d in previous.items()}
        self.norms: dict[str, float] = reference_norms(reference) if self.clip_factor > 0 else {}
        """Per kind, the L2 norm of the reference's floating entries (when bounded)."""
        self.ceilings: dict[str, float] = {}
        if self.clip_factor > 0 and ceiling > 0:
            for kind, norm in self.norms.items():
                if norm > 0:
                    self.ceilings[kind] = float(ceiling) * norm * CEILING_SCALE.get(kind, 1.0)
        for kind, relative in (cohort or {}).items():
            cap = cohort_cap(self.clip_factor, relative, self.norms.get(kind, 0.0))
            if cap is not None:
                self.ceilings[kind] = min(self.ceilings.get(kind, math.inf), cap)
        self.sizes: dict[str, int] = {}
        """Per kind, the reference's floating elements (a whole-model update covers all)."""
        for key, value in reference.items():
            if is_floating(value):
                kind = entry_kind(key)
                self.sizes[kind] = self.sizes.get(kind, 0) + int(value.size)
        self.accepted: dict[str, list[float]] = {}
        """Per scale key (:func:`scale_key`), the distances this round accepted."""
        self.whole: dict[str, list[float]] = {}
        """Per kind, every accepted distance in whole-model units (:meth:`bound`)."""
        self.sliced: set[str] = set()
        """Kinds of which a slice (an update covering part of the model) was accepted."""
        self.adopted = False
        """Whether this round, a model's first, adopted the scale of its first updates
        (:meth:`adopt`): the rest stream against it, but the next scale is not anchored
        to it (:meth:`medians`)."""

    @property
    def bounded(self) -> bool:
        """Whether updates are bounded at all (a clip factor or an absolute bound)."""
        return self.max_distance is not None or self.clip_factor > 0

    def capped(self, kind: str, bound: float) -> float:
        """Return ``bound`` lowered to the ceiling of ``kind`` (if it has one)."""
        ceiling = self.ceilings.get(kind)
        return bound if ceiling is None else min(bound, ceiling)

    def bound(self, kind: str, covered: int, stretch: float = 1.0) -> float | None:
        """Return the streaming bound of an update's ``kind`` (``None``: unknown, buffer it).

        The scale of the update's own slice class (:func:`scale_key`) when the last
        round had one; else the pooled whole-model scale (``kind@all``, or the
        whole-model class's) converted to the slice's size, ``sqrt(covered / size)``;
        times the update's ``stretch``
        (:func:`~strategies.core.validation.bound_stretch`), then capped at the
        ceiling (which no stretch moves).
        """
        if self.max_distance is not None:
            return self.max_distance
        if self.clip_factor <= 0 or not self.previous:
            return None
        size = self.sizes.get(kind, 0)
        key = scale_key(kind, covered, size)
        if key in self.previous:
            return self.capped(kind, self.clip_factor * self.previous[key] * stretch)
        pooled = self.previous.get(f"{kind}@{POOLED}", self.previous.get(kind))
        if pooled is None or size <= 0:
            return None
        return self.capped(kind, self.clip_factor * pooled * math.sqrt(covered / size) * stretch)

    def previous_scale(self, kind: str, key: str) -> float | None:
        """Return the last round's scale of ``key``, else the pooled one converted to it."""
        if key in self.previous:
            return self.previous[key]
        _, covered = parse_scale_key(key)
        pooled = self.previous.get(f"{kind}@{POOLED}", self.previous.get(kind))
        size = self.sizes.get(kind, 0)
        if pooled is None or covered is None or size <= 0:
            return pooled
        return pooled * math.sqrt(covered / size)

    def accept(
        self,
        position: int,
        distances: Mapping[str, float],
        bounds: Mapping[str, float],
        covered: Mapping[str, int],
        stretch: float = 1.0,
    ) -> tuple[dict[str, float], list[Clip]]:
        """Record what is accepted of each kind (per slice class).

        ``distances`` and ``bounds`` are the update's own (its bound already
        stretched); what it tells the scale is its evidence (:func:`scale_evidence`)
        divided by its ``stretch``: a typical node's distance.

        Returns
        -------
        tuple of dict and list
            The clip factor of each kind clipped, and a :class:`Clip` for each.
        """
        factors: dict[str, float] = {}
        clips: list[Clip] = []
        for kind, sent in distances.items():
            bound = bounds.get(kind, 0.0)
            distance = sent
            if bound > 0 and sent > bound:
                factors[kind] = bound / sent
                clips.append(Clip(position, kind, sent, bound))
                if self.adopted:  # bounded by the first replies' scale: what it sent
                    distance = min(sent, self.ceilings.get(kind, math.inf))
                else:  # a first round's bounds are its own medians: nothing to grow from
                    distance = scale_evidence(sent, bound, self.growth if self.previous else 1.0)
            distance /= stretch
            if distance > 0:
                size, n = self.sizes.get(kind, 0), covered.get(kind, 0)
                self.accepted.setdefault(scale_key(kind, n, size), []).append(distance)
                if n > 0:  # every update, in whole-model units: the pooled scale
                    self.whole.setdefault(kind, []).append(distance * math.sqrt(size / n))
                if 0 < n < size:
                    self.sliced.add(kind)
        return factors, clips

    def round_bounds(
        self, updates: Sequence[tuple[Mapping[str, float], Mapping[str, int], float]]
    ) -> list[dict[str, float]]:
        """Return the bounds of a round's buffered updates from this round's own scales.

        Per kind, an update of a slice class (:func:`scale_key`) that at least two
        buffered updates share is bounded by that class's lower median distance; an
        update alone in its class by the lower median of the *other* updates' distances
        in whole-model units, converted to its size (so its bound never comes from
        itself); an update alone in the round by its own distance (and the ceiling).
        The medians are of distances divided by each update's stretch
        (:func:`~strategies.core.validation.bound_stretch`), and each bound is its
        scale times the update's own stretch.

        Parameters
        ----------
        updates : Sequence[tuple[Mapping[str, float], Mapping[str, int], float]]
            Each update's distances, covered sizes per kind and stretch, in arrival
            order.

        Returns
        -------
        list[dict[str, float]]
            Each update's bound per kind (none for a kind that did not move).
        """
        members: dict[str, list[float]] = {}
        whole: dict[str, list[tuple[int, float]]] = {}
        for i, (distances, covered, stretch) in enumerate(updates):
            for kind, sent in distances.items():
                size, n = self.sizes.get(kind, 0), covered.get(kind, 0)
                distance = sent / stretch
                if distance > 0 and n > 0:
                    members.setdefault(scale_key(kind, n, size), []).append(distance)
                    whole.setdefault(kind, []).append((i, distance * math.sqrt(size / n)))
        out: list[dict[str, float]] = []
        class_scale: dict[str, float] = {}  # each class's median, sorted once (not per update)
        for i, (distances, covered, stretch) in enumerate(updates):
            bounds: dict[str, float] = {}
            for kind in distances:
                size, n = self.sizes.get(kind, 0), covered.get(kind, 0)
                key = scale_key(kind, n, size)
                own = members.get(key, [])
                if len(own) >= 2:
                    if key not in class_scale:
                        class_scale[key] = lower_median(own)
                    bounds[kind] = self.capped(kind, self.clip_factor * class_scale[key] * stretch)
                    continue
                # alone in its class (rare): the others' scale, gathered for it alone
                others = [x for j, x in whole.get(kind, []) if j != i]
                if others and n > 0:
                    scale = lower_median(others) * math.sqrt(n / size)
                elif own:
                    scale = own[0]
                else:
                    continue  # nothing moved: no bound needed
                bounds[kind] = self.capped(kind, self.clip_factor * scale * stretch)
            out.append(bounds)
        return out

    def relative(self) -> dict[str, tuple[float, ...]]:
        """Per kind, what each accepted update told the scale over the reference's norm.

        The distances of :attr:`whole` (each update's evidence in whole-model units,
        divided by its stretch) divided by :attr:`norms`: the relative distances a
        :class:`~strategies.core.groups.GroupModels` pools over its groups
        (:func:`cohort_scale`). Kinds whose reference norm is 0 are left out.
        """
        out: dict[str, tuple[float, ...]] = {}
        for kind, distances in sorted(self.whole.items()):
            norm = self.norms.get(kind, 0.0)
            if norm > 0 and distances:
                out[kind] = tuple(d / norm for d in distances)
        return out

    def adopt(self) -> None:
        """Stream the rest of a first round against the scales it has accepted so far.

        :meth:`medians` of the updates accepted so far (their lower medians; a
        model's first round has no previous scale) become :attr:`previous`, as if a
        round had ended: later updates get a :meth:`bound` and are folded as they
        arrive. The next round's scale is not anchored to these: it is the lower
        median of every distance the round accepted, a later update's as it sent it
        (at most the ceiling, a scale from no node), as if the whole round had been
        held. The first replies are those a node that does not train sends soonest:
        a minority of them bounds the rest of this one round by its median, but
        cannot move the next round's scale. Nothing changes unless every scale is
        finite and positive (later updates are then held again, as before).
        """
        scales = self.medians()
        if scales and all(math.isfinite(d) and d > 0 for d in scales.values()):
            self.previous = scales
            self.adopted = True

    def medians(self) -> dict[str, float]:
        """Return the next round's scale per key.

        :func:`next_scale` of the distances this round accepted (each at most
        ``growth`` x its bound, :func:`scale_evidence`) and the last round's scale; a
        class nobody moved keeps its scale. A first round that adopted the scale of
        its first updates (:meth:`adopt`) has no last round's scale: its own lower
        median.
        """
        medians: dict[str, float] = {}
        for key, accepted in sorted(self.accepted.items()):
            kind, size = parse_scale_key(key)
            if size is not None and len(accepted) < 2:
                continue  # a slice alone in its class: never its own scale
            if size is None and kind in self.sliced and len(accepted) < 2:
                continue  # a whole model alone among slices: the same
            anchor = None if self.adopted else self.previous_scale(kind, key)
            medians[key] = next_scale(accepted, anchor, self.growth)
        for kind in sorted(self.sliced):
            key = f"{kind}@{POOLED}"
            anchor = None if self.adopted else self.previous_scale(kind, key)
            medians[key] = next_scale(self.whole[kind], anchor, self.growth)
        for key, scale in self.previous.items():  # a class nobody moved keeps its scale
            medians.setdefault(key, scale)
        return medians
