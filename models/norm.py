"""Injectable normalisation layers.

Every model in the zoo takes a ``norm_layer`` argument, torchvision style: a callable
that receives a channel count and returns a fresh normalisation module. Federated
learning needs this seam: HeteroFL uses *static* batch normalisation (no running
statistics, so nothing client-specific is aggregated), other schemes prefer group
normalisation, which does not depend on the batch at all.

Every norm name has a factory per spatial dimensionality: ``get_norm(name)`` builds
modules for images ``(N, C, H, W)`` (``ndim=2``, the default), ``get_norm(name,
ndim=1)`` for signals ``(N, C, L)`` (``BatchNorm1d`` instead of ``BatchNorm2d``;
group norm and the identity serve both). A convolutional model built for signals maps
the factory it is given to its 1-d counterpart with :func:`norm_for_ndim`, so callers
pass the same factory (or norm name) whatever the input. Both counterparts of a norm
have the same state-dict entries.

Fully connected layers use the 2-d factories through :class:`VectorNorm`, which
views a ``(N, C)`` batch as ``(N, C, 1, 1)``; for every norm offered here that is
exactly the 1-d counterpart (``BatchNorm2d`` on ``(N, C, 1, 1)`` computes the same
statistics as ``BatchNorm1d`` on ``(N, C)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from torch import Tensor, nn

NormFactory = Callable[[int], nn.Module]
"""Callable mapping a channel count to a fresh normalisation module."""

MAX_GROUPS: Final = 32
"""Upper bound on the number of groups used by the ``group`` norm."""


@dataclass(frozen=True)
class BatchNormFactory:
    """Factory of batch-norm layers of one dimensionality, with or without running statistics.

    Attributes
    ----------
    ndim : int
        Spatial dimensionality of the feature maps: 2 (``BatchNorm2d``, images) or 1
        (``BatchNorm1d``, signals).
    track_running_stats : bool
        Keep running statistics (the default); without them (HeteroFL's static batch
        norm) the layer normalises with the batch's statistics in train and eval mode
        alike, so its output is the same in both.
    """

    ndim: int
    track_running_stats: bool = True

    def __call__(self, num_channels: int) -> nn.Module:
        """Build a batch norm for ``num_channels`` channels.

        Parameters
        ----------
        num_channels : int
            Number of channels to normalise.

        Returns
        -------
        nn.Module
            ``BatchNorm2d`` (``BatchNorm1d`` for ``ndim=1``) of ``num_channels``.
        """
        norm = nn.BatchNorm1d if self.ndim == 1 else nn.BatchNorm2d
        return norm(num_channels, track_running_stats=self.track_running_stats)


batch_norm: Final = BatchNormFactory(ndim=2)
"""``BatchNorm2d`` with running statistics, the default norm."""

static_batch_norm: Final = BatchNormFactory(ndim=2, track_running_stats=False)
"""HeteroFL's static batch norm: ``BatchNorm2d(track_running_stats=False)``."""

batch_norm_1d: Final = BatchNormFactory(ndim=1)
"""``BatchNorm1d`` with running statistics, the 1-d form of ``batch``."""

static_batch_norm_1d: Final = BatchNormFactory(ndim=1, track_running_stats=False)
"""HeteroFL's static batch norm for signals ``(N, C, L)``: ``BatchNorm1d``."""


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


NORM_NDIMS: Final = (1, 2)
"""Spatial dimensionalities with a factory for every norm: signals (1), images (2)."""

_NORMS: Final[Mapping[str, Mapping[int, NormFactory]]] = MappingProxyType(
    {
        "batch": MappingProxyType({2: batch_norm, 1: batch_norm_1d}),
        "static-batch": MappingProxyType({2: static_batch_norm, 1: static_batch_norm_1d}),
        "group": MappingProxyType({2: group_norm, 1: group_norm}),
        "none": MappingProxyType({2: no_norm, 1: no_norm}),
    }
)
"""Norm name -> spatial dimensionality -> factory."""


def list_norms() -> list[str]:
    """Return the valid normalisation names.

    Returns
    -------
    list[str]
        The names accepted by :func:`get_norm`, in a fixed order.
    """
    return list(_NORMS)


def _check_ndim(ndim: int) -> int:
    if isinstance(ndim, bool) or ndim not in NORM_NDIMS:
        raise ValueError(
            f"ndim must be 1 (signals (N, C, L)) or 2 (images (N, C, H, W)), got {ndim!r}."
        )
    return int(ndim)


def get_norm(name: str, *, ndim: int = 2) -> NormFactory:
    """Return the normalisation factory registered under ``name``.

    Parameters
    ----------
    name : str
        One of ``"batch"`` (``BatchNorm2d`` / ``BatchNorm1d``), ``"static-batch"``
        (the same with ``track_running_stats=False``, HeteroFL's static BN),
        ``"group"`` (``GroupNorm``, largest group count <= 32 dividing the channels)
        or ``"none"`` (``Identity``).
    ndim : int, optional
        Spatial dimensionality of the feature maps: 2 (images, the default) or 1
        (signals).

    Returns
    -------
    NormFactory
        A callable that maps a channel count to a fresh normalisation module.

    Raises
    ------
    ValueError
        If ``name`` is not a known normalisation or ``ndim`` is not 1 or 2.
    """
    dims = _check_ndim(ndim)
    try:
        return _NORMS[name][dims]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown norm {name!r}. Valid norms: {', '.join(_NORMS)}.") from None


def norm_for_ndim(norm_layer: NormFactory, ndim: int) -> NormFactory:
    """Return the counterpart of a registered norm factory for feature maps of ``ndim``.

    ``norm_for_ndim(get_norm("batch"), 1)`` is ``get_norm("batch", ndim=1)``, and
    every registered factory maps to itself for its own ``ndim``. A factory that is
    not registered here (one a caller wrote) is returned unchanged: its author built
    it for the model's input.

    Parameters
    ----------
    norm_layer : NormFactory
        A factory, usually from :func:`get_norm`.
    ndim : int
        Spatial dimensionality of the feature maps it will normalise: 1 or 2.

    Returns
    -------
    NormFactory
        The factory of the same norm for ``ndim``.

    Raises
    ------
    ValueError
        If ``ndim`` is not 1 or 2.
    """
    dims = _check_ndim(ndim)
    for by_ndim in _NORMS.values():
        if any(norm_layer is factory for factory in by_ndim.values()):
            return by_ndim[dims]
    return norm_layer


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
