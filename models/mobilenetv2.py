"""The ``mobilenetv2`` family: MobileNetV2 with a width multiplier, CIFAR-style.

As in torchvision, the architecture is data: a table of inverted-residual settings
``(t, c, n, s)`` (expansion ratio, output channels, blocks, stride of the first
block), a width multiplier and channel counts rounded by
:func:`models.layers.make_divisible`, all held by a frozen :class:`MobileNetV2Config`.
Per-section block counts can override the table's ``n`` (``depths``).

CIFAR adaptation (:data:`CIFAR_INVERTED_RESIDUAL_SETTINGS`): the stem and the second
section run at stride 1 instead of 2, so a 32x32 input ends at 4x4 and an 8x8 input
at 1x1 (8, 8, 8, 4, 2, 2, 1). A stride-2 3x3 convolution with padding maps 1x1 to
1x1, so spatial size never reaches 0. The classifier dropout of torchvision is left
out so that ``forward`` is deterministic. The representation is the pooled output of
the last 1x1 convolution (1280-d for ``width_mult <= 1``).

Flat inputs ``(D,)`` are zero-padded and reshaped to a one-channel square image, see
:class:`models.base.ImageAdapter`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from torch import Tensor, nn

from models.base import ImageAdapter, TesseraModel
from models.layers import conv1x1, conv3x3, init_conv_weights, make_divisible
from models.norm import NormFactory, batch_norm
from models.registry import register_model

__all__ = [
    "CIFAR_INVERTED_RESIDUAL_SETTINGS",
    "InvertedResidual",
    "InvertedResidualSetting",
    "MobileNetV2",
    "MobileNetV2Config",
]


class InvertedResidualSetting(NamedTuple):
    """One section of MobileNetV2: ``(t, c, n, s)``.

    Attributes
    ----------
    expand_ratio : int
        Expansion factor ``t`` of the hidden layer.
    channels : int
        Output channels ``c`` before the width multiplier.
    num_blocks : int
        Number of blocks ``n``.
    stride : int
        Stride ``s`` of the first block.
    """

    expand_ratio: int
    channels: int
    num_blocks: int
    stride: int


CIFAR_INVERTED_RESIDUAL_SETTINGS: Final[tuple[InvertedResidualSetting, ...]] = (
    InvertedResidualSetting(1, 16, 1, 1),
    InvertedResidualSetting(6, 24, 2, 1),  # stride 2 in the ImageNet model
    InvertedResidualSetting(6, 32, 3, 2),
    InvertedResidualSetting(6, 64, 4, 2),
    InvertedResidualSetting(6, 96, 3, 1),
    InvertedResidualSetting(6, 160, 3, 2),
    InvertedResidualSetting(6, 320, 1, 1),
)
"""MobileNetV2's table with CIFAR strides."""


@dataclass(frozen=True)
class MobileNetV2Config:
    """Architecture of a :class:`MobileNetV2`.

    Attributes
    ----------
    width_mult : float
        Multiplier of every channel count, e.g. 0.35.
    depths : tuple[int, ...] or None
        Blocks per section, overriding the table's ``n``; None keeps the table's.
    settings : tuple[InvertedResidualSetting, ...]
        The inverted-residual table.
    stem_channels : int
        Channels of the stem convolution before the width multiplier.
    last_channels : int
        Channels of the final 1x1 convolution; scaled only when ``width_mult > 1``.
    stem_stride : int
        Stride of the stem, 1 for CIFAR-style inputs.
    round_nearest : int
        Channel counts are rounded to multiples of this.
    """

    width_mult: float = 1.0
    depths: tuple[int, ...] | None = None
    settings: tuple[InvertedResidualSetting, ...] = CIFAR_INVERTED_RESIDUAL_SETTINGS
    stem_channels: int = 32
    last_channels: int = 1280
    stem_stride: int = 1
    round_nearest: int = 8

    def __post_init__(self) -> None:
        """Validate the table."""
        if not self.width_mult > 0:
            raise ValueError(f"MobileNetV2Config.width_mult must be > 0, got {self.width_mult}.")
        if not self.settings:
            raise ValueError("MobileNetV2Config.settings must list at least one section.")
        for setting in self.settings:
            if min(setting) < 1:
                raise ValueError(f"Every (t, c, n, s) entry must be positive, got {setting}.")
        if self.depths is not None and (
            len(self.depths) != len(self.settings) or min(self.depths) < 1
        ):
            raise ValueError(
                f"MobileNetV2Config.depths must give a positive block count for each "
                f"of the {len(self.settings)} sections, got {self.depths}; use None "
                f"to keep the table's counts."
            )
        for field in ("stem_channels", "last_channels", "stem_stride", "round_nearest"):
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"MobileNetV2Config.{field} must be >= 1, got {value}.")

    @property
    def section_depths(self) -> tuple[int, ...]:
        """Number of blocks in each section."""
        if self.depths is not None:
            return self.depths
        return tuple(s.num_blocks for s in self.settings)

    def channels(self, base: float) -> int:
        """Apply the width multiplier to ``base`` channels and round.

        Parameters
        ----------
        base : float
            Channel count at ``width_mult=1``.

        Returns
        -------
        int
            Rounded channel count.
        """
        return make_divisible(base * self.width_mult, self.round_nearest)

    @property
    def feature_dim(self) -> int:
        """Channels of the last convolution, the size of the representation."""
        return make_divisible(self.last_channels * max(1.0, self.width_mult), self.round_nearest)


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), project (1x1, linear), residual when possible.

    Parameters
    ----------
    in_channels : int
        Input channels.
    out_channels : int
        Output channels.
    stride : int
        Stride of the depthwise convolution.
    expand_ratio : int
        Hidden channels are ``in_channels * expand_ratio``; 1 skips the expansion.
    norm_layer : NormFactory
        Normalisation after each convolution.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        out_channels: int,
        stride: int,
        expand_ratio: int,
        norm_layer: NormFactory,
    ) -> None:
        super().__init__()
        hidden = in_channels * expand_ratio
        self.use_residual = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers += [conv1x1(in_channels, hidden), norm_layer(hidden), nn.ReLU6()]
        layers += [
            conv3x3(hidden, hidden, stride, groups=hidden),
            norm_layer(hidden),
            nn.ReLU6(),
            conv1x1(hidden, out_channels),
            norm_layer(out_channels),
        ]
        self.block = nn.Sequential(*layers)

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
        out: Tensor = self.block(x)
        return x + out if self.use_residual else out


class MobileNetV2(TesseraModel):
    """MobileNetV2 built from a :class:`MobileNetV2Config`.

    Parameters
    ----------
    config : MobileNetV2Config
        Width multiplier, section depths and inverted-residual table.
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)`` or ``(D,)``.
    num_classes : int
        Number of classes, at least 2.
    norm_layer : NormFactory, optional
        Normalisation after each convolution, batch norm by default.
    """

    def __init__(
        self,
        *,
        config: MobileNetV2Config,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory = batch_norm,
    ) -> None:
        super().__init__(
            input_shape=input_shape,
            feature_dim=config.feature_dim,
            num_classes=num_classes,
        )
        self.config = config
        self.adapter = ImageAdapter(input_shape=self.input_shape)
        in_channels = config.channels(config.stem_channels)
        layers: list[nn.Module] = [
            conv3x3(self.adapter.output_shape[0], in_channels, config.stem_stride),
            norm_layer(in_channels),
            nn.ReLU6(),
        ]
        for setting, depth in zip(config.settings, config.section_depths, strict=True):
            out_channels = config.channels(setting.channels)
            for block in range(depth):
                layers.append(
                    InvertedResidual(
                        in_channels=in_channels,
                        out_channels=out_channels,
                        stride=setting.stride if block == 0 else 1,
                        expand_ratio=setting.expand_ratio,
                        norm_layer=norm_layer,
                    )
                )
                in_channels = out_channels
        layers += [
            conv1x1(in_channels, config.feature_dim),
            norm_layer(config.feature_dim),
            nn.ReLU6(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        ]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(config.feature_dim, num_classes)
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
        z: Tensor = self.features(self.adapter(x))
        return z


def _build(
    width_mult: float,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory,
) -> MobileNetV2:
    return MobileNetV2(
        config=MobileNetV2Config(width_mult=width_mult),
        input_shape=input_shape,
        num_classes=num_classes,
        norm_layer=norm_layer,
    )


@register_model("mobilenetv2_035", family="mobilenetv2", size_rank=0, description="width x0.35")
def mobilenetv2_035(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
) -> MobileNetV2:
    """Build MobileNetV2 at width 0.35."""
    return _build(0.35, input_shape, num_classes, norm_layer)


@register_model("mobilenetv2_050", family="mobilenetv2", size_rank=1, description="width x0.5")
def mobilenetv2_050(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
) -> MobileNetV2:
    """Build MobileNetV2 at width 0.5."""
    return _build(0.5, input_shape, num_classes, norm_layer)


@register_model("mobilenetv2_075", family="mobilenetv2", size_rank=2, description="width x0.75")
def mobilenetv2_075(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
) -> MobileNetV2:
    """Build MobileNetV2 at width 0.75."""
    return _build(0.75, input_shape, num_classes, norm_layer)


@register_model("mobilenetv2_100", family="mobilenetv2", size_rank=3, description="width x1.0")
def mobilenetv2_100(
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm_layer: NormFactory = batch_norm,
) -> MobileNetV2:
    """Build MobileNetV2 at width 1.0."""
    return _build(1.0, input_shape, num_classes, norm_layer)
