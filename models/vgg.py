"""The ``vgg`` family: plain VGG stacks of 3x3 convolutions with a width multiplier.

The architecture is data: a table of stages, each a tuple of 3x3 convolution widths
(:data:`VGG_STAGE_TABLES`, the tables of VGG-11, -13 and -16), a width multiplier
and channel counts rounded by :func:`models.layers.make_divisible`, all held by a
frozen :class:`VGGConfig`. Every convolution is a bias-free 3x3 convolution with
padding 1, followed by the injected norm and a ReLU; every stage ends with a 2x2
max-pool, skipped once the feature map is 1 pixel high or wide, so a 32x32 input
ends at 1x1 after five stages (32, 16, 8, 4, 2, 1) and an 8x8 input stops pooling at
1x1 (8, 4, 2, 1, 1, 1). Global average pooling then flattens the last stage's
maps into the representation (``feature_dim`` = the last stage's width).

Small-device adaptation: VGG's three fully connected layers (4096-4096-classes,
most of its parameters) are replaced by global average pooling and one linear head,
as in the CIFAR variants of VGG. The names keep the depth of the table they come from
(``vgg11`` has 8 convolutions) and the width multiplier without its point
(``vgg13_025``: x0.25, ``vgg11_0125``: x0.125).

Signals ``(C, L)`` and, by default, flat vectors ``(L,)`` give the 1-d form of the
same table (``Conv1d``, 1-d norms and pooling, built through
:class:`models.layers.SpatialLayers`); ``flat_input="square"`` reshapes a flat vector
to a one-channel square image instead, see :class:`models.inputs.InputAdapter`.

State-dict layout: convolution ``i`` of stage ``s`` under ``stages.{s}.{3 * i}.``, its
norm under ``stages.{s}.{3 * i + 1}.``, the classifier ``head``. The max-pools carry
no parameters and come last in a stage, so the keys do not depend on the input size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral
from types import MappingProxyType
from typing import Final

from torch import Tensor, nn

from models.base import ConvModel, FamilyConfig
from models.layers import SpatialLayers, make_divisible
from models.norm import NormFactory
from models.registry import register_family

__all__ = ["VGG", "VGG_STAGE_TABLES", "VGG_VARIANTS", "VGGConfig"]


VGG_STAGE_TABLES: Final[Mapping[int, tuple[tuple[int, ...], ...]]] = MappingProxyType(
    {
        11: ((64,), (128,), (256, 256), (512, 512), (512, 512)),
        13: ((64, 64), (128, 128), (256, 256), (512, 512), (512, 512)),
        16: ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512)),
    }
)
"""VGG's convolution widths per stage (configurations A, B and D), keyed by depth.

The depth counts the original's weight layers: the convolutions plus its three fully
connected layers.
"""


def _is_positive_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and int(value) >= 1


class VGG(ConvModel):
    """VGG body (conv-norm-ReLU stages, max-pools), global average pool, linear head.

    Built from a :class:`VGGConfig` (convolution widths per stage and width
    multiplier); the parameters are those of :class:`~models.base.ConvModel`.
    """

    config: VGGConfig

    def build_body(self, layers: SpatialLayers, norm_layer: NormFactory) -> None:
        """Build the stages of 3x3 convolutions and the global pool."""
        in_channels, *size = self.adapter.output_shape
        stages: list[nn.Module] = []
        for stage_widths in self.config.widths:
            stage: list[nn.Module] = []
            for out_channels in stage_widths:
                stage += [
                    layers.conv3x3(in_channels, out_channels),
                    norm_layer(out_channels),
                    nn.ReLU(),
                ]
                in_channels = out_channels
            if min(size) > 1:
                stage.append(layers.max_pool())
                size = [s // 2 for s in size]
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.pool = layers.global_pool()

    def forward_body(self, x: Tensor) -> Tensor:
        """Apply the stages and the global pool."""
        z: Tensor = self.pool(self.stages(x))
        return z


@dataclass(frozen=True)
class VGGConfig(FamilyConfig):
    """Architecture of a :class:`VGG`.

    Attributes
    ----------
    stages : tuple[tuple[int, ...], ...]
        Widths of the 3x3 convolutions of each stage at ``width_mult=1``; every stage
        has at least one convolution and ends with a 2x2 max-pool.
    width_mult : float
        Multiplier of every width, e.g. 0.25.
    round_nearest : int
        Widths are rounded to multiples of this (:func:`models.layers.make_divisible`).
    """

    model_class = VGG

    stages: tuple[tuple[int, ...], ...]
    width_mult: float = 1.0
    round_nearest: int = 8

    def __post_init__(self) -> None:
        """Validate the table."""
        if not self.stages or any(not stage for stage in self.stages):
            raise ValueError(
                f"VGGConfig.stages must be a non-empty tuple of non-empty stages (one "
                f"width per 3x3 convolution), got {self.stages}; e.g. "
                f"VGG_STAGE_TABLES[11]."
            )
        for stage in self.stages:
            if not all(_is_positive_int(w) for w in stage):
                raise ValueError(
                    f"VGGConfig.stages widths must be positive ints, got stage {stage} "
                    f"in {self.stages}."
                )
        if not self.width_mult > 0:
            raise ValueError(f"VGGConfig.width_mult must be > 0, got {self.width_mult}.")
        if not _is_positive_int(self.round_nearest):
            raise ValueError(f"VGGConfig.round_nearest must be >= 1, got {self.round_nearest}.")

    @property
    def widths(self) -> tuple[tuple[int, ...], ...]:
        """Rounded output channels of every convolution, stage by stage."""
        return tuple(
            tuple(make_divisible(w * self.width_mult, self.round_nearest) for w in stage)
            for stage in self.stages
        )

    @property
    def feature_dim(self) -> int:
        """Width of the last convolution, the size of the representation."""
        return self.widths[-1][-1]

    @property
    def num_convs(self) -> int:
        """Number of 3x3 convolutions."""
        return sum(len(stage) for stage in self.stages)


VGG_VARIANTS: Final[tuple[tuple[str, VGGConfig, str], ...]] = tuple(
    (
        name,
        VGGConfig(stages=VGG_STAGE_TABLES[depth], width_mult=width),
        f"VGG-{depth} table, width x{width}, global pool + linear head",
    )
    for name, depth, width in (
        ("vgg11_0125", 11, 0.125),
        ("vgg13_025", 13, 0.25),
        ("vgg16_025", 16, 0.25),
    )
)
"""The registered models, ``(name, config, description)`` by ascending size rank.

A name is the table's depth and the width multiplier without its point.
"""


register_family("vgg", VGG_VARIANTS)
