"""The ``resnet`` family: CIFAR-style ResNets of depth 10 to 26 (Felo/Velo sizes).

A 3x3 stride-1 stem (no max-pool), four stages of BasicBlocks of widths
``base_width * (1, 2, 4, 8)`` (64-128-256-512 by default), the first stage at
stride 1 and the others at stride 2, then global average pooling. The pooled
``8 * base_width`` vector (512-d by default) is the representation. A stride-2 3x3
convolution with padding maps a 1x1 map to 1x1, so 8x8 inputs (8, 4, 2, 1) work.

Depth counts the stem, two convolutions per block and the head:
``depth = 2 + 2 * sum(stage_blocks)``; the blocks per stage of each registered depth
are the data in :data:`RESNET_STAGE_BLOCKS`.

Signals ``(C, L)`` and, by default, flat vectors ``(L,)`` give the 1-d form of the
same table (``Conv1d``, 1-d norms and pooling, built through
:class:`models.layers.SpatialLayers`); ``flat_input="square"`` reshapes a flat vector
to a one-channel square image instead, see :class:`models.base.InputAdapter`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from torch import Tensor, nn

from models.base import FlatInput, InputAdapter, TesseraModel
from models.layers import LAYERS_2D, SpatialLayers, init_conv_weights
from models.norm import NormFactory, batch_norm
from models.registry import register_model

__all__ = ["RESNET_STAGE_BLOCKS", "BasicBlock", "ResNet", "ResNetConfig"]


RESNET_STAGE_BLOCKS: Final[Mapping[int, tuple[int, ...]]] = MappingProxyType(
    {
        10: (1, 1, 1, 1),
        14: (1, 1, 2, 2),
        18: (2, 2, 2, 2),
        22: (2, 2, 3, 3),
        26: (3, 3, 3, 3),
    }
)
"""BasicBlocks per stage of each registered depth; ``depth = 2 + 2 * sum(blocks)``."""


@dataclass(frozen=True)
class ResNetConfig:
    """Architecture of a :class:`ResNet`.

    Attributes
    ----------
    stage_blocks : tuple[int, ...]
        Number of BasicBlocks in each stage; stage ``i`` has width
        ``base_width * 2**i``.
    base_width : int
        Width of the stem and the first stage, 64 by default.
    """

    stage_blocks: tuple[int, ...]
    base_width: int = 64

    def __post_init__(self) -> None:
        """Validate the table."""
        if not self.stage_blocks or any(b < 1 for b in self.stage_blocks):
            raise ValueError(
                f"ResNetConfig.stage_blocks must be a non-empty tuple of positive "
                f"block counts, got {self.stage_blocks}."
            )
        if self.base_width < 1:
            raise ValueError(f"ResNetConfig.base_width must be >= 1, got {self.base_width}.")

    @property
    def depth(self) -> int:
        """Number of weight layers: stem, two per block, head."""
        return 2 + 2 * sum(self.stage_blocks)

    @property
    def widths(self) -> tuple[int, ...]:
        """Channel width of each stage."""
        return tuple(self.base_width * 2**i for i in range(len(self.stage_blocks)))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (post-activation).

    Parameters
    ----------
    in_channels : int
        Input channels.
    out_channels : int
        Output channels.
    stride : int
        Stride of the first convolution and of the projection shortcut.
    norm_layer : NormFactory
        Normalisation after each convolution, of the dimensionality of ``layers``.
    layers : SpatialLayers, optional
        Convolution types, 2-d by default.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        out_channels: int,
        stride: int,
        norm_layer: NormFactory,
        layers: SpatialLayers = LAYERS_2D,
    ) -> None:
        super().__init__()
        self.conv1 = layers.conv3x3(in_channels, out_channels, stride)
        self.norm1 = norm_layer(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = layers.conv3x3(out_channels, out_channels)
        self.norm2 = norm_layer(out_channels)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                layers.conv1x1(in_channels, out_channels, stride), norm_layer(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Parameters
        ----------
        x : Tensor
            Feature map of shape ``(N, in_channels, *spatial)``.

        Returns
        -------
        Tensor
            Feature map of shape ``(N, out_channels, *spatial')``.
        """
        out = self.relu1(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        result: Tensor = self.relu2(out + self.shortcut(x))
        return result


class ResNet(TesseraModel):
    """CIFAR-style ResNet with BasicBlocks.

    Parameters
    ----------
    config : ResNetConfig
        Blocks per stage and base width.
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)``, ``(C, L)`` or ``(L,)``.
    num_classes : int
        Number of classes, at least 2.
    norm_layer : NormFactory, optional
        Normalisation after each convolution, batch norm by default.
    flat_input : FlatInput, optional
        How a flat vector is read, ``"signal"`` (default) or ``"square"``.
    """

    def __init__(
        self,
        *,
        config: ResNetConfig,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory = batch_norm,
        flat_input: FlatInput = "signal",
    ) -> None:
        widths = config.widths
        super().__init__(input_shape=input_shape, feature_dim=widths[-1], num_classes=num_classes)
        self.config = config
        self.adapter = InputAdapter(input_shape=self.input_shape, flat_input=flat_input)
        layers = self.adapter.layers
        norm_layer = layers.norm(norm_layer)
        in_channels = self.adapter.output_shape[0]
        self.stem = nn.Sequential(
            layers.conv3x3(in_channels, widths[0]), norm_layer(widths[0]), nn.ReLU()
        )
        stages: list[nn.Module] = []
        in_channels = widths[0]
        for index, (blocks, width) in enumerate(zip(config.stage_blocks, widths, strict=True)):
            stage: list[nn.Module] = []
            for block in range(blocks):
                stride = 2 if index > 0 and block == 0 else 1
                stage.append(
                    BasicBlock(
                        in_channels=in_channels,
                        out_channels=width,
                        stride=stride,
                        norm_layer=norm_layer,
                        layers=layers,
                    )
                )
                in_channels = width
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.pool = layers.global_pool()
        self.head = nn.Linear(widths[-1], num_classes)
        init_conv_weights(self)

    def forward_features(self, x: Tensor) -> Tensor:
        """Map a batch to pooled representations of size ``feature_dim``.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Representations of shape ``(N, feature_dim)``.
        """
        z: Tensor = self.pool(self.stages(self.stem(self.adapter(x))))
        return z


def _build(
    depth: int,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory,
    flat_input: FlatInput,
) -> ResNet:
    return ResNet(
        config=ResNetConfig(stage_blocks=RESNET_STAGE_BLOCKS[depth]),
        input_shape=input_shape,
        num_classes=num_classes,
        norm_layer=norm_layer,
        flat_input=flat_input,
    )


@register_model("resnet10", family="resnet", size_rank=0, description="ResNet-10, blocks (1,1,1,1)")
def resnet10(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> ResNet:
    """Build the CIFAR-style ResNet-10."""
    return _build(10, input_shape, num_classes, norm_layer, flat_input)


@register_model("resnet14", family="resnet", size_rank=1, description="ResNet-14, blocks (1,1,2,2)")
def resnet14(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> ResNet:
    """Build the CIFAR-style ResNet-14."""
    return _build(14, input_shape, num_classes, norm_layer, flat_input)


@register_model("resnet18", family="resnet", size_rank=2, description="ResNet-18, blocks (2,2,2,2)")
def resnet18(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> ResNet:
    """Build the CIFAR-style ResNet-18."""
    return _build(18, input_shape, num_classes, norm_layer, flat_input)


@register_model("resnet22", family="resnet", size_rank=3, description="ResNet-22, blocks (2,2,3,3)")
def resnet22(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> ResNet:
    """Build the CIFAR-style ResNet-22."""
    return _build(22, input_shape, num_classes, norm_layer, flat_input)


@register_model("resnet26", family="resnet", size_rank=4, description="ResNet-26, blocks (3,3,3,3)")
def resnet26(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
    flat_input: FlatInput = "signal",
) -> ResNet:
    """Build the CIFAR-style ResNet-26."""
    return _build(26, input_shape, num_classes, norm_layer, flat_input)
