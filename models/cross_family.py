"""Cross-family sets of the zoo: names listed like families that stand for several.

A cross-family set such as ``"mixed"`` (:data:`MIXED_FAMILY`) is a fixed set of
registered models of different families (:data:`MIXED_MEMBERS`) that
:func:`models.list_models` and :func:`models.list_families` treat like a family,
listing its members by ascending measured cost (:func:`measured_cost`). It is an
alias, not a registration: every member keeps its own family and size rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

import torch
from torch import nn

from models.cost import count_macs, count_parameters

__all__ = [
    "COST_INPUT_SHAPE",
    "CROSS_FAMILY_SETS",
    "MIXED_FAMILY",
    "MIXED_MEMBERS",
    "measured_cost",
]

MIXED_FAMILY: Final = "mixed"
"""Name of the cross-family candidate set of the heterogeneous ensemble."""

MIXED_MEMBERS: Final[tuple[str, ...]] = (
    "mobilenetv2_035",
    "resnet10",
    "vgg11_0125",
    "densenet76_k12",
)
"""The models of :data:`MIXED_FAMILY`, one per family (Thonglek et al.'s fleet of
MobileNet, DenseNet, ResNet and VGG models chosen by device capacity).

Chosen so that parameters and MACs, on 8x8 and on 32x32 inputs alike, grow in the
same order: vgg11_0125 < mobilenetv2_035 < densenet76_k12 < resnet10. Listed here in
any order; :func:`models.list_models` orders them by measured cost.
"""

CROSS_FAMILY_SETS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {MIXED_FAMILY: MIXED_MEMBERS}
)
"""Cross-family sets of the zoo's registry: name -> member models."""

COST_INPUT_SHAPE: Final[tuple[int, ...]] = (1, 8, 8)
"""Input of the cost measurement ordering a cross-family set: one 8x8 channel."""


def measured_cost(build: Callable[[tuple[int, ...]], nn.Module]) -> tuple[int, int]:
    """Measure the cost by which a cross-family set orders its members.

    The model is built on the meta device (shapes only: no memory, no initialisation
    to pay for) without touching torch's random state.

    Parameters
    ----------
    build : Callable[[tuple[int, ...]], nn.Module]
        Builds the member for an input shape (:data:`COST_INPUT_SHAPE` is passed).

    Returns
    -------
    tuple[int, int]
        Multiply-accumulates of one forward pass on a :data:`COST_INPUT_SHAPE` input
        (:func:`models.cost.count_macs`), then the parameter count.
    """
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build(COST_INPUT_SHAPE)
    return count_macs(model, COST_INPUT_SHAPE), count_parameters(model)
