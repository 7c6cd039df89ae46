"""The local objective, the paper's equation (1).

Cross-entropy plus the per-class feature and logit terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias

from models.base import TesseraModel
from strategies.felo.knowledge import (
    ClassKnowledge,
)


@dataclass(frozen=True)
class ClassTargets:
    """The server's per-class targets as lookup tables indexed by class id.

    Attributes
    ----------
    known : torch.Tensor
        bool ``(num_classes,)``: whether the server sent a target for the class.
    logits : torch.Tensor
        ``(num_classes, num_classes)`` target logits (zero rows where unknown).
    features : torch.Tensor | None
        ``(num_classes, feature_dim)`` target features, or ``None`` (logits only).
    """

    known: torch.Tensor
    logits: torch.Tensor
    features: torch.Tensor | None

    @classmethod
    def from_knowledge(cls, knowledge: ClassKnowledge, num_classes: int) -> ClassTargets:
        """Scatter per-class knowledge into tables of ``num_classes`` rows."""
        ids = torch.from_numpy(knowledge.class_ids.astype(np.int64))
        known = torch.zeros(num_classes, dtype=torch.bool)
        known[ids] = True
        logits = torch.zeros((num_classes, knowledge.logits.shape[1]))
        logits[ids] = torch.from_numpy(knowledge.logits.astype(np.float32))
        features = None
        if knowledge.features is not None:
            features = torch.zeros((num_classes, knowledge.features.shape[1]))
            features[ids] = torch.from_numpy(knowledge.features.astype(np.float32))
        return cls(known, logits, features)

    def to(self, device: torch.device) -> ClassTargets:
        """Move the tables to ``device``."""
        feats = None if self.features is None else self.features.to(device)
        return ClassTargets(self.known.to(device), self.logits.to(device), feats)


@dataclass(frozen=True)
class LossTerms:
    """The three terms of equation (1) for one minibatch (each a batch mean)."""

    ce: torch.Tensor
    mse: torch.Tensor
    kl: torch.Tensor

    def total(self, alpha: float) -> torch.Tensor:
        """``ce + alpha * (mse + kl)``."""
        out: torch.Tensor = self.ce + alpha * (self.mse + self.kl)
        return out


def loss_terms(
    model: TesseraModel,
    x: torch.Tensor,
    y: torch.Tensor,
    targets: ClassTargets | None,
    *,
    temperature: float,
) -> LossTerms:
    """Compute the terms of equation (1) (see the module docstring).

    Samples whose class has no target contribute 0 to ``mse`` and ``kl``; the sums
    are divided by the full batch size, as in the equation's ``1/|D|``.

    Parameters
    ----------
    model : TesseraModel
        The client model (``forward_features``, ``forward_head``).
    x, y : torch.Tensor
        A minibatch and its labels.
    targets : ClassTargets | None
        The server's targets on ``x``'s device, or ``None`` (plain cross-entropy).
    temperature : float
        Distillation temperature ``T``.

    Returns
    -------
    LossTerms
        Cross-entropy, feature MSE and logit KL, each a scalar.
    """
    features = model.forward_features(x)
    logits = model.forward_head(features)
    ce = F.cross_entropy(logits, y)
    zero = torch.zeros((), device=logits.device, dtype=logits.dtype)
    if targets is None:
        return LossTerms(ce, zero, zero)
    mask = targets.known[y].to(logits.dtype)
    n = float(y.shape[0])
    teacher = F.softmax(targets.logits[y] / temperature, dim=1)
    student = F.log_softmax(logits / temperature, dim=1)
    kl_each = F.kl_div(student, teacher, reduction="none").sum(dim=1) * temperature**2
    kl = (kl_each * mask).sum() / n
    mse = zero
    if targets.features is not None:
        mse_each = ((features - targets.features[y]) ** 2).mean(dim=1)
        mse = (mse_each * mask).sum() / n
    return LossTerms(ce, mse, kl)
