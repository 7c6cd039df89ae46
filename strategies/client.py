"""The client side of a scheme: its local objective and the records it sends back.

A scheme's :class:`ClientAlgorithm` subclass lives in the scheme's own module, next to
its server strategy. The ClientApp (:mod:`client_app.app`) owns the shared flow (data,
model, training loop, evaluation, state) and calls these hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from client_app.training import LossFn, cross_entropy_loss
from models.base import TesseraModel
from tessera.config import ConfigError, RunConfig
from tessera.data import ArrayDataset

Record = Any
"""A Flower record (ArrayRecord, ConfigRecord or MetricRecord)."""


class ClientAlgorithm:
    """Default client behaviour: cross-entropy training of the model it is sent.

    Parameters
    ----------
    run : RunConfig
        The common run configuration.
    options : Any
        The scheme's typed options.
    """

    keeps_personal_model: ClassVar[bool] = False
    """Keep the trained model in ``context.state`` and start the next round from it
    when the server sends no weights."""
    sends_weights: ClassVar[bool] = True
    """Return the trained weights in the ``arrays`` record."""

    def __init__(self, *, run: RunConfig, options: Any) -> None:
        self.run = run
        self.options = options

    def build_model(
        self, arch: str, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Build the model this scheme trains for ``arch`` (default: the zoo's model).

        A scheme that changes the model (e.g. a projection to a shared feature
        dimension) overrides this and the server strategy's ``build_model`` alike.
        """
        from models import get_model

        return get_model(arch, input_shape=input_shape, num_classes=num_classes, norm=self.run.norm)

    def arch_for(self, config: ConfigRecord) -> str:
        """Return the architecture to train this round (the server names it)."""
        if "arch" not in config:
            raise ConfigError(
                "the train message's config names no 'arch'; the server and this "
                "client run different scheme code (check both use the same FAB)"
            )
        return str(config["arch"])

    def begin_round(self, model: nn.Module, content: RecordDict) -> None:
        """Prepare the round, after the model is loaded and before local training."""

    def loss_fn(self) -> LossFn:
        """Return the local objective for one minibatch."""
        return cross_entropy_loss

    def extra_records(
        self, model: nn.Module, train: ArrayDataset, device: torch.device
    ) -> Mapping[str, Record]:
        """Further records for the reply (shared knowledge, representations)."""
        return {}
