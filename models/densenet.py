"""The ``densenet`` family: CIFAR-style DenseNet-BC (Huang et al.) for small devices.

The architecture is data, a frozen :class:`DenseNetConfig`: the growth rate ``k``,
the number of dense layers per dense block, the bottleneck size (a dense layer's 1x1
convolution outputs ``bn_size * k`` channels), the compression of the transitions and
the stem's width.

* Stem: one bias-free 3x3 convolution at stride 1 (CIFAR-style, no max-pool); the
  first dense layer normalises its output.
* Dense layer: norm-ReLU-conv1x1 (``bn_size * k``)-norm-ReLU-conv3x3 (``k``), whose
  ``k`` new maps are concatenated to its input, so block ``b`` ends with
  ``c_b + layers_b * k`` channels.
* Transition between blocks: norm-ReLU-conv1x1 to ``max(1, floor(compression * c))``
  channels, then a 2x2 average pool, skipped once the map is 1 pixel high or wide:
  with three blocks a 32x32 input ends at 8x8 and an 8x8 input at 2x2.
* End: norm-ReLU and global average pooling; the pooled vector (the last block's
  channels) is the representation, a linear ``head`` the classifier.

Depth counts the weight layers: ``2 + 2 * sum(block_config) + len(block_config) - 1``
(stem, two convolutions per dense layer, one per transition, head), so the registered
``densenet40_k12`` is DenseNet-BC with L=40, k=12.

Signals ``(C, L)`` and, by default, flat vectors ``(L,)`` give the 1-d form of the
same table (``Conv1d``, 1-d norms and pooling, built through
:class:`models.layers.SpatialLayers`); ``flat_input="square"`` reshapes a flat vector
to a one-channel square image instead, see :class:`models.inputs.InputAdapter`.

State-dict layout: ``stem.weight``, dense layer ``l`` of block ``b`` under
``blocks.{b}.{l}.`` (``norm1``, ``conv1``, ``norm2``, ``conv2``), transition ``b``
(after block ``b``) under ``transitions.{b}.`` (``0`` norm, ``2`` convolution), the
final norm under ``final.0.``, the classifier ``head``. Pools carry no parameters and
come last in a transition, so the keys do not depend on the input size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from typing import Final

import torch
from torch import Tensor, nn

from models.base import ConvModel, FamilyConfig
from models.layers import LAYERS_2D, SpatialLayers
from models.norm import NormFactory
from models.registry import register_family

__all__ = ["DENSENET_VARIANTS", "DenseLayer", "DenseNet", "DenseNetConfig"]


def _is_positive_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and int(value) >= 1


class DenseLayer(nn.Module):
    """Bottleneck dense layer: norm-ReLU-conv1x1-norm-ReLU-conv3x3, then concatenation.

    Parameters
    ----------
    in_channels : int
        Input channels.
    growth_rate : int
        New channels appended to the input.
    bottleneck_channels : int
        Output channels of the 1x1 convolution.
    norm_layer : NormFactory
        Normalisation before each convolution, of the dimensionality of ``layers``.
    layers : SpatialLayers, optional
        Convolution types, 2-d by default.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        growth_rate: int,
        bottleneck_channels: int,
        norm_layer: NormFactory,
        layers: SpatialLayers = LAYERS_2D,
    ) -> None:
        super().__init__()
        self.norm1 = norm_layer(in_channels)
        self.relu1 = nn.ReLU()
        self.conv1 = layers.conv1x1(in_channels, bottleneck_channels)
        self.norm2 = norm_layer(bottleneck_channels)
        self.relu2 = nn.ReLU()
        self.conv2 = layers.conv3x3(bottleneck_channels, growth_rate)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the layer and concatenate its new maps to its input.

        Parameters
        ----------
        x : Tensor
            Feature map of shape ``(N, in_channels, *spatial)``.

        Returns
        -------
        Tensor
            Feature map of shape ``(N, in_channels + growth_rate, *spatial)``.
        """
        out = self.conv1(self.relu1(self.norm1(x)))
        new = self.conv2(self.relu2(self.norm2(out)))
        return torch.cat([x, new], dim=1)


class DenseNet(ConvModel):
    """CIFAR-style DenseNet-BC built from a :class:`DenseNetConfig`.

    The config holds the growth rate, layers per block, bottleneck size, compression
    and stem width; the parameters are those of :class:`~models.base.ConvModel`.
    """

    config: DenseNetConfig

    def build_body(self, layers: SpatialLayers, norm_layer: NormFactory) -> None:
        """Build the stem, the dense blocks, the transitions and the final norm."""
        config = self.config
        in_channels, *size = self.adapter.output_shape
        self.stem = layers.conv3x3(in_channels, config.init_features)
        plan = config.block_channels()
        blocks: list[nn.Module] = []
        transitions: list[nn.Module] = []
        for index, (depth, (block_in, block_out)) in enumerate(
            zip(config.block_config, plan, strict=True)
        ):
            blocks.append(
                nn.Sequential(
                    *(
                        DenseLayer(
                            in_channels=block_in + layer * config.growth_rate,
                            growth_rate=config.growth_rate,
                            bottleneck_channels=config.bottleneck_channels,
                            norm_layer=norm_layer,
                            layers=layers,
                        )
                        for layer in range(depth)
                    )
                )
            )
            if index < len(plan) - 1:
                next_in = plan[index + 1][0]
                transition: list[nn.Module] = [
                    norm_layer(block_out),
                    nn.ReLU(),
                    layers.conv1x1(block_out, next_in),
                ]
                if min(size) > 1:
                    transition.append(layers.avg_pool())
                    size = [s // 2 for s in size]
                transitions.append(nn.Sequential(*transition))
        self.blocks = nn.ModuleList(blocks)
        self.transitions = nn.ModuleList(transitions)
        self.final = nn.Sequential(
            norm_layer(config.feature_dim),
            nn.ReLU(),
            *layers.global_pool(),
        )

    def forward_body(self, x: Tensor) -> Tensor:
        """Apply the stem, each dense block and its transition, then the final norm."""
        out: Tensor = self.stem(x)
        for index, block in enumerate(self.blocks):
            out = block(out)
            if index < len(self.transitions):
                out = self.transitions[index](out)
        z: Tensor = self.final(out)
        return z


@dataclass(frozen=True)
class DenseNetConfig(FamilyConfig):
    """Architecture of a :class:`DenseNet`.

    Attributes
    ----------
    block_config : tuple[int, ...]
        Number of dense layers in each dense block; a transition follows every block
        but the last.
    growth_rate : int
        Channels ``k`` each dense layer adds.
    bn_size : int
        Bottleneck factor: a dense layer's 1x1 convolution outputs ``bn_size * k``
        channels.
    compression : float
        Share of the channels a transition keeps, in ``(0, 1]``
        (``floor(compression * c)``, at least 1); 0.5 in DenseNet-BC.
    init_features : int
        Output channels of the stem convolution, ``2 * k`` in DenseNet-BC.
    """

    model_class = DenseNet

    block_config: tuple[int, ...] = (6, 6, 6)
    growth_rate: int = 12
    bn_size: int = 4
    compression: float = 0.5
    init_features: int = 24

    def __post_init__(self) -> None:
        """Validate the table."""
        if not self.block_config or not all(_is_positive_int(n) for n in self.block_config):
            raise ValueError(
                f"DenseNetConfig.block_config must be a non-empty tuple of positive "
                f"layer counts (one per dense block), got {self.block_config}; e.g. "
                f"(6, 6, 6)."
            )
        for field in ("growth_rate", "bn_size", "init_features"):
            value = getattr(self, field)
            if not _is_positive_int(value):
                raise ValueError(f"DenseNetConfig.{field} must be an int >= 1, got {value!r}.")
        if not 0 < self.compression <= 1:
            raise ValueError(
                f"DenseNetConfig.compression must be in (0, 1] (the share of channels a "
                f"transition keeps), got {self.compression}."
            )

    @property
    def depth(self) -> int:
        """Weight layers: stem, two per dense layer, one per transition, head."""
        return 2 + 2 * sum(self.block_config) + len(self.block_config) - 1

    @property
    def bottleneck_channels(self) -> int:
        """Output channels of a dense layer's 1x1 convolution."""
        return self.bn_size * self.growth_rate

    def block_channels(self) -> tuple[tuple[int, int], ...]:
        """Return the input and output channels of every dense block.

        Returns
        -------
        tuple[tuple[int, int], ...]
            ``(in_channels, out_channels)`` per block; a transition maps a block's
            ``out_channels`` to the next block's ``in_channels``.
        """
        channels = self.init_features
        plan = []
        for index, layers in enumerate(self.block_config):
            out = channels + layers * self.growth_rate
            plan.append((channels, out))
            if index < len(self.block_config) - 1:
                channels = max(1, math.floor(self.compression * out))
        return tuple(plan)

    @property
    def feature_dim(self) -> int:
        """Channels of the last dense block, the size of the representation."""
        return self.block_channels()[-1][1]


DENSENET_VARIANTS: Final[tuple[tuple[str, DenseNetConfig, str], ...]] = tuple(
    (
        f"densenet{config.depth}_k{config.growth_rate}",
        config,
        f"DenseNet-BC, k={config.growth_rate}, layers per block {config.block_config}",
    )
    for config in (
        DenseNetConfig(block_config=(6, 6, 6), growth_rate=12),
        DenseNetConfig(block_config=(12, 12, 12), growth_rate=12),
    )
)
"""The registered models, ``(name, config, description)`` by ascending size rank."""


register_family("densenet", DENSENET_VARIANTS)
