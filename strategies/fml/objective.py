r"""FML's local objective: the personal model and the meme distil into each other.

Per minibatch of ``N`` samples, with ``p`` the personal model's logits, ``m`` the
meme's and ``sg`` a stop-gradient (the other model's prediction is a target)::

    L_personal = alpha * CE(p, y) + (1 - alpha) * KL(softmax(sg(m)) || softmax(p))
    L_meme     = beta  * CE(m, y) + (1 - beta)  * KL(softmax(sg(p)) || softmax(m))

as Shen et al. (2020) write it (Eq. 1-2: each model is pulled towards the other's
prediction, ``KL(p_other || p_own)``; no temperature). CE is the batch mean and KL
the per-sample sum over classes averaged over the batch (``batchmean``, the
divergence itself). The node minimises ``L_personal + L_meme``: thanks to the
stop-gradients each model receives the gradient of its own loss only, so one
optimiser step over both is the paper's two updates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

from strategies.fml.pair import MutualPair
from tessera.training import LossFn

__all__ = ["distillation_kl", "mutual_loss", "mutual_losses"]


def distillation_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Return ``KL(softmax(teacher) || softmax(student))``, batch mean, teacher detached.

    Parameters
    ----------
    student : torch.Tensor
        Logits ``(N, C)`` of the model being trained.
    teacher : torch.Tensor
        Logits ``(N, C)`` of the model whose prediction is the target (no gradient
        flows into it).

    Returns
    -------
    torch.Tensor
        The scalar ``1/N sum_i sum_c q_ic (log q_ic - log p_ic)``.
    """
    target = F.log_softmax(teacher.detach(), dim=1)
    kl: torch.Tensor = F.kl_div(
        F.log_softmax(student, dim=1), target, reduction="batchmean", log_target=True
    )
    return kl


def mutual_losses(
    personal: torch.Tensor, meme: torch.Tensor, y: torch.Tensor, *, alpha: float, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(L_personal, L_meme)`` of one minibatch (module docstring).

    Parameters
    ----------
    personal, meme : torch.Tensor
        The two models' logits, ``(N, C)`` each.
    y : torch.Tensor
        Labels ``(N,)``.
    alpha, beta : float
        The cross-entropy weights of the personal model and the meme.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        Two scalars; the first has no gradient path into ``meme``, the second none
        into ``personal``.

    Raises
    ------
    ValueError
        If the logits' shapes differ.
    """
    if personal.shape != meme.shape:
        raise ValueError(
            f"the personal logits are {tuple(personal.shape)} but the meme's "
            f"{tuple(meme.shape)}; both models must classify the same classes"
        )
    own = alpha * F.cross_entropy(personal, y) + (1.0 - alpha) * distillation_kl(personal, meme)
    shared = beta * F.cross_entropy(meme, y) + (1.0 - beta) * distillation_kl(meme, personal)
    return own, shared


def mutual_loss(*, alpha: float, beta: float) -> LossFn:
    """Return the lifecycle's loss of a :class:`MutualPair`: ``L_personal + L_meme``."""

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not isinstance(model, MutualPair):
            raise TypeError(f"FML trains a MutualPair, not a {type(model).__name__}")
        own, shared = mutual_losses(model.personal(x), model.meme(x), y, alpha=alpha, beta=beta)
        total: torch.Tensor = own + shared
        return total

    return loss
