"""The ``cnn`` family: FedHeNN's five small convolutional networks.

Sizes grow from one convolution and one fully connected layer (``cnn-1``) to three
convolutions and three fully connected layers (``cnn-5``); the table is
:data:`CNN_CONFIGS`. Each convolution is a bias-free 3x3 convolution with padding 1,
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
vector to a one-channel square image instead, see :class:`models.base.InputAdapter`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from torch import Tensor, nn

from models.base import FlatInput, InputAdapter, TesseraModel
from models.norm import NormFactory, batch_norm
from models.registry import register_model

__all__ = ["CNN", "CNN_CONFIGS", "CNNConfig"]


@dataclass(frozen=True)
class CNNConfig:
    """Architecture of a :class:`CNN`.

    Attributes
    ----------
    conv_channels : tuple[int, ...]
        Output channels of each 3x3 convolution, at least one.
    fc_features : tuple[int, ...]
        Output features of each hidden fully connected layer (the head excluded);
        may be empty.
    """

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


CNN_CONFIGS: Final[Mapping[str, CNNConfig]] = MappingProxyType(
    {
        "cnn-1": CNNConfig(conv_channels=(16,), fc_features=()),
        "cnn-2": CNNConfig(conv_channels=(16, 32), fc_features=()),
        "cnn-3": CNNConfig(conv_channels=(16, 32), fc_features=(64,)),
        "cnn-4": CNNConfig(conv_channels=(16, 32, 64), fc_features=(128,)),
        "cnn-5": CNNConfig(conv_channels=(32, 64, 128), fc_features=(256, 128)),
    }
)
"""FedHeNN sizes: ``len(conv_channels)`` convolutions, ``len(fc_features) + 1`` fcs."""


class CNN(TesseraModel):
    """Small convolutional network: conv blocks, global average pool, fc layers.

    Parameters
    ----------
    config : CNNConfig
        Convolution channels and hidden fully connected widths.
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)``, ``(C, L)`` or ``(L,)``.
    num_classes : int
        Number of classes, at least 2.
    norm_layer : NormFactory, optional
        Normalisation after each convolution, batch norm by default (its 1-d form
        for signals, :func:`models.norm.norm_for_ndim`).
    flat_input : FlatInput, optional
        How a flat vector is read, ``"signal"`` (default) or ``"square"``.
    """

    def __init__(
        self,
        *,
        config: CNNConfig,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory = batch_norm,
        flat_input: FlatInput = "signal",
    ) -> None:
        feature_dim = (config.fc_features or config.conv_channels)[-1]
        super().__init__(input_shape=input_shape, feature_dim=feature_dim, num_classes=num_classes)
        self.config = config
        self.adapter = InputAdapter(input_shape=self.input_shape, flat_input=flat_input)
        spatial = self.adapter.layers
        norm = spatial.norm(norm_layer)
        in_channels, *size = self.adapter.output_shape

        layers: list[nn.Module] = []
        for out_channels in config.conv_channels:
            layers += [
                spatial.conv3x3(in_channels, out_channels),
                norm(out_channels),
                nn.ReLU(),
            ]
            if min(size) > 1:
                layers.append(spatial.max_pool())
                size = [s // 2 for s in size]
            in_channels = out_channels
        layers += list(spatial.global_pool())
        self.convs = nn.Sequential(*layers)

        fcs: list[nn.Module] = []
        in_features = in_channels
        for out_features in config.fc_features:
            fcs += [nn.Linear(in_features, out_features), nn.ReLU()]
            in_features = out_features
        self.fcs = nn.Sequential(*fcs)
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
        z: Tensor = self.fcs(self.convs(self.adapter(x)))
        return z


def _build(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory,
    flat_input: FlatInput,
) -> CNN:
    return CNN(
        config=CNN_CONFIGS[name],
        input_shape=input_shape,
        num_classes=num_classes,
        norm_layer=norm_layer,
        flat_input=flat_input,
    )


@register_model("cnn-1", family="cnn", size_rank=0, description="1 conv(16) + 1 fc")
def cnn_1(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> CNN:
    """Build ``cnn-1``: conv(16), pooled features (16-d), head."""
    return _build("cnn-1", input_shape, num_classes, norm_layer, flat_input)


@register_model("cnn-2", family="cnn", size_rank=1, description="2 conv(16, 32) + 1 fc")
def cnn_2(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> CNN:
    """Build ``cnn-2``: conv(16), conv(32), pooled features (32-d), head."""
    return _build("cnn-2", input_shape, num_classes, norm_layer, flat_input)


@register_model("cnn-3", family="cnn", size_rank=2, description="2 conv(16, 32) + 2 fc")
def cnn_3(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> CNN:
    """Build ``cnn-3``: conv(16), conv(32), fc(64) representation, head."""
    return _build("cnn-3", input_shape, num_classes, norm_layer, flat_input)


@register_model("cnn-4", family="cnn", size_rank=3, description="3 conv(16, 32, 64) + 2 fc")
def cnn_4(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> CNN:
    """Build ``cnn-4``: conv(16), conv(32), conv(64), fc(128) representation, head."""
    return _build("cnn-4", input_shape, num_classes, norm_layer, flat_input)


@register_model("cnn-5", family="cnn", size_rank=4, description="3 conv(32, 64, 128) + 3 fc")
def cnn_5(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> CNN:
    """Build ``cnn-5``: conv(32, 64, 128), fc(256), fc(128) representation, head."""
    return _build("cnn-5", input_shape, num_classes, norm_layer, flat_input)
