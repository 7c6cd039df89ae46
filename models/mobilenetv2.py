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

Signals ``(C, L)`` and, by default, flat vectors ``(L,)`` give the 1-d form of the
same table (``Conv1d``, 1-d norms and pooling, built through
:class:`models.layers.SpatialLayers`); ``flat_input="square"`` reshapes a flat vector
to a one-channel square image instead, see :class:`models.inputs.InputAdapter`.

State-dict layout: the stem under ``stem.`` (``stem.0`` convolution, ``stem.1``
norm), block ``b`` of section ``s`` under ``sections.{s}.{b}.block.``, the last 1x1
convolution and its norm under ``final.0.`` and ``final.1.``, the classifier
``head``. Dropping a block leaves every other key as it is. A config is sliceable
(:mod:`models.slicing`): :meth:`MobileNetV2Config.sliced` keeps each section's
first blocks and ``ceil(width * c)`` of every channel count ``c`` of the global
model (hidden layers included); a block keeps the global block's expansion and
residual connection. A section's first block changes the channels (and often the
stride), so slices keep at least two blocks per section.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final, NamedTuple

from torch import Tensor, nn

from models.base import ConvModel
from models.layers import (
    LAYERS_2D,
    SpatialLayers,
    block_step,
    make_divisible,
    slice_channels,
)
from models.norm import NormFactory
from models.registry import register_family
from models.slicing import SectionedConfig

__all__ = [
    "CIFAR_INVERTED_RESIDUAL_SETTINGS",
    "MOBILENETV2_VARIANTS",
    "BlockPlan",
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


class BlockPlan(NamedTuple):
    """Channels and structure of one inverted-residual block, resolved from a config.

    Attributes
    ----------
    in_channels : int
        Input channels.
    hidden_channels : int
        Channels of the expanded (depthwise) layer; ``in_channels`` without expansion.
    out_channels : int
        Output channels.
    stride : int
        Stride of the depthwise convolution.
    expand : bool
        Whether the block starts with a 1x1 expansion (expansion ratio other than 1).
    residual : bool
        Whether the input is added to the output (the global block's shapes agree).
    """

    in_channels: int
    hidden_channels: int
    out_channels: int
    stride: int
    expand: bool
    residual: bool


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), project (1x1, linear), residual when possible.

    Parameters
    ----------
    plan : BlockPlan
        Channels, stride, expansion and residual connection of the block.
    norm_layer : NormFactory
        Normalisation after each convolution.
    step : bool, optional
        With a residual connection, scale the branch by a learnable scalar ``step``
        (initialised to 1).
    spatial : SpatialLayers, optional
        Convolution types, 2-d by default; ``norm_layer`` must match them.
    """

    def __init__(
        self,
        *,
        plan: BlockPlan,
        norm_layer: NormFactory,
        step: bool = False,
        spatial: SpatialLayers = LAYERS_2D,
    ) -> None:
        super().__init__()
        hidden = plan.hidden_channels
        self.use_residual = plan.residual
        layers: list[nn.Module] = []
        if plan.expand:
            layers += [spatial.conv1x1(plan.in_channels, hidden), norm_layer(hidden), nn.ReLU6()]
        layers += [
            spatial.conv3x3(hidden, hidden, plan.stride, groups=hidden),
            norm_layer(hidden),
            nn.ReLU6(),
            spatial.conv1x1(hidden, plan.out_channels),
            norm_layer(plan.out_channels),
        ]
        self.block = nn.Sequential(*layers)
        self.step = block_step() if step and plan.residual else None

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
        out: Tensor = self.block(x)
        if self.step is not None:
            out = self.step * out
        return x + out if self.use_residual else out


class MobileNetV2(ConvModel):
    """MobileNetV2 built from a :class:`MobileNetV2Config`.

    The config holds the width multiplier, section depths and inverted-residual
    table; the parameters are those of :class:`~models.base.ConvModel`.
    """

    config: MobileNetV2Config

    def build_body(self, layers: SpatialLayers, norm_layer: NormFactory) -> None:
        """Build the stem, the sections of inverted residuals and the last 1x1 conv."""
        config = self.config
        stem = config.stem_width
        self.stem = nn.Sequential(
            layers.conv3x3(self.adapter.output_shape[0], stem, config.stem_stride),
            norm_layer(stem),
            nn.ReLU6(),
        )
        plans = config.block_plans()
        self.sections = nn.Sequential(
            *(
                nn.Sequential(
                    *(
                        InvertedResidual(
                            plan=plan,
                            norm_layer=norm_layer,
                            step=config.block_step,
                            spatial=layers,
                        )
                        for plan in section
                    )
                )
                for section in plans
            )
        )
        last = plans[-1][-1].out_channels
        self.final = nn.Sequential(
            layers.conv1x1(last, config.feature_dim),
            norm_layer(config.feature_dim),
            nn.ReLU6(),
            *layers.global_pool(),
        )

    def forward_body(self, x: Tensor) -> Tensor:
        """Apply the stem, the sections and the last convolution and pool."""
        z: Tensor = self.final(self.sections(self.stem(x)))
        return z


@dataclass(frozen=True)
class MobileNetV2Config(SectionedConfig):
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
    slice_width : float
        For a sub-model (:meth:`sliced`), the share of the global model's channels
        kept: ``ceil(slice_width * c)`` of every channel count ``c``, with no
        rounding to ``round_nearest``; 1 for a global model.
    block_step : bool
        Give every block with a residual connection a learnable step size ``s``
        (a scalar, initialised to 1): ``x + s * F(x)`` (NeFL's step-size parameters;
        state-dict key ``sections.{s}.{b}.step``). Off by default.
    """

    model_class = MobileNetV2

    width_mult: float = 1.0
    depths: tuple[int, ...] | None = None
    settings: tuple[InvertedResidualSetting, ...] = CIFAR_INVERTED_RESIDUAL_SETTINGS
    stem_channels: int = 32
    last_channels: int = 1280
    stem_stride: int = 1
    round_nearest: int = 8
    slice_width: float = 1.0
    block_step: bool = False

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
        if not 0 < self.slice_width <= 1:
            raise ValueError(
                f"MobileNetV2Config.slice_width must be in (0, 1], got {self.slice_width}."
            )

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
    def global_feature_dim(self) -> int:
        """Channels of the global model's last convolution."""
        return make_divisible(self.last_channels * max(1.0, self.width_mult), self.round_nearest)

    @property
    def feature_dim(self) -> int:
        """Channels of the last convolution, the size of the representation."""
        return slice_channels(self.global_feature_dim, self.slice_width)

    @property
    def stem_width(self) -> int:
        """Output channels of the stem convolution."""
        return slice_channels(self.channels(self.stem_channels), self.slice_width)

    def block_plans(self) -> tuple[tuple[BlockPlan, ...], ...]:
        """Return every block's channels and structure, section by section.

        Channels are the global model's (multiplier, rounding), then sliced by
        ``slice_width``; stride, expansion and the residual connection are the
        global block's.

        Returns
        -------
        tuple[tuple[BlockPlan, ...], ...]
            One tuple of :class:`BlockPlan` per section, ``section_depths[s]`` long.
        """
        width = self.slice_width
        global_in = self.channels(self.stem_channels)
        plans = []
        for setting, depth in zip(self.settings, self.section_depths, strict=True):
            global_out = self.channels(setting.channels)
            section = []
            for block in range(depth):
                stride = setting.stride if block == 0 else 1
                section.append(
                    BlockPlan(
                        in_channels=slice_channels(global_in, width),
                        hidden_channels=slice_channels(global_in * setting.expand_ratio, width),
                        out_channels=slice_channels(global_out, width),
                        stride=stride,
                        expand=setting.expand_ratio != 1,
                        residual=stride == 1 and global_in == global_out,
                    )
                )
                global_in = global_out
            plans.append(tuple(section))
        return tuple(plans)

    @property
    def min_section_depth(self) -> int:
        """Fewest blocks a slice keeps per section: 2 when a section's first block differs.

        A first block differs from the others when it changes the channels or the
        stride (true of every section of the CIFAR table).
        """
        global_in = self.channels(self.stem_channels)
        for setting in self.settings:
            global_out = self.channels(setting.channels)
            if setting.stride != 1 or global_in != global_out:
                return 2
            global_in = global_out
        return 1

    @property
    def stem_key(self) -> str:
        """State-dict key of the stem convolution's weight."""
        return "stem.0.weight"

    def with_slice(self, width: float, depths: tuple[int, ...]) -> MobileNetV2Config:
        """Return the slice ``depths=depths``, ``slice_width=width`` (:meth:`sliced`)."""
        return replace(self, depths=depths, slice_width=width)


MOBILENETV2_VARIANTS: Final[tuple[tuple[str, MobileNetV2Config, str], ...]] = tuple(
    (
        f"mobilenetv2_{round(100 * width):03d}",
        MobileNetV2Config(width_mult=width),
        f"width x{width}",
    )
    for width in (0.35, 0.5, 0.75, 1.0)
)
"""The registered models, ``(name, config, description)`` by ascending size rank."""


register_family("mobilenetv2", MOBILENETV2_VARIANTS)
