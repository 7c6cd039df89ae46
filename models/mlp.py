"""The ``mlp`` family: multilayer perceptrons on flattened inputs.

Any input, image or vector, is flattened to ``prod(input_shape)`` features. Each
hidden layer is ``Linear -> norm -> ReLU``; the injected norm is applied to the
``(N, C)`` activations through :class:`models.norm.VectorNorm`, which makes ``batch``
behave as ``BatchNorm1d``. The output of the last hidden layer is the representation.
The hidden widths of each registered size are the data in :data:`MLP_HIDDEN`.
The builders accept ``flat_input`` like every registered builder and ignore it: a
flattened input is the same whatever its form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final

from torch import Tensor, nn

from models.base import FlatInput, TesseraModel, check_batch_shape
from models.norm import NormFactory, VectorNorm, batch_norm
from models.registry import register_model

__all__ = ["MLP", "MLP_HIDDEN"]


MLP_HIDDEN: Final[Mapping[str, tuple[int, ...]]] = MappingProxyType(
    {
        "mlp-s": (64,),
        "mlp-m": (128, 64),
        "mlp-l": (256, 128, 64),
    }
)
"""Hidden layer widths of each registered MLP."""


class MLP(TesseraModel):
    """Multilayer perceptron on the flattened input.

    Parameters
    ----------
    hidden : Sequence[int]
        Width of each hidden layer, at least one.
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)`` or ``(D,)``; it is flattened.
    num_classes : int
        Number of classes, at least 2.
    norm_layer : NormFactory, optional
        Normalisation after each hidden linear layer, batch norm by default.
    """

    def __init__(
        self,
        *,
        hidden: Sequence[int],
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory = batch_norm,
    ) -> None:
        widths = tuple(hidden)
        if not widths or min(widths) < 1:
            raise ValueError(
                f"MLP hidden widths must be a non-empty sequence of positive ints, got {hidden!r}."
            )
        super().__init__(input_shape=input_shape, feature_dim=widths[-1], num_classes=num_classes)
        layers: list[nn.Module] = [nn.Flatten()]
        in_features = math.prod(self.input_shape)
        for width in widths:
            layers += [
                nn.Linear(in_features, width),
                VectorNorm(width, norm_layer=norm_layer),
                nn.ReLU(),
            ]
            in_features = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(in_features, num_classes)

    def forward_features(self, x: Tensor) -> Tensor:
        """Map a batch to representations of size ``feature_dim``.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Representations of shape ``(N, feature_dim)``.
        """
        check_batch_shape(x, self.input_shape)
        z: Tensor = self.body(x)
        return z


def _build(
    name: str, input_shape: tuple[int, ...], num_classes: int, norm_layer: NormFactory
) -> MLP:
    return MLP(
        hidden=MLP_HIDDEN[name],
        input_shape=input_shape,
        num_classes=num_classes,
        norm_layer=norm_layer,
    )


@register_model("mlp-s", family="mlp", size_rank=0, description="hidden (64,)")
def mlp_s(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> MLP:
    """Build ``mlp-s``: one hidden layer of 64."""
    del flat_input  # an MLP flattens every input, a vector is a vector
    return _build("mlp-s", input_shape, num_classes, norm_layer)


@register_model("mlp-m", family="mlp", size_rank=1, description="hidden (128, 64)")
def mlp_m(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> MLP:
    """Build ``mlp-m``: hidden layers of 128 and 64."""
    del flat_input  # an MLP flattens every input, a vector is a vector
    return _build("mlp-m", input_shape, num_classes, norm_layer)


@register_model("mlp-l", family="mlp", size_rank=2, description="hidden (256, 128, 64)")
def mlp_l(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> MLP:
    """Build ``mlp-l``: hidden layers of 256, 128 and 64."""
    del flat_input  # an MLP flattens every input, a vector is a vector
    return _build("mlp-l", input_shape, num_classes, norm_layer)
