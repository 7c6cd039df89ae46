"""Injectable normalisation layers.

Every model in the zoo takes a ``norm_layer`` argument, torchvision style: a callable
that receives a channel count and returns a fresh normalisation module. Federated
learning needs this seam: HeteroFL uses *static* batch normalisation (no running
statistics, so nothing client-specific is aggregated), other schemes prefer group
normalisation, which does not depend on the batch at all.

All factories returned by :func:`get_norm` build modules for 4-d feature maps
``(N, C, H, W)``. Fully connected layers use them through :class:`VectorNorm`, which
views a ``(N, C)`` batch as ``(N, C, 1, 1)``; for every norm offered here that is
exactly the 1-d counterpart (``BatchNorm2d`` on ``(N, C, 1, 1)`` computes the same
statistics as ``BatchNorm1d`` on ``(N, C)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from torch import Tensor, nn

NormFactory = Callable[[int], nn.Module]
"""Callable mapping a channel count to a fresh normalisation module."""

MAX_GROUPS: Final = 32
"""Upper bound on the number of groups used by the ``group`` norm."""


def batch_norm(num_channels: int) -> nn.Module:
    """Build a ``BatchNorm2d`` with running statistics (the default norm).

    Parameters
    ----------
    num_channels : int
        Number of channels to normalise.

    Returns
    -------
    nn.Module
        A ``BatchNorm2d(num_channels)``.
    """
    return nn.BatchNorm2d(num_channels)


def static_batch_norm(num_channels: int) -> nn.Module:
    """Build HeteroFL's static batch norm: batch statistics in train and eval mode.

    Parameters
    ----------
    num_channels : int
        Number of channels to normalise.

    Returns
    -------
    nn.Module
        A ``BatchNorm2d(num_channels, track_running_stats=False)``; it keeps no
        running statistics, so its output is the same in train and eval mode.
    """
    return nn.BatchNorm2d(num_channels, track_running_stats=False)


def group_count(num_channels: int, max_groups: int = MAX_GROUPS) -> int:
    """Return the largest group count ``<= max_groups`` that divides ``num_channels``.

    Parameters
    ----------
    num_channels : int
        Number of channels, at least 1.
    max_groups : int, optional
        Upper bound on the group count, by default 32.

    Returns
    -------
    int
        The group count, between 1 and ``min(max_groups, num_channels)``.

    Raises
    ------
    ValueError
        If ``num_channels`` or ``max_groups`` is smaller than 1.
    """
    if num_channels < 1:
        raise ValueError(f"num_channels must be >= 1 for group norm, got {num_channels}.")
    if max_groups < 1:
        raise ValueError(f"max_groups must be >= 1 for group norm, got {max_groups}.")
    for groups in range(min(max_groups, num_channels), 0, -1):
        if num_channels % groups == 0:
            return groups
    return 1  # pragma: no cover - unreachable, 1 divides every integer


def group_norm(num_channels: int) -> nn.Module:
    """Build a ``GroupNorm`` with the largest group count <= 32 dividing the channels.

    Parameters
    ----------
    num_channels : int
        Number of channels to normalise.

    Returns
    -------
    nn.Module
        A ``GroupNorm(group_count(num_channels), num_channels)``.
    """
    return nn.GroupNorm(group_count(num_channels), num_channels)


def no_norm(num_channels: int) -> nn.Module:
    """Build an identity in place of a normalisation layer.

    Parameters
    ----------
    num_channels : int
        Ignored; accepted so that the function is a :data:`NormFactory`.

    Returns
    -------
    nn.Module
        An ``nn.Identity``.
    """
    del num_channels
    return nn.Identity()


_NORMS: Final[Mapping[str, NormFactory]] = MappingProxyType(
    {
        "batch": batch_norm,
        "static-batch": static_batch_norm,
        "group": group_norm,
        "none": no_norm,
    }
)


def list_norms() -> list[str]:
    """Return the valid normalisation names.

    Returns
    -------
    list[str]
        The names accepted by :func:`get_norm`, in a fixed order.
    """
    return list(_NORMS)


def get_norm(name: str) -> NormFactory:
    """Return the normalisation factory registered under ``name``.

    Parameters
    ----------
    name : str
        One of ``"batch"`` (``BatchNorm2d``), ``"static-batch"``
        (``BatchNorm2d(track_running_stats=False)``, HeteroFL's static BN),
        ``"group"`` (``GroupNorm``, largest group count <= 32 dividing the channels)
        or ``"none"`` (``Identity``).

    Returns
    -------
    NormFactory
        A callable that maps a channel count to a fresh normalisation module.

    Raises
    ------
    ValueError
        If ``name`` is not a known normalisation.
    """
    try:
        return _NORMS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown norm {name!r}. Valid norms: {', '.join(_NORMS)}.") from None


class VectorNorm(nn.Module):
    """Apply a feature-map norm to a batch of vectors.

    The ``(N, C)`` input is viewed as ``(N, C, 1, 1)``, normalised, and flattened
    back, so every :data:`NormFactory` can be used after a linear layer.

    Parameters
    ----------
    num_features : int
        Size of the vectors.
    norm_layer : NormFactory
        Factory of the underlying normalisation module.
    """

    def __init__(self, num_features: int, *, norm_layer: NormFactory) -> None:
        super().__init__()
        self.norm = norm_layer(num_features)

    def forward(self, x: Tensor) -> Tensor:
        """Normalise a batch of vectors.

        Parameters
        ----------
        x : Tensor
            Input of shape ``(N, C)``.

        Returns
        -------
        Tensor
            Normalised input of shape ``(N, C)``.
        """
        out: Tensor = self.norm(x[:, :, None, None])
        return out.flatten(1)
