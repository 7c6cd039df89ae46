"""The ``preresnet`` family: pre-activation ResNets with a width multiplier.

Blocks are ordered norm-ReLU-conv (He et al., "Identity Mappings in Deep Residual
Networks"); the network ends with norm-ReLU before global average pooling, whose
output is the representation. The architecture is a frozen
:class:`PreResNetConfig`: blocks per stage, a width multiplier and the base widths,
rounded with :func:`models.layers.make_divisible`. Stem and strides are CIFAR-style
(3x3 stride-1 stem, stages at stride 1, 2, 2, 2), so 8x8 inputs work.

Signals ``(C, L)`` and, by default, flat vectors ``(L,)`` give the 1-d form of the
same table (``Conv1d``, 1-d norms and pooling, built through
:class:`models.layers.SpatialLayers`); ``flat_input="square"`` reshapes a flat vector
to a one-channel square image instead, see :class:`models.inputs.InputAdapter`.

State-dict layout: ``stem.weight``, block ``b`` of stage ``s`` under
``sections.{s}.{b}.`` (``norm1``, ``conv1``, ``norm2``, ``conv2``, ``shortcut``),
the final norm under ``final.0.``, the classifier ``head``. A config is sliceable
(:mod:`models.slicing`): :meth:`PreResNetConfig.sliced` keeps each stage's first
blocks and ``ceil(width * c)`` of every stage's ``c`` channels. Every stage after
the first starts with a stride-2 block with a projection shortcut, so slices keep at
least two blocks per stage (:attr:`PreResNetConfig.min_section_depth`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Final

from torch import Tensor, nn

from models.base import ConvModel
from models.layers import (
    LAYERS_2D,
    SpatialLayers,
    block_step,
    make_divisible,
    residual_stages,
    slice_channels,
)
from models.norm import NormFactory
from models.registry import register_family
from models.slicing import SectionedConfig

__all__ = ["PRERESNET_VARIANTS", "PreActBlock", "PreResNet", "PreResNetConfig"]


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
        Normalisation before each convolution, of the dimensionality of ``layers``.
    step : bool, optional
        Scale the residual branch by a learnable scalar ``step`` (initialised to 1).
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
        step: bool = False,
        layers: SpatialLayers = LAYERS_2D,
    ) -> None:
        super().__init__()
        self.norm1 = norm_layer(in_channels)
        self.relu1 = nn.ReLU()
        self.conv1 = layers.conv3x3(in_channels, out_channels, stride)
        self.norm2 = norm_layer(out_channels)
        self.relu2 = nn.ReLU()
        self.conv2 = layers.conv3x3(out_channels, out_channels)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = layers.conv1x1(in_channels, out_channels, stride)
        self.step = block_step() if step else None

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
        out = self.relu1(self.norm1(x))
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.relu2(self.norm2(out)))
        if self.step is not None:
            out = self.step * out
        result: Tensor = out + shortcut
        return result


class PreResNet(ConvModel):
    """Pre-activation ResNet, CIFAR-style.

    Built from a :class:`PreResNetConfig` (blocks per stage, width multiplier, base
    widths); the parameters are those of :class:`~models.base.ConvModel`.
    """

    config: PreResNetConfig

    def build_body(self, layers: SpatialLayers, norm_layer: NormFactory) -> None:
        """Build the stem, the sections of pre-activation blocks and the final norm."""
        widths = self.config.widths
        self.stem = layers.conv3x3(self.adapter.output_shape[0], widths[0])
        block = partial(
            PreActBlock, norm_layer=norm_layer, step=self.config.block_step, layers=layers
        )
        self.sections = residual_stages(self.config.stage_depths, widths, block)
        self.final = nn.Sequential(norm_layer(widths[-1]), nn.ReLU(), *layers.global_pool())

    def forward_body(self, x: Tensor) -> Tensor:
        """Apply the stem, the sections and the final norm and pool."""
        z: Tensor = self.final(self.sections(self.stem(x)))
        return z


@dataclass(frozen=True)
class PreResNetConfig(SectionedConfig):
    """Architecture of a :class:`PreResNet`.

    Attributes
    ----------
    stage_depths : tuple[int, ...]
        Number of pre-activation blocks in each stage.
    width_mult : float
        Multiplier applied to every base width, e.g. 0.5 for half width.
    base_widths : tuple[int, ...]
        Width of each stage at ``width_mult=1``, one per stage.
    slice_width : float
        For a sub-model (:meth:`sliced`), the share of the global model's channels
        kept, ``ceil(slice_width * c)`` of each stage's ``c``; 1 for a global model.
    block_step : bool
        Give every block a learnable step size ``s`` (a scalar, initialised to 1)
        that scales its residual branch, ``x + s * F(x)`` (NeFL's step-size
        parameters; state-dict key ``sections.{s}.{b}.step``). Off by default.
    """

    model_class = PreResNet

    stage_depths: tuple[int, ...]
    width_mult: float = 1.0
    base_widths: tuple[int, ...] = (64, 128, 256, 512)
    slice_width: float = 1.0
    block_step: bool = False

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
        if not 0 < self.slice_width <= 1:
            raise ValueError(
                f"PreResNetConfig.slice_width must be in (0, 1], got {self.slice_width}."
            )

    @property
    def global_widths(self) -> tuple[int, ...]:
        """Channel width of each stage of the global model: multiplier, rounded to 8."""
        return tuple(make_divisible(w * self.width_mult) for w in self.base_widths)

    @property
    def widths(self) -> tuple[int, ...]:
        """Channel width of each stage: the global widths, sliced by ``slice_width``."""
        return tuple(slice_channels(w, self.slice_width) for w in self.global_widths)

    @property
    def section_depths(self) -> tuple[int, ...]:
        """Blocks in each stage (a stage is a section)."""
        return self.stage_depths

    @property
    def min_section_depth(self) -> int:
        """Fewest blocks a slice keeps per stage: 2 when a stage starts at stride 2."""
        return 2 if len(self.stage_depths) > 1 else 1

    @property
    def stem_key(self) -> str:
        """State-dict key of the stem convolution's weight."""
        return "stem.weight"

    def with_slice(self, width: float, depths: tuple[int, ...]) -> PreResNetConfig:
        """Return the slice ``stage_depths=depths``, ``slice_width=width`` (:meth:`sliced`)."""
        return replace(self, stage_depths=depths, slice_width=width)

    @property
    def feature_dim(self) -> int:
        """Width of the last stage, the size of the representation."""
        return self.widths[-1]

    @property
    def depth(self) -> int:
        """Number of weight layers: stem, two per block, head."""
        return 2 + 2 * sum(self.stage_depths)


PRERESNET_VARIANTS: Final[tuple[tuple[str, PreResNetConfig, str], ...]] = (
    (
        "preresnet26_025",
        PreResNetConfig(stage_depths=(3, 3, 3, 3), width_mult=0.25),
        "PreAct ResNet-26, blocks (3,3,3,3), width x0.25 (16-128): the sub-model schemes' "
        "global model, sliceable in width and depth",
    ),
    (
        "preresnet10_050",
        PreResNetConfig(stage_depths=(1, 1, 1, 1), width_mult=0.5),
        "PreAct ResNet-10, blocks (1,1,1,1), width x0.5 (32-256)",
    ),
    (
        "preresnet18_050",
        PreResNetConfig(stage_depths=(2, 2, 2, 2), width_mult=0.5),
        "PreAct ResNet-18, blocks (2,2,2,2), width x0.5 (32-256)",
    ),
    (
        "preresnet10_100",
        PreResNetConfig(stage_depths=(1, 1, 1, 1), width_mult=1.0),
        "PreAct ResNet-10, blocks (1,1,1,1), width x1 (64-512)",
    ),
    (
        "preresnet18_100",
        PreResNetConfig(stage_depths=(2, 2, 2, 2), width_mult=1.0),
        "PreAct ResNet-18, blocks (2,2,2,2), width x1 (64-512)",
    ),
)
"""The registered models, ``(name, config, description)`` by ascending size rank."""


register_family("preresnet", PRERESNET_VARIANTS)
