"""The ``preresnet`` family: pre-activation ResNets with a width multiplier.

Blocks are ordered norm-ReLU-conv (He et al., "Identity Mappings in Deep Residual
Networks"); the network ends with norm-ReLU before global average pooling, whose
output is the representation. The architecture is a frozen
:class:`PreResNetConfig`: blocks per stage, a width multiplier and the base widths,
rounded with :func:`models.layers.make_divisible`. Stem and strides are CIFAR-style
(3x3 stride-1 stem, stages at stride 1, 2, 2, 2), so 8x8 inputs work.

Flat inputs ``(D,)`` are zero-padded and reshaped to a one-channel square image, see
:class:`models.base.ImageAdapter`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from models.base import ImageAdapter, TesseraModel
from models.layers import conv1x1, conv3x3, init_conv_weights, make_divisible
from models.norm import NormFactory, batch_norm
from models.registry import register_model

__all__ = ["PreActBlock", "PreResNet", "PreResNetConfig"]


@dataclass(frozen=True)
class PreResNetConfig:
    """Architecture of a :class:`PreResNet`.

    Attributes
    ----------
    stage_depths : tuple[int, ...]
        Number of pre-activation blocks in each stage.
    width_mult : float
        Multiplier applied to every base width, e.g. 0.5 for half width.
    base_widths : tuple[int, ...]
        Width of each stage at ``width_mult=1``, one per stage.
    """

    stage_depths: tuple[int, ...]
    width_mult: float = 1.0
    base_widths: tuple[int, ...] = (64, 128, 256, 512)

    def __post_init__(self) -> None:
        """Validate the table."""
        if not self.stage_depths or any(d < 1 for d in self.stage_depths):
            raise ValueError(
                f"PreResNetConfig.stage_depths must be a non-empty tuple of positive "
                f"block counts, got {self.stage_depths}."
            )
        if len(self.base_widths) != len(self.stage_depths):
            raise ValueError(
                f"PreResNetConfig.base_widths needs one width per stage: got "
                f"{len(self.base_widths)} widths {self.base_widths} for "
                f"{len(self.stage_depths)} stages {self.stage_depths}."
            )
        if any(w < 1 for w in self.base_widths):
            raise ValueError(
                f"PreResNetConfig.base_widths must be positive, got {self.base_widths}."
            )
        if not self.width_mult > 0:
            raise ValueError(f"PreResNetConfig.width_mult must be > 0, got {self.width_mult}.")

    @property
    def widths(self) -> tuple[int, ...]:
        """Channel width of each stage after the multiplier and rounding to 8."""
        return tuple(make_divisible(w * self.width_mult) for w in self.base_widths)

    @property
    def depth(self) -> int:
        """Number of weight layers: stem, two per block, head."""
        return 2 + 2 * sum(self.stage_depths)


class PreActBlock(nn.Module):
    """Pre-activation BasicBlock: (norm, ReLU, conv) twice plus a shortcut.

    A projection shortcut, when the shape changes, is applied to the pre-activated
    input, as in the original pre-activation ResNet.

    Parameters
    ----------
    in_channels : int
        Input channels.
    out_channels : int
        Output channels.
    stride : int
        Stride of the first convolution and of the projection shortcut.
    norm_layer : NormFactory
        Normalisation before each convolution.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        out_channels: int,
        stride: int,
        norm_layer: NormFactory,
    ) -> None:
        super().__init__()
        self.norm1 = norm_layer(in_channels)
        self.relu1 = nn.ReLU()
        self.conv1 = conv3x3(in_channels, out_channels, stride)
        self.norm2 = norm_layer(out_channels)
        self.relu2 = nn.ReLU()
        self.conv2 = conv3x3(out_channels, out_channels)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = conv1x1(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Parameters
        ----------
        x : Tensor
            Feature map of shape ``(N, in_channels, H, W)``.

        Returns
        -------
        Tensor
            Feature map of shape ``(N, out_channels, H', W')``.
        """
        out = self.relu1(self.norm1(x))
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.relu2(self.norm2(out)))
        result: Tensor = out + shortcut
        return result


class PreResNet(TesseraModel):
    """Pre-activation ResNet, CIFAR-style.

    Parameters
    ----------
    config : PreResNetConfig
        Blocks per stage, width multiplier and base widths.
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)`` or ``(D,)``.
    num_classes : int
        Number of classes, at least 2.
    norm_layer : NormFactory, optional
        Normalisation before each convolution, batch norm by default.
    """

    def __init__(
        self,
        *,
        config: PreResNetConfig,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory = batch_norm,
    ) -> None:
        widths = config.widths
        super().__init__(input_shape=input_shape, feature_dim=widths[-1], num_classes=num_classes)
        self.config = config
        self.adapter = ImageAdapter(input_shape=self.input_shape)
        self.stem = conv3x3(self.adapter.output_shape[0], widths[0])
        stages: list[nn.Module] = []
        in_channels = widths[0]
        for index, (blocks, width) in enumerate(zip(config.stage_depths, widths, strict=True)):
            stage: list[nn.Module] = []
            for block in range(blocks):
                stride = 2 if index > 0 and block == 0 else 1
                stage.append(
                    PreActBlock(
                        in_channels=in_channels,
                        out_channels=width,
                        stride=stride,
                        norm_layer=norm_layer,
                    )
                )
                in_channels = width
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.final = nn.Sequential(
            norm_layer(widths[-1]), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
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
        z: Tensor = self.final(self.stages(self.stem(self.adapter(x))))
        return z


def _build(
    config: PreResNetConfig,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory,
) -> PreResNet:
    return PreResNet(
        config=config,
        input_shape=input_shape,
        num_classes=num_classes,
        norm_layer=norm_layer,
    )


@register_model(
    "preresnet10_050",
    family="preresnet",
    size_rank=0,
    description="PreAct ResNet-10, blocks (1,1,1,1), width x0.5 (32-256)",
)
def preresnet10_050(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
) -> PreResNet:
    """Build the pre-activation ResNet-10 at half width."""
    config = PreResNetConfig(stage_depths=(1, 1, 1, 1), width_mult=0.5)
    return _build(config, input_shape, num_classes, norm_layer)


@register_model(
    "preresnet18_050",
    family="preresnet",
    size_rank=1,
    description="PreAct ResNet-18, blocks (2,2,2,2), width x0.5 (32-256)",
)
def preresnet18_050(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
) -> PreResNet:
    """Build the pre-activation ResNet-18 at half width."""
    config = PreResNetConfig(stage_depths=(2, 2, 2, 2), width_mult=0.5)
    return _build(config, input_shape, num_classes, norm_layer)


@register_model(
    "preresnet10_100",
    family="preresnet",
    size_rank=2,
    description="PreAct ResNet-10, blocks (1,1,1,1), width x1 (64-512)",
)
def preresnet10_100(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
) -> PreResNet:
    """Build the pre-activation ResNet-10 at full width."""
    config = PreResNetConfig(stage_depths=(1, 1, 1, 1), width_mult=1.0)
    return _build(config, input_shape, num_classes, norm_layer)


@register_model(
    "preresnet18_100",
    family="preresnet",
    size_rank=3,
    description="PreAct ResNet-18, blocks (2,2,2,2), width x1 (64-512)",
)
def preresnet18_100(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
) -> PreResNet:
    """Build the pre-activation ResNet-18 at full width."""
    config = PreResNetConfig(stage_depths=(2, 2, 2, 2), width_mult=1.0)
    return _build(config, input_shape, num_classes, norm_layer)
