"""The ``mean`` knowledge merge, folded as the replies arrive where that changes nothing.

Felo's, FedHe's and FedProto's default merge
(:func:`~strategies.felo.knowledge.merge_knowledge`, ``knowledge-merge=mean``) is a
count-weighted sum per class of rows each bounded by ``knowledge-clip-factor`` x the
lower median norm of the round's rows of its kind (logits, features)
(:func:`~strategies.felo.knowledge.bound_knowledge`). That median is known only once
every row is in, but a **lower bound** on it is known before: :class:`KnowledgeFold`
keeps the median from falling below the previous round's median / ``bound-growth``
(so a majority can shrink the bound by at most ``bound-growth`` a round, as it can
the weights' bound), and then no row whose norm is at most ``knowledge-clip-factor``
x the previous median / ``bound-growth`` can be clipped. Such a row is folded into
the per-class sums (:class:`~strategies.felo.knowledge.KnowledgeSums`) as its reply
arrives and dropped; only the rows above that threshold are kept to the round's end,
bounded then by the round's own median and folded. The result is the buffered
merge's, up to the order of the float64 additions; the round records how many rows
it kept (``knowledge_kept`` of ``knowledge_rows``).

A bound taken from the previous round alone (as the weights' is) was tried and
measured, and did not hold (``docs/pages/performance.md``): per-class rows move fast
and unevenly between rounds, unlike weight updates.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from strategies.core.aggregators import lower_median
from strategies.core.context import RoundContext, ServerEnv
from strategies.felo.knowledge import (
    KINDS,
    ClassKnowledge,
    KnowledgeError,
    KnowledgeSums,
    cap_to_declared,
    clip_knowledge,
    node_median,
    row_norms,
)

__all__ = [
    "KNOWLEDGE_SCALES",
    "FoldResult",
    "KnowledgeFold",
    "KnowledgeRound",
    "round_fold",
    "scales_from_state",
    "within_declared",
]

log = logging.getLogger("flwr.tessera")


@dataclass(frozen=True)
class FoldResult:
    """What :meth:`KnowledgeFold.result` returns.

    Attributes
    ----------
    merged : ClassKnowledge
        The count-weighted per-class means of the bounded rows, counts summed.
    clips : list[tuple[int, str, float, float]]
        ``(tag, kind, largest row norm, bound)`` per reply and kind clipped, the tag
        being what :meth:`KnowledgeFold.add` was given (the node id), in the order
        the replies were added.
    scales : dict[str, float]
        Per kind, the round's median (after the floor): the next round's ``previous``.
    kept : int
        Rows kept to the round's end (above the threshold).
    rows : int
        Rows added in all.
    """

    merged: ClassKnowledge
    clips: list[tuple[int, str, float, float]]
    scales: dict[str, float]
    kept: int
    rows: int


class KnowledgeFold:
    """Fold per-class knowledge reply by reply, bounded as the buffered merge bounds it.

    Parameters
    ----------
    num_classes : int
        Number of classes of the task (the logit width).
    clip_factor : float
        Row bound as a multiple of the round's median row norm
        (``knowledge-clip-factor``; 0: none).
    previous : Mapping[str, float] | None
        The last committed round's median per kind (``logits``, ``features``); an
        entry that is not a finite positive number is ignored (that kind's rows are
        all kept to the round's end, as in a first round).
    growth : float
        Most the median may move between two rounds, either way (``bound-growth``, > 1).

    Examples
    --------
    >>> fold = KnowledgeFold(2, clip_factor=2.0, previous={"logits": 1.0}, growth=2.0)
    >>> for tag, row in enumerate(([0.6, 0.8], [0.0, 3.0], [6.0, 8.0])):
    ...     fold.add(ClassKnowledge(np.array([0]), np.array([1]), np.array([row])), tag)
    >>> out = fold.result()  # norms 1, 3, 10: median 3, at most 1 x 2 = 2: bound 4
    >>> out.kept, out.rows, out.clips, out.scales  # threshold 2 x 1 / 2 = 1: two kept
    (2, 3, [(2, 'logits', 10.0, 4.0)], {'logits': 2.0})
    >>> [round(float(x), 6) for x in out.merged.logits[0]]  # (0.6, 0.8) + (0, 3) + (2.4, 3.2)
    [1.0, 2.333333]
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
        self.thresholds: dict[str, float] = {
            kind: self.clip_factor * scale / self.growth for kind, scale in self.previous.items()
        }
        """Per kind, the norm at or below which a row cannot be clipped this round."""
        self.sums: KnowledgeSums | None = None
        self.feature_dim: int | None = None
        self.norms: dict[str, list[float]] = {}
        """Per kind, each node's lower median positive row norm (the round's median)."""
        self._kept: list[tuple[int, ClassKnowledge]] = []
        self.kept = 0
        self.rows = 0
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

    def add(self, part: ClassKnowledge, tag: int) -> None:
        """Check ``part``, fold its rows that cannot be clipped, keep the others.

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
        k = part.num_classes_present
        self.rows += k
        foldable = np.ones(k, dtype=bool)
        for kind in KINDS:
            values = getattr(part, kind)
            if values is None:
                continue
            norms = row_norms(values)
            own = node_median(norms)
            if own is not None:  # the node's own median: it counts once in the round's
                self.norms.setdefault(kind, []).append(own)
            if self.clip_factor > 0:
                foldable &= norms <= self.thresholds.get(kind, 0.0)
        if bool(foldable.all()):
            self.sums.add(part)
            return
        if bool(foldable.any()):
            self.sums.add(_rows(part, foldable))
        self._kept.append((tag, _rows(part, ~foldable)))
        self.kept += int((~foldable).sum())

    def medians(self) -> dict[str, float]:
        """Return the round's median norm per kind, within ``growth`` of the previous.

        The lower median of the nodes' own lower median row norms (a node counts
        once, whatever classes it claims), kept within ``[previous / growth,
        previous * growth]`` when there is a previous median: ``clip-factor`` times
        it is the round's bound. A majority can move it by at most ``growth`` a round
        either way (before, only the fall was bounded: one round of rows of 1e30 set
        a median that took a hundred rounds to come down).
        """
        out: dict[str, float] = {}
        for kind, norms in self.norms.items():
            if norms:
                median = lower_median(norms)
                previous = self.previous.get(kind)
                if previous is not None:
                    median = min(max(median, previous / self.growth), previous * self.growth)
                out[kind] = median
        return out

    def result(self) -> FoldResult:
        """Bound and fold the kept rows; return the merge and the round's medians.

        Raises
        ------
        KnowledgeError
            If nothing was added.
        """
        if self.sums is None:
            raise KnowledgeError("nothing to merge: no client knowledge was given")
        medians = self.medians() if self.clip_factor > 0 else {}
        bounds = {kind: self.clip_factor * median for kind, median in medians.items()}
        clips: list[tuple[int, str, float, float]] = []
        if self._kept:
            bounded, found = clip_knowledge([p for _, p in self._kept], bounds)
            clips = [(self._kept[i][0], kind, norm, b) for i, kind, norm, b in found]
            for part in bounded:
                self.sums.add(part)
            self._kept.clear()
        return FoldResult(self.sums.merged(), clips, medians, self.kept, self.rows)


def _rows(part: ClassKnowledge, mask: np.ndarray) -> ClassKnowledge:
    """Return the rows of ``part`` where ``mask`` holds."""
    return ClassKnowledge(
        part.class_ids[mask],
        part.counts[mask],
        part.logits[mask],
        None if part.features is None else part.features[mask],
    )


def within_declared(
    ctx: RoundContext, knowledge: ClassKnowledge, node_id: int, declared: Sequence[int] | None
) -> ClassKnowledge:
    """Return a reply's knowledge within its node's handshake label counts, logged.

    :func:`~strategies.felo.knowledge.cap_to_declared` against ``declared`` (the
    node's :attr:`~strategies.core.nodes.NodeInfo.label_counts`; ``None``: no
    handshake on record, unchanged). A cut is logged as a warning naming the classes.

    Raises
    ------
    KnowledgeError
        If no class is left: the node declared none of the classes it reports (the
        reply is then rejected, before anything of it is folded).
    """
    if declared is None:
        return knowledge
    within = cap_to_declared(knowledge, declared)
    if within is knowledge:
        return knowledge
    over = [
        f"{c}: {n} > {declared[c]}"
        for c, n in zip(knowledge.class_ids.tolist(), knowledge.counts.tolist(), strict=True)
        if n > declared[c]
    ]
    if not within.num_classes_present:
        raise KnowledgeError(
            f"its knowledge covers only classes its handshake declared none of "
            f"({', '.join(over[:10])}; class: count > declared)"
        )
    log.warning(
        "round %d: node %d claims more samples than its handshake declared (%s; class: "
        "count > declared): counts cut to the declared ones, undeclared classes dropped",
        ctx.server_round,
        node_id,
        ", ".join(over[:10]),
    )
    return within


KNOWLEDGE_SCALES = "knowledge_scales"
"""Checkpoint entry of the knowledge scales (kind -> float)."""


@dataclass
class KnowledgeRound:
    """One round's :class:`KnowledgeFold`, kept in the round context (``ctx.state``)."""

    fold: KnowledgeFold


def round_fold(ctx: RoundContext, env: ServerEnv, previous: Mapping[str, float]) -> KnowledgeFold:
    """Return the round's :class:`KnowledgeFold`, made on the round's first reply.

    Bounded by run-config ``knowledge-clip-factor`` and ``bound-growth`` against the
    previous round's medians ``previous``; kept in the round context.
    """
    agg = env.run.aggregation

    def build() -> KnowledgeRound:
        fold = KnowledgeFold(
            env.num_classes,
            clip_factor=agg.knowledge_clip_factor,
            previous=previous,
            growth=agg.bound_growth,
        )
        return KnowledgeRound(fold)

    return ctx.state(KnowledgeRound, build).fold


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
