"""The ``resnet`` family: CIFAR-style ResNets of depth 10 to 26 (Felo/Velo sizes).

A 3x3 stride-1 stem (no max-pool), four stages of BasicBlocks of widths
``base_width * (1, 2, 4, 8)`` (64-128-256-512 by default), the first stage at
stride 1 and the others at stride 2, then global average pooling. The pooled
``8 * base_width`` vector (512-d by default) is the representation. A stride-2 3x3
convolution with padding maps a 1x1 map to 1x1, so 8x8 inputs (8, 4, 2, 1) work.

Depth counts the stem, two convolutions per block and the head:
``depth = 2 + 2 * sum(stage_blocks)``; the blocks per stage of each registered depth
are the data in :data:`RESNET_STAGE_BLOCKS`, the registered models
:data:`RESNET_VARIANTS`.

Signals ``(C, L)`` and, by default, flat vectors ``(L,)`` give the 1-d form of the
same table (``Conv1d``, 1-d norms and pooling, built through
:class:`models.layers.SpatialLayers`); ``flat_input="square"`` reshapes a flat vector
to a one-channel square image instead, see :class:`models.inputs.InputAdapter`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Final

from torch import Tensor, nn

from models.base import ConvModel, FamilyConfig
from models.layers import LAYERS_2D, SpatialLayers, residual_stages
from models.norm import NormFactory
from models.registry import register_family

__all__ = ["RESNET_STAGE_BLOCKS", "RESNET_VARIANTS", "BasicBlock", "ResNet", "ResNetConfig"]


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


class ResNet(ConvModel):
    """CIFAR-style ResNet with BasicBlocks.

    Built from a :class:`ResNetConfig` (blocks per stage and base width); the
    parameters are those of :class:`~models.base.ConvModel`.
    """

    config: ResNetConfig

    def build_body(self, layers: SpatialLayers, norm_layer: NormFactory) -> None:
        """Build the stem, the stages of BasicBlocks and the global pool."""
        widths = self.config.widths
        self.stem = nn.Sequential(
            layers.conv3x3(self.adapter.output_shape[0], widths[0]),
            norm_layer(widths[0]),
            nn.ReLU(),
        )
        block = partial(BasicBlock, norm_layer=norm_layer, layers=layers)
        self.stages = residual_stages(self.config.stage_blocks, widths, block)
        self.pool = layers.global_pool()

    def forward_body(self, x: Tensor) -> Tensor:
        """Apply the stem, the stages and the global pool."""
        z: Tensor = self.pool(self.stages(self.stem(x)))
        return z


@dataclass(frozen=True)
class ResNetConfig(FamilyConfig):
    """Architecture of a :class:`ResNet`.

    Attributes
    ----------
    stage_blocks : tuple[int, ...]
        Number of BasicBlocks in each stage; stage ``i`` has width
        ``base_width * 2**i``.
    base_width : int
        Width of the stem and the first stage, 64 by default.
    """

    model_class = ResNet

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

    @property
    def feature_dim(self) -> int:
        """Width of the last stage, the size of the representation."""
        return self.widths[-1]


RESNET_VARIANTS: Final[tuple[tuple[str, ResNetConfig, str], ...]] = tuple(
    (
        f"resnet{depth}",
        ResNetConfig(stage_blocks=blocks),
        f"ResNet-{depth}, blocks ({','.join(map(str, blocks))})",
    )
    for depth, blocks in RESNET_STAGE_BLOCKS.items()
)
"""The registered models, ``(name, config, description)`` by ascending size rank."""


register_family("resnet", RESNET_VARIANTS)
