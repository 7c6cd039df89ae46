"""The ``mlp`` family: multilayer perceptrons on flattened inputs.

Any input, image or vector, is flattened to ``prod(input_shape)`` features. Each
hidden layer is ``Linear -> norm -> ReLU``; the injected norm is applied to the
``(N, C)`` activations through :class:`models.norm.VectorNorm`, which makes ``batch``
behave as ``BatchNorm1d``. The output of the last hidden layer is the representation.
The hidden widths of each registered size are the data in :data:`MLP_VARIANTS`.
The model accepts ``flat_input`` like every registered model and ignores it: a
flattened input is the same whatever its form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from torch import Tensor, nn

from models.base import FamilyConfig, TesseraModel
from models.inputs import FlatInput, check_batch_shape
from models.norm import NormFactory, VectorNorm, batch_norm
from models.registry import register_family

__all__ = ["MLP", "MLP_VARIANTS", "MLPConfig"]


class MLP(TesseraModel):
    """Multilayer perceptron on the flattened input.

    Parameters
    ----------
    config : MLPConfig
        Width of each hidden layer.
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)``, ``(C, L)`` or ``(L,)``; it is flattened.
    num_classes : int
        Number of classes, at least 2.
    norm_layer : NormFactory, optional
        Normalisation after each hidden linear layer, batch norm by default.
    flat_input : FlatInput, optional
        Ignored: a flattened input is the same whatever its form.

    Attributes
    ----------
    config : MLPConfig
        The architecture the model was built from.
    """

    def __init__(
        self,
        *,
        config: MLPConfig,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory = batch_norm,
        flat_input: FlatInput = "signal",
    ) -> None:
        del flat_input  # an MLP flattens every input, a vector is a vector
        super().__init__(
            input_shape=input_shape, feature_dim=config.feature_dim, num_classes=num_classes
        )
        self.config = config
        layers: list[nn.Module] = [nn.Flatten()]
        in_features = math.prod(self.input_shape)
        for width in config.hidden:
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


@dataclass(frozen=True)
class MLPConfig(FamilyConfig):
    """Architecture of an :class:`MLP`.

    Attributes
    ----------
    hidden : tuple[int, ...]
        Width of each hidden layer, at least one.
    """

    model_class = MLP

    hidden: tuple[int, ...]

    def __post_init__(self) -> None:
        """Validate the widths."""
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(
                f"MLP hidden widths must be a non-empty sequence of positive ints, "
                f"got {self.hidden!r}."
            )

    @property
    def feature_dim(self) -> int:
        """Width of the last hidden layer, the size of the representation."""
        return self.hidden[-1]


MLP_VARIANTS: Final[tuple[tuple[str, MLPConfig, str], ...]] = tuple(
    (name, MLPConfig(hidden=hidden), f"hidden {hidden}")
    for name, hidden in (
        ("mlp-s", (64,)),
        ("mlp-m", (128, 64)),
        ("mlp-l", (256, 128, 64)),
    )
)
"""The registered models, ``(name, config, description)`` by ascending size rank."""


register_family("mlp", MLP_VARIANTS)
