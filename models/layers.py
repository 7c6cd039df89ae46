"""Small building blocks shared by the model families."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn

from models.norm import NormFactory, norm_for_ndim
from models.spec import sub_channels

__all__ = [
    "BLOCK_STEP",
    "LAYERS_1D",
    "LAYERS_2D",
    "SpatialLayers",
    "block_step",
    "init_conv_weights",
    "make_divisible",
    "residual_stages",
    "slice_channels",
    "spatial_layers",
]


def make_divisible(value: float, divisor: int = 8, min_value: int | None = None) -> int:
    """Round a channel count to the nearest multiple of ``divisor``.

    As in torchvision's MobileNetV2: the result is at least ``min_value`` (default
    ``divisor``) and never more than 10% below ``value``.

    Parameters
    ----------
    value : float
        Unrounded channel count, e.g. ``32 * width_mult``.
    divisor : int, optional
        Multiple to round to, by default 8.
    min_value : int or None, optional
        Smallest result; ``divisor`` when None.

    Returns
    -------
    int
        The rounded channel count.

    Raises
    ------
    ValueError
        If ``value`` is not positive or ``divisor`` is smaller than 1.
    """
    if value <= 0:
        raise ValueError(f"Channel count must be positive, got {value}.")
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}.")
    floor = divisor if min_value is None else min_value
    rounded = max(floor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def slice_channels(channels: int, width: float) -> int:
    """Return the channels a sub-model of width ratio ``width`` keeps of ``channels``.

    The rule of :func:`models.spec.sub_channels` (``ceil(width *
    channels)``, at least 1), so that a slice built here has exactly the shapes that
    :func:`strategies.submodel.extract` cuts out of the global model. No
    ``make_divisible`` rounding: the global model's channels may be rounded, a
    slice's are a prefix of them.

    Parameters
    ----------
    channels : int
        The global model's channel count, at least 1.
    width : float
        Width ratio in ``(0, 1]``.

    Returns
    -------
    int
        The sub-model's channel count.
    """
    return sub_channels(channels, width)


BLOCK_STEP = "step"
"""Attribute (and last state-dict key part) of a block's learnable step size."""


def block_step() -> nn.Parameter:
    """Return a learnable step size for a residual branch: a scalar initialised to 1.

    NeFL (Kang et al.) reads a residual network as an ODE solver, ``x + s * F(x)``,
    and learns the step ``s`` of every block so that a sub-model that skips blocks
    can take longer steps; each sub-model keeps its own steps.
    """
    return nn.Parameter(torch.ones(()))


@dataclass(frozen=True)
class SpatialLayers:
    """The layer types of one spatial dimensionality, injected into the conv families.

    A convolutional family builds every convolution, pooling and normalisation
    through one of these, so the same architecture table gives a 2-d model for
    images ``(N, C, H, W)`` and a 1-d model for signals ``(N, C, L)``
    (:data:`LAYERS_2D`, :data:`LAYERS_1D`). Kernel sizes are per spatial axis: a
    "3x3" convolution is 3 wide in 1-d, a 2x2 pool halves the length.

    Attributes
    ----------
    ndim : int
        Spatial dimensionality: 1 (signals) or 2 (images).
    """

    ndim: int

    def __post_init__(self) -> None:
        """Validate ``ndim``."""
        if isinstance(self.ndim, bool) or self.ndim not in (1, 2):
            raise ValueError(
                f"SpatialLayers.ndim must be 1 (signals (N, C, L)) or 2 (images "
                f"(N, C, H, W)), got {self.ndim!r}."
            )

    def conv3x3(
        self, in_channels: int, out_channels: int, stride: int = 1, groups: int = 1
    ) -> nn.Conv1d | nn.Conv2d:
        """Build a bias-free 3x3 (3 in 1-d) convolution with padding 1.

        Parameters
        ----------
        in_channels : int
            Input channels.
        out_channels : int
            Output channels.
        stride : int, optional
            Stride, by default 1.
        groups : int, optional
            Groups, by default 1 (``in_channels`` for a depthwise convolution).

        Returns
        -------
        nn.Conv1d or nn.Conv2d
            The convolution; the norm layer that follows it provides the shift.
        """
        conv = nn.Conv1d if self.ndim == 1 else nn.Conv2d
        return conv(
            in_channels,
            out_channels,
            kernel_size=3,
            stride=stride,
            padding=1,
            groups=groups,
            bias=False,
        )

    def conv1x1(
        self, in_channels: int, out_channels: int, stride: int = 1
    ) -> nn.Conv1d | nn.Conv2d:
        """Build a bias-free 1x1 (1 in 1-d) convolution.

        Parameters
        ----------
        in_channels : int
            Input channels.
        out_channels : int
            Output channels.
        stride : int, optional
            Stride, by default 1.

        Returns
        -------
        nn.Conv1d or nn.Conv2d
            The convolution.
        """
        conv = nn.Conv1d if self.ndim == 1 else nn.Conv2d
        return conv(in_channels, out_channels, kernel_size=1, stride=stride, bias=False)

    def max_pool(self) -> nn.Module:
        """Build a 2x2 (2 in 1-d) max-pool with stride 2."""
        return nn.MaxPool1d(2) if self.ndim == 1 else nn.MaxPool2d(2)

    def avg_pool(self) -> nn.Module:
        """Build a 2x2 (2 in 1-d) average pool with stride 2."""
        return nn.AvgPool1d(2) if self.ndim == 1 else nn.AvgPool2d(2)

    def global_pool(self) -> nn.Sequential:
        """Build global average pooling followed by flattening to ``(N, C)``."""
        pool = nn.AdaptiveAvgPool1d(1) if self.ndim == 1 else nn.AdaptiveAvgPool2d(1)
        return nn.Sequential(pool, nn.Flatten())

    def norm(self, norm_layer: NormFactory) -> NormFactory:
        """Return the counterpart of ``norm_layer`` for this dimensionality.

        See :func:`models.norm.norm_for_ndim`: ``batch`` becomes ``BatchNorm1d`` in
        1-d; a factory that is not registered there is returned unchanged.
        """
        return norm_for_ndim(norm_layer, self.ndim)


LAYERS_1D: Final = SpatialLayers(ndim=1)
"""Layers of the 1-d form: ``Conv1d``, ``MaxPool1d``, ``BatchNorm1d`` ..."""

LAYERS_2D: Final = SpatialLayers(ndim=2)
"""Layers of the 2-d form: ``Conv2d``, ``MaxPool2d``, ``BatchNorm2d`` ..."""


def spatial_layers(ndim: int) -> SpatialLayers:
    """Return :data:`LAYERS_1D` or :data:`LAYERS_2D` for a spatial dimensionality.

    Raises
    ------
    ValueError
        If ``ndim`` is not 1 or 2.
    """
    if ndim == 1 and not isinstance(ndim, bool):
        return LAYERS_1D
    if ndim == 2 and not isinstance(ndim, bool):
        return LAYERS_2D
    return SpatialLayers(ndim=ndim)  # raises with the message of SpatialLayers


def init_conv_weights(module: nn.Module) -> None:
    """Initialise a network the way torchvision initialises ResNets.

    Convolutions (1-d and 2-d) get Kaiming-normal weights (fan-out, ReLU gain); norm layers with
    affine parameters get weight 1 and bias 0; linear layers keep PyTorch's default.
    Deterministic given ``torch.manual_seed``.

    Parameters
    ----------
    module : nn.Module
        Network whose submodules are initialised in place.
    """
    for m in module.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm)) and m.weight is not None:
            nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def residual_stages(
    depths: Sequence[int], widths: Sequence[int], block: Callable[..., nn.Module]
) -> nn.Sequential:
    """Build CIFAR-style stages of residual blocks, each stage an ``nn.Sequential``.

    Stage ``s`` has ``depths[s]`` blocks of ``widths[s]`` output channels; its first
    block runs at stride 2 (stride 1 in the first stage), the others at stride 1.
    The first stage's input has ``widths[0]`` channels (a stem's output). Blocks are
    built in order, stage by stage, so their parameters are initialised in that order.

    Parameters
    ----------
    depths : Sequence[int]
        Blocks per stage.
    widths : Sequence[int]
        Output channels per stage, one per stage.
    block : Callable[..., nn.Module]
        Builds a block from keyword arguments ``in_channels``, ``out_channels`` and
        ``stride``.

    Returns
    -------
    nn.Sequential
        The stages; block ``b`` of stage ``s`` is at ``[s][b]``.
    """
    stages: list[nn.Module] = []
    in_channels = widths[0]
    for index, (blocks, width) in enumerate(zip(depths, widths, strict=True)):
        stage: list[nn.Module] = []
        for position in range(blocks):
            stride = 2 if index > 0 and position == 0 else 1
            stage.append(block(in_channels=in_channels, out_channels=width, stride=stride))
            in_channels = width
        stages.append(nn.Sequential(*stage))
    return nn.Sequential(*stages)
