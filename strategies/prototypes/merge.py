"""The robust merge of client prototypes: Felo's bounded, count-weighted merge, reused.

Prototypes are untrusted rows, exactly like Felo's per-class features, so they go
through the same functions (:mod:`strategies.felo.knowledge`), imported rather than
copied: :func:`~strategies.felo.knowledge.cap_counts` (a node's counts weigh at most
what the round lets it weigh, run-config ``weight-cap``),
:func:`~strategies.felo.knowledge.bound_knowledge` (every row clipped to
``knowledge-clip-factor`` times the cohort's median row norm) and
:func:`~strategies.felo.knowledge.merge_knowledge` (``knowledge-merge``: the
count-weighted ``mean`` of FedProto, the coordinate-wise ``median`` or the
``trimmed-mean``, class by class).

Those functions take Felo's :class:`~strategies.felo.knowledge.ClassKnowledge`
(features *and* logits); a prototype becomes its ``features`` with all-zero logits,
which carry no norm (the bound ignores them) and merge to zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from strategies.felo.knowledge import (
    ClassKnowledge,
    bound_knowledge,
    cap_counts,
    merge_knowledge,
)
from strategies.prototypes.payload import ClassPrototypes

__all__ = ["PrototypeMerge", "as_knowledge", "as_prototypes", "merge_prototypes"]


@dataclass(frozen=True)
class PrototypeMerge:
    """The outcome of :func:`merge_prototypes`.

    Attributes
    ----------
    merged : ClassPrototypes
        One prototype per class some client holds, counts summed (after capping).
    bounded : list[ClassPrototypes]
        Each client's prototypes after capping and clipping, in input order (empty
        when the server folded them as they arrived, :mod:`strategies.felo.fold`).
    clips : list[tuple[int, float, float]]
        ``(part index, largest row norm, bound)`` per part whose rows were clipped.
    """

    merged: ClassPrototypes
    bounded: list[ClassPrototypes]
    clips: list[tuple[int, float, float]]

    def training_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every bounded client prototype as one sample of its class: float32 rows, int64 labels.

        What the server trains on (FedTGP's prototype network, FedGH's head), each
        client's row of a class counting once, whatever its count.
        """
        rows = np.concatenate([p.prototypes for p in self.bounded]).astype(np.float32)
        labels = np.concatenate([p.class_ids for p in self.bounded]).astype(np.int64)
        return torch.from_numpy(rows), torch.from_numpy(labels)


def as_knowledge(protos: ClassPrototypes, num_classes: int) -> ClassKnowledge:
    """Return ``protos`` as Felo's knowledge: the prototypes as features, all-zero logits."""
    zeros = np.zeros((protos.class_ids.shape[0], num_classes), dtype=np.float32)
    return ClassKnowledge(protos.class_ids, protos.counts, zeros, protos.prototypes)


def as_prototypes(knowledge: ClassKnowledge) -> ClassPrototypes:
    """Return the features of ``knowledge`` (made by :func:`as_knowledge`) as prototypes."""
    assert knowledge.features is not None  # every part given to Felo's merge had them
    return ClassPrototypes(knowledge.class_ids, knowledge.counts, knowledge.features)


def merge_prototypes(
    parts: Sequence[ClassPrototypes],
    num_classes: int,
    *,
    rule: str = "mean",
    trim_fraction: float = 0.1,
    clip_factor: float = 0.0,
    max_weights: Sequence[float | None] | None = None,
) -> PrototypeMerge:
    """Cap, bound and merge validated client prototypes, class by class.

    With ``rule="mean"`` (FedProto's aggregation) class ``c``'s prototype is
    ``sum_k n_kc * p_kc / sum_k n_kc`` over the clients ``k`` holding ``c``.

    Parameters
    ----------
    parts : Sequence[ClassPrototypes]
        Validated client prototypes of one width.
    num_classes : int
        Number of classes of the task.
    rule : str
        ``"mean"``, ``"median"`` or ``"trimmed-mean"`` (run-config ``knowledge-merge``).
    trim_fraction : float
        Share trimmed from each end by ``"trimmed-mean"`` (``trim-fraction``).
    clip_factor : float
        Row bound as a multiple of the cohort's median row norm, 0 for none
        (``knowledge-clip-factor``).
    max_weights : Sequence[float | None], optional
        Per part, the most its counts may sum to (its reply's capped weight).

    Returns
    -------
    PrototypeMerge
        The merged prototypes, the bounded parts and the clips.

    Raises
    ------
    KnowledgeError
        If ``parts`` is empty, the widths disagree or the rule is unknown.
    """
    knowledge = [as_knowledge(p, num_classes) for p in parts]
    if max_weights is not None:
        knowledge = [
            k if cap is None else cap_counts(k, cap)
            for k, cap in zip(knowledge, max_weights, strict=True)
        ]
    bounded, clips = bound_knowledge(knowledge, clip_factor)
    merged = merge_knowledge(bounded, num_classes, rule=rule, trim_fraction=trim_fraction)
    return PrototypeMerge(
        merged=as_prototypes(merged),
        bounded=[as_prototypes(k) for k in bounded],
        clips=[(i, norm, bound) for i, kind, norm, bound in clips if kind == "features"],
    )
