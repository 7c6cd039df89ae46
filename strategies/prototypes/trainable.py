"""FedTGP's trainable global prototypes and their adaptive-margin contrastive loss.

Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced
Contrastive Learning for Data and Model Heterogeneity in Federated Learning" (AAAI
2024), section 4:

- :class:`TrainablePrototypes`: one trainable embedding per class passed through a
  small network (``Linear(D, H) + ReLU + Linear(H, D)``); the global prototype of
  class ``c`` is ``net(emb[c])``;
- :func:`adaptive_margin`: with ``Q_c`` the centre of class ``c``'s client
  prototypes, ``delta = min(max_c min_{c' != c} ||Q_c - Q_c'||, tau)``: the
  largest of the class-wise smallest separations, capped at ``tau``
  (``fedtgp-margin-max``);
- :func:`margin_contrastive_loss`: for a client prototype ``P`` of class ``y``,
  ``-log( exp(-(d_y + delta)) / (exp(-(d_y + delta)) + sum_{c != y} exp(-d_c)) )``
  with ``d_c = ||P - G_c||``: cross-entropy on the negative distances to every
  global prototype ``G``, the own class's distance enlarged by the margin;
- :func:`train_prototypes`: minibatch SGD on that loss over the round's client
  prototypes for a number of epochs (:func:`sgd_epochs`, which FedGH's server
  training of its global head uses too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

__all__ = [
    "TrainablePrototypes",
    "TrainingResult",
    "adaptive_margin",
    "margin_contrastive_loss",
    "pairwise_distances",
    "sgd_epochs",
    "train_prototypes",
]


class TrainablePrototypes(nn.Module):
    """Class embeddings through a small network: the server's trainable prototypes.

    Parameters
    ----------
    num_classes : int
        Classes of the task (one embedding each).
    feature_dim : int
        Size of the prototypes (run-config ``feature-dim``).
    hidden_dim : int
        Width of the hidden layer (run-config ``fedtgp-hidden-dim``).
    """

    def __init__(self, *, num_classes: int, feature_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, feature_dim)
        self.net = nn.Sequential(
            nn.Linear(feature_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, feature_dim)
        )

    def forward(self, class_ids: torch.Tensor) -> torch.Tensor:
        """Return the prototypes of ``class_ids`` (int64 ``(K,)``), ``(K, feature_dim)``."""
        out: torch.Tensor = self.net(self.embedding(class_ids))
        return out

    def all_classes(self) -> torch.Tensor:
        """Return every class's prototype, ``(num_classes, feature_dim)``."""
        out: torch.Tensor = self(torch.arange(self.embedding.num_embeddings))
        return out


def pairwise_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Euclidean distances ``(len(a), len(b))``, with a finite gradient at distance 0."""
    squared = ((a[:, None, :] - b[None, :, :]) ** 2).sum(dim=2)
    return torch.sqrt(squared.clamp_min(1e-12))


def adaptive_margin(centres: torch.Tensor, margin_max: float) -> float:
    """Return ``min(max_c min_{c' != c} ||Q_c - Q_c'||, margin_max)`` over the rows ``Q``.

    With fewer than two classes nothing is separated and the cap is returned, as
    the paper's code does.
    """
    if centres.shape[0] < 2:
        return float(margin_max)
    distances = pairwise_distances(centres.double(), centres.double())
    distances.fill_diagonal_(float("inf"))
    return float(min(distances.min(dim=1).values.max().item(), margin_max))


def margin_contrastive_loss(
    prototypes: torch.Tensor, labels: torch.Tensor, generated: torch.Tensor, margin: float
) -> torch.Tensor:
    """Mean adaptive-margin contrastive loss of client ``prototypes`` (module docstring).

    Parameters
    ----------
    prototypes : torch.Tensor
        ``(B, D)`` client prototypes.
    labels : torch.Tensor
        int64 ``(B,)`` their classes.
    generated : torch.Tensor
        ``(C, D)`` the global prototypes of every class.
    margin : float
        ``delta``, added to each prototype's distance to its own class.
    """
    distances = pairwise_distances(prototypes, generated)
    distances = distances + margin * F.one_hot(labels, generated.shape[0]).to(distances.dtype)
    return F.cross_entropy(-distances, labels)


@dataclass(frozen=True)
class TrainingResult:
    """What one round of server training did: steps taken and the last epoch's mean loss."""

    steps: int
    loss: float


def train_prototypes(
    model: TrainablePrototypes,
    prototypes: torch.Tensor,
    labels: torch.Tensor,
    *,
    margin: float,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    generator: torch.Generator,
) -> TrainingResult:
    """Train ``model`` on the client prototypes with :func:`margin_contrastive_loss`.

    Plain SGD (the paper's server optimiser, at the clients' learning rate), each
    epoch one pass over the prototypes in shuffled minibatches of ``batch_size``
    (:func:`sgd_epochs`).
    """
    return sgd_epochs(
        model,
        prototypes,
        labels,
        lambda rows, y: margin_contrastive_loss(rows, y, model.all_classes(), margin),
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        generator=generator,
    )


def sgd_epochs(
    model: nn.Module,
    rows: torch.Tensor,
    labels: torch.Tensor,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    generator: torch.Generator,
) -> TrainingResult:
    """Train ``model``'s parameters with plain SGD on ``loss_of(rows[batch], labels[batch])``.

    Each epoch is one pass over the rows in shuffled minibatches of ``batch_size``
    (the order drawn from ``generator``): the server-side training of FedTGP's
    prototype network and of FedGH's global head.
    """
    optimiser = torch.optim.SGD(model.parameters(), lr=learning_rate)
    model.train()
    steps, loss_sum, seen = 0, 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(rows.shape[0], generator=generator)
        loss_sum, seen = 0.0, 0
        for begin in range(0, order.numel(), batch_size):
            idx = order[begin : begin + batch_size]
            loss = loss_of(rows[idx], labels[idx])
            optimiser.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimiser.step()
            steps += 1
            loss_sum += float(loss.item()) * idx.numel()
            seen += idx.numel()
    model.eval()
    return TrainingResult(steps=steps, loss=loss_sum / max(seen, 1))
