"""The two models an FML node trains together: its personal model and the meme.

:class:`MutualPair` holds both as sub-modules, so the client lifecycle trains them
in one pass of :func:`tessera.training.train_model` with the mutual objective
(:mod:`strategies.fml.objective`). As a :class:`~models.base.TesseraModel` the pair
*is* its personal model (forward, body and head are the personal model's), so
evaluating the pair on the node's test split is the personal accuracy. Its
``state_dict`` holds ``personal.*`` and ``meme.*``; what travels is the meme's own
``state_dict`` (:meth:`MutualPair.meme`), without the prefix.
"""

from __future__ import annotations

from torch import Tensor, nn

from models.base import TesseraModel

__all__ = ["MutualPair"]


class MutualPair(TesseraModel):
    """A personal model and a meme model trained side by side (module docstring).

    Parameters
    ----------
    personal : TesseraModel
        The node's own architecture, kept in its state across rounds.
    meme : TesseraModel
        The shared architecture, the same on every node; its weights travel.

    Attributes
    ----------
    personal : TesseraModel
        As given.
    meme : TesseraModel
        As given.

    Raises
    ------
    ValueError
        If the two models disagree on the input shape or the number of classes.
    """

    def __init__(self, personal: TesseraModel, meme: TesseraModel) -> None:
        if personal.input_shape != meme.input_shape or personal.num_classes != meme.num_classes:
            raise ValueError(
                f"the personal model takes {personal.input_shape} to {personal.num_classes} "
                f"classes but the meme {meme.input_shape} to {meme.num_classes}; build both "
                "for the same task"
            )
        super().__init__(
            input_shape=personal.input_shape,
            feature_dim=personal.feature_dim,
            num_classes=personal.num_classes,
        )
        self.personal = personal
        self.meme = meme

    @property
    def head(self) -> nn.Linear:
        """The personal model's head (the pair has no head of its own)."""
        return self.personal.head

    @head.setter
    def head(self, value: nn.Linear) -> None:
        raise AttributeError("a MutualPair's head is its personal model's; set that one")

    def forward_features(self, x: Tensor) -> Tensor:
        """Return the personal model's representation of ``x``.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Representations of shape ``(N, feature_dim)``.
        """
        return self.personal.forward_features(x)

    def forward_head(self, z: Tensor) -> Tensor:
        """Return the personal model's logits of representations ``z``.

        Parameters
        ----------
        z : Tensor
            Representations of shape ``(N, feature_dim)``.

        Returns
        -------
        Tensor
            Logits of shape ``(N, num_classes)``.
        """
        return self.personal.forward_head(z)

    def reset_classifier(self, num_classes: int) -> None:
        """Refuse: the pair's classes are its two models' (rebuild both instead).

        Raises
        ------
        NotImplementedError
            Always.
        """
        raise NotImplementedError(
            "a MutualPair cannot change its classes; build a new personal model and meme"
        )
