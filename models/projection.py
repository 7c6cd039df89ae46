r"""A common feature space for heterogeneous models: project, then classify.

Schemes that exchange representations across architectures (Felo, Velo) need every
model's :meth:`~models.base.TesseraModel.forward_features` to live in one space of one
size. The paper's ResNets all produce 512-d features; Tessera's families do not (the
``cnn`` sizes give 16 to 128, the ``mlp`` sizes 64). :class:`ProjectedModel` wraps any
zoo model and puts a learned projection between its body and a new head::

    x -> body.forward_features -> Linear(native, feature_dim) -> ReLU -> head -> logits
                                  \______ projection ______/
                                          forward_features of the wrapper

The projection is ``Linear + ReLU`` (no normalisation): the ReLU keeps the shared
features non-negative, like the pooled post-activation features the paper exchanges,
and no normalisation layer means no running statistics that would differ between
architectures. When the native size already equals ``feature_dim`` the projection is
the identity and the wrapped model's own head is kept, so nothing is added.

The wrapped model's head is always taken out of it (moved when kept, dropped when a new
head replaces it), so the wrapper's ``state_dict`` holds no parameter that never trains:
keys are ``body.*``, ``projection.*`` (when there is one) and ``head.*``.
"""

from __future__ import annotations

from torch import Tensor, nn

from models.base import TesseraModel

__all__ = ["ProjectedModel"]


class ProjectedModel(TesseraModel):
    """A zoo model whose representation is projected to a shared ``feature_dim``.

    Parameters
    ----------
    body : TesseraModel
        The model to wrap; its head is removed from it (see the module docstring).
    feature_dim : int
        Size of the shared feature space, at least 1.

    Attributes
    ----------
    body : TesseraModel
        The wrapped model, used for :meth:`TesseraModel.forward_features` only.
    native_dim : int
        The wrapped model's own representation size.
    projection : nn.Module
        ``Linear(native_dim, feature_dim) + ReLU``, or ``nn.Identity`` when the sizes
        agree.
    head : nn.Linear
        ``Linear(feature_dim, num_classes)``: a new one, or the wrapped model's own
        head when no projection is needed.

    Raises
    ------
    ValueError
        If ``feature_dim`` is smaller than 1.
    """

    def __init__(self, body: TesseraModel, *, feature_dim: int) -> None:
        if feature_dim < 1:
            raise ValueError(
                f"feature_dim must be >= 1, got {feature_dim}; set run-config "
                "'feature-dim' to the shared feature size, e.g. 128"
            )
        super().__init__(
            input_shape=body.input_shape,
            feature_dim=feature_dim,
            num_classes=body.num_classes,
        )
        self.native_dim = body.feature_dim
        own_head = body.head
        del body.head  # kept below, or replaced: never a parameter that does not train
        self.body = body
        self.projection: nn.Module
        if self.native_dim == feature_dim:
            self.projection = nn.Identity()
            self.head = own_head
        else:
            self.projection = nn.Sequential(nn.Linear(self.native_dim, feature_dim), nn.ReLU())
            self.head = nn.Linear(feature_dim, body.num_classes)

    @property
    def is_identity(self) -> bool:
        """Whether the native size already equals ``feature_dim`` (no projection)."""
        return isinstance(self.projection, nn.Identity)

    def forward_features(self, x: Tensor) -> Tensor:
        """Map a batch to shared representations of size ``feature_dim``.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Representations of shape ``(N, feature_dim)``.
        """
        z: Tensor = self.projection(self.body.forward_features(x))
        return z
