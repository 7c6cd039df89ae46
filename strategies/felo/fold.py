"""The ``mean`` knowledge merge, folded as the replies arrive.

Felo's, FedHe's and FedProto's default merge (:func:`~strategies.felo.knowledge.merge_knowledge`,
``knowledge-merge=mean``) is a count-weighted sum per class, so it folds reply by reply
into sums of O(classes x width) (:class:`~strategies.felo.knowledge.KnowledgeSums`)
and each reply's rows are dropped, as the weights are: the server's memory for the
round does not grow with the number of nodes (only one float per accepted row is
kept, for the next round's scale).

The row bound (``knowledge-clip-factor``) is what a fold changes. The buffered merge
bounds every row by the lower median norm of the round's own rows, known only once
every row is in. :class:`KnowledgeFold` bounds a row by ``knowledge-clip-factor``
times the **previous** round's scale of its kind (logits, features): the lower
median of the row norms that round accepted (after clipping, so what an attacker
sent beyond the bound never enters it), moved by at most ``bound-growth`` a round
(:func:`~strategies.core.scales.next_scale`), exactly as the bounded weight ``mean``
does. A reply carrying a kind that has no scale yet (the first round, or a resumed
run from a checkpoint without one) is kept until :meth:`KnowledgeFold.result`, which
bounds it by the round's own lower median, as the buffered merge does: in the first
round the fold's result equals the buffered merge's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from strategies.core.aggregators import lower_median
from strategies.core.scales import next_scale
from strategies.felo.knowledge import (
    KINDS,
    ClassKnowledge,
    KnowledgeError,
    KnowledgeSums,
    clip_knowledge,
    row_norms,
)

__all__ = [
    "KNOWLEDGE_SCALES",
    "FoldResult",
    "KnowledgeFold",
    "KnowledgeRound",
    "moving_kinds",
    "scales_from_state",
]


def moving_kinds(part: ClassKnowledge) -> list[str]:
    """Return the kinds of rows ``part`` carries with a positive norm (what a bound acts on).

    Examples
    --------
    >>> k = ClassKnowledge(np.array([0]), np.array([3]), np.zeros((1, 2)), np.ones((1, 4)))
    >>> moving_kinds(k)  # all-zero logits (a prototype) need no bound
    ['features']
    """
    kinds: list[str] = []
    for kind in KINDS:
        values = getattr(part, kind)
        if values is not None and values.size and bool(np.any(values != 0)):
            kinds.append(kind)
    return kinds


@dataclass(frozen=True)
class FoldResult:
    """What :meth:`KnowledgeFold.result` returns.

    Attributes
    ----------
    merged : ClassKnowledge
        The count-weighted per-class means of the bounded rows, counts summed.
    clips : list[tuple[int, str, float, float]]
        ``(tag, kind, largest row norm, bound)`` per reply and kind clipped, the tag
        being what :meth:`KnowledgeFold.add` was given (the node id).
    scales : dict[str, float]
        The next round's scale per kind (empty when unbounded).
    buffered : int
        How many replies were kept until the end (no scale for a kind they carried).
    """

    merged: ClassKnowledge
    clips: list[tuple[int, str, float, float]]
    scales: dict[str, float]
    buffered: int


class KnowledgeFold:
    """Bound and fold per-class knowledge reply by reply (module docstring).

    Parameters
    ----------
    num_classes : int
        Number of classes of the task (the logit width).
    clip_factor : float
        Row bound as a multiple of the scale (``knowledge-clip-factor``; 0: none).
    previous : Mapping[str, float] | None
        The last committed round's scale per kind (``logits``, ``features``); an
        entry that is not a finite positive number is ignored (that kind is bounded
        by the round's own median).
    growth : float
        Largest factor a scale may move between two rounds (``bound-growth``, > 1).

    Examples
    --------
    >>> fold = KnowledgeFold(2, clip_factor=1.0, previous={"logits": 1.0}, growth=2.0)
    >>> fold.add(ClassKnowledge(np.array([0]), np.array([1]), np.array([[3.0, 4.0]])), tag=7)
    >>> out = fold.result()  # (3, 4) has norm 5, clipped to the scale 1
    >>> out.merged.logits.tolist(), out.clips, out.scales
    ([[0.6000000238418579, 0.800000011920929]], [(7, 'logits', 5.0, 1.0)], {'logits': 1.0})
    """

    def __init__(
        self,
        num_classes: int,
        *,
        clip_factor: float,
        previous: Mapping[str, float] | None = None,
        growth: float = 2.0,
    ) -> None:
        if not (clip_factor == 0 or clip_factor >= 1):
            raise ValueError(f"clip_factor must be 0 (off) or at least 1, got {clip_factor!r}")
        if not growth > 1:
            raise ValueError(f"growth {growth!r} must be above 1")
        self.num_classes = int(num_classes)
        self.clip_factor = float(clip_factor)
        self.growth = float(growth)
        self.previous: dict[str, float] = {
            kind: float(value)
            for kind, value in (previous or {}).items()
            if kind in KINDS and math.isfinite(float(value)) and float(value) > 0
        }
        self.sums: KnowledgeSums | None = None
        self.feature_dim: int | None = None
        self.accepted: dict[str, list[float]] = {}
        """Per kind, the positive norm of every row folded (after clipping)."""
        self.clips: list[tuple[int, str, float, float]] = []
        self._buffer: list[tuple[int, ClassKnowledge]] = []
        self.buffered = 0
        """How many replies were kept until :meth:`result` (no scale for a kind they move)."""
        self.added = 0

    def check(self, part: ClassKnowledge) -> None:
        """Refuse ``part`` if its widths differ from the replies already added.

        Raises
        ------
        KnowledgeError
            If the logit width is not ``num_classes``, or the features are present
            (or absent, or of another width) unlike the first reply's.
        """
        if part.logits.shape[1] != self.num_classes:
            raise KnowledgeError(
                f"logits of width {part.logits.shape[1]}; expected {self.num_classes}"
            )
        width = None if part.features is None else int(part.features.shape[1])
        if self.added and width != self.feature_dim:
            raise KnowledgeError(
                f"features of width {width}; the round's first reply had {self.feature_dim}"
            )

    def streams(self, part: ClassKnowledge) -> bool:
        """Whether ``part`` can be bounded now (every kind it moves has a scale)."""
        return self.clip_factor <= 0 or all(k in self.previous for k in moving_kinds(part))

    def add(self, part: ClassKnowledge, tag: int) -> None:
        """Check, bound and fold ``part`` (or keep it until :meth:`result`, see :meth:`streams`).

        Raises
        ------
        KnowledgeError
            From :meth:`check`; nothing of ``part`` is kept then.
        """
        self.check(part)
        if self.sums is None:
            self.feature_dim = None if part.features is None else int(part.features.shape[1])
            self.sums = KnowledgeSums(self.num_classes, self.feature_dim)
        self.added += 1
        if self.streams(part):
            self._fold(part, tag, self._previous_bounds())
        else:
            self._buffer.append((tag, part))
            self.buffered += 1

    def _fold(self, part: ClassKnowledge, tag: int, bounds: Mapping[str, float]) -> None:
        (clipped,), clips = clip_knowledge([part], bounds)
        self.clips.extend((tag, kind, norm, bound) for _, kind, norm, bound in clips)
        if self.clip_factor > 0:
            for kind in KINDS:
                values = getattr(clipped, kind)
                if values is not None:
                    norms = row_norms(values)
                    self.accepted.setdefault(kind, []).extend(norms[norms > 0].tolist())
        assert self.sums is not None
        self.sums.add(clipped)

    def _previous_bounds(self) -> dict[str, float]:
        """Return ``clip-factor`` x the previous scale per kind (none when unbounded)."""
        if self.clip_factor <= 0:
            return {}
        return {kind: self.clip_factor * scale for kind, scale in self.previous.items()}

    def _round_bounds(self) -> dict[str, float]:
        """Return the kept replies' bounds: the previous scale, else this round's median."""
        bounds = self._previous_bounds()
        for kind in KINDS:
            if kind in bounds:
                continue
            norms = list(self.accepted.get(kind, []))
            for _, part in self._buffer:
                values = getattr(part, kind)
                if values is not None:
                    norms.extend(row_norms(values).tolist())
            positive = [n for n in norms if n > 0]
            if positive:
                bounds[kind] = self.clip_factor * lower_median(positive)
        return bounds

    def result(self) -> FoldResult:
        """Bound and fold the kept replies, and return the merge and the next scales.

        Raises
        ------
        KnowledgeError
            If nothing was added.
        """
        if self.sums is None:
            raise KnowledgeError("nothing to merge: no client knowledge was given")
        if self._buffer:
            bounds = self._round_bounds()
            for tag, part in self._buffer:
                self._fold(part, tag, bounds)
            self._buffer.clear()
        scales = dict(self.previous) if self.clip_factor > 0 else {}
        for kind, norms in self.accepted.items():
            if norms:
                scales[kind] = next_scale(norms, self.previous.get(kind), self.growth)
        return FoldResult(self.sums.merged(), list(self.clips), scales, self.buffered)


KNOWLEDGE_SCALES = "knowledge_scales"
"""Checkpoint entry of the knowledge scales (kind -> float)."""


@dataclass
class KnowledgeRound:
    """One round's :class:`KnowledgeFold`, kept in the round context (``ctx.state``)."""

    fold: KnowledgeFold


def scales_from_state(state: Mapping[str, object]) -> dict[str, float]:
    """Check and return a checkpoint's knowledge scales (an older checkpoint has none).

    Each entry must be a kind of row (``logits``, ``features``) mapped to a finite
    number > 0 and at most :data:`~tessera.state_checks.MEDIAN_LIMIT`, so a restored
    bound is never switched off.

    Raises
    ------
    tessera.state_checks.StateFileError
        Naming the field and what it holds.
    """
    from tessera.state_checks import MEDIAN_LIMIT, StateFileError, get_mapping, positive_float

    tree = get_mapping(state, KNOWLEDGE_SCALES, default={})
    scales: dict[str, float] = {}
    for kind, value in tree.items():
        where = f"{KNOWLEDGE_SCALES}.{kind}"
        if kind not in KINDS:
            raise StateFileError(where, f"is not a kind of row; expected one of {KINDS}")
        scales[str(kind)] = positive_float(value, where=where, maximum=MEDIAN_LIMIT)
    return scales
