"""The ``cnn`` family: FedHeNN's five small convolutional networks.

Sizes grow from one convolution and one fully connected layer (``cnn-1``) to three
convolutions and three fully connected layers (``cnn-5``); the table is
:data:`CNN_VARIANTS`. Each convolution is a bias-free 3x3 convolution with padding 1,
followed by the injected norm, a ReLU and a 2x2 max-pool; the max-pool is skipped
once the feature map is 1 pixel high or wide, so 8x8 digits and 5x5 images made from
20-d vectors both work. Global average pooling then flattens the maps. In the 1-d form
(signals) the same table gives 3-wide convolutions and 2-wide max-pools.

Hidden fully connected layers are ``Linear + ReLU`` without normalisation, as in
FedHeNN. The representation (:meth:`CNN.forward_features`) is the output of the last
hidden fully connected layer, or the pooled convolutional features when the model has
no hidden fully connected layer; the head is the final linear layer.

Signals ``(C, L)`` and, by default, flat vectors ``(L,)`` give the 1-d form
(``Conv1d``, ``BatchNorm1d``, ``MaxPool1d``); ``flat_input="square"`` reshapes a flat
vector to a one-channel square image instead, see :class:`models.inputs.InputAdapter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from torch import Tensor, nn

from models.base import ConvModel, FamilyConfig
from models.layers import SpatialLayers
from models.norm import NormFactory
from models.registry import register_family

__all__ = ["CNN", "CNN_VARIANTS", "CNNConfig"]


class CNN(ConvModel):
    """Small convolutional network: conv blocks, global average pool, fc layers.

    Built from a :class:`CNNConfig` (convolution channels and hidden fully connected
    widths); the parameters are those of :class:`~models.base.ConvModel`. Unlike the
    other convolutional families it keeps PyTorch's default initialisation.
    """

    config: CNNConfig

    def build_body(self, layers: SpatialLayers, norm_layer: NormFactory) -> None:
        """Build the conv blocks (``convs``) and the hidden fully connected layers (``fcs``)."""
        in_channels, *size = self.adapter.output_shape
        convs: list[nn.Module] = []
        for out_channels in self.config.conv_channels:
            convs += [
                layers.conv3x3(in_channels, out_channels),
                norm_layer(out_channels),
                nn.ReLU(),
            ]
            if min(size) > 1:
                convs.append(layers.max_pool())
                size = [s // 2 for s in size]
            in_channels = out_channels
        convs += list(layers.global_pool())
        self.convs = nn.Sequential(*convs)

        fcs: list[nn.Module] = []
        in_features = in_channels
        for out_features in self.config.fc_features:
            fcs += [nn.Linear(in_features, out_features), nn.ReLU()]
            in_features = out_features
        self.fcs = nn.Sequential(*fcs)

    def init_weights(self) -> None:
        """Keep PyTorch's default initialisation, as FedHeNN's networks do."""

    def forward_body(self, x: Tensor) -> Tensor:
        """Apply the conv blocks, then the hidden fully connected layers."""
        z: Tensor = self.fcs(self.convs(x))
        return z


@dataclass(frozen=True)
class CNNConfig(FamilyConfig):
    """Architecture of a :class:`CNN`.

    Attributes
    ----------
    conv_channels : tuple[int, ...]
        Output channels of each 3x3 convolution, at least one.
    fc_features : tuple[int, ...]
        Output features of each hidden fully connected layer (the head excluded);
        may be empty.
    """

    model_class = CNN

    conv_channels: tuple[int, ...]
    fc_features: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Validate the table."""
        if not self.conv_channels:
            raise ValueError("CNNConfig.conv_channels must list at least one convolution, got ().")
        for field, values in (
            ("conv_channels", self.conv_channels),
            ("fc_features", self.fc_features),
        ):
            if any(v < 1 for v in values):
                raise ValueError(f"CNNConfig.{field} entries must be positive, got {values}.")

    @property
    def feature_dim(self) -> int:
        """The last hidden fully connected width, else the last convolution's channels."""
        return (self.fc_features or self.conv_channels)[-1]


CNN_VARIANTS: Final[tuple[tuple[str, CNNConfig, str], ...]] = (
    ("cnn-1", CNNConfig(conv_channels=(16,), fc_features=()), "1 conv(16) + 1 fc"),
    ("cnn-2", CNNConfig(conv_channels=(16, 32), fc_features=()), "2 conv(16, 32) + 1 fc"),
    ("cnn-3", CNNConfig(conv_channels=(16, 32), fc_features=(64,)), "2 conv(16, 32) + 2 fc"),
    (
        "cnn-4",
        CNNConfig(conv_channels=(16, 32, 64), fc_features=(128,)),
        "3 conv(16, 32, 64) + 2 fc",
    ),
    (
        "cnn-5",
        CNNConfig(conv_channels=(32, 64, 128), fc_features=(256, 128)),
        "3 conv(32, 64, 128) + 3 fc",
    ),
)
"""FedHeNN sizes, ``(name, config, description)`` by ascending size rank:
``len(conv_channels)`` convolutions, ``len(fc_features) + 1`` fully connected layers."""


register_family("cnn", CNN_VARIANTS)
