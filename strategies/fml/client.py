"""An FML node: its personal model and the global meme, trained together; the meme sent.

Each round the node builds a :class:`~strategies.fml.pair.MutualPair` of its own
architecture (the round's ``arch``) and run-config ``fml-meme-arch``, loads the
personal model it keeps in its state (fresh in its first round, or when its
architecture changed, as ``local`` does) and the server's meme, trains both with
the mutual objective (:func:`~strategies.fml.objective.mutual_loss`), and replies
with the trained meme alone, under the meme's own ``state_dict`` names. The reply's
test accuracy is the personal model's on the node's test split.
"""

from __future__ import annotations

import dataclasses

from flwr.app import RecordDict
from torch import nn

from models.base import TesseraModel
from models.spec import ModelRef
from strategies.core.client import (
    ClientAlgorithm,
    Record,
    RoundInput,
    RoundOutcome,
    load_state_record,
)
from strategies.fml.objective import mutual_loss
from strategies.fml.options import FMLOptions
from strategies.fml.pair import MutualPair
from tessera import wire
from tessera.config import ConfigError, RunConfig
from tessera.node_state import NodeState
from tessera.training import LossFn

__all__ = ["FMLClient"]


def _pair(model: nn.Module) -> MutualPair:
    if not isinstance(model, MutualPair):
        raise TypeError(f"FML trains a MutualPair, not a {type(model).__name__}")
    return model


class FMLClient(ClientAlgorithm[FMLOptions]):
    """Client of ``fml`` (module docstring): sends weights (the meme), keeps a personal model."""

    def __init__(self, *, run: RunConfig, options: FMLOptions) -> None:
        super().__init__(run=run, options=options)
        self.sends_weights = True
        self.keeps_personal_model = True

    def build_model(
        self, ref: ModelRef, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Build the pair: the zoo model of ``ref`` and the meme of ``fml-meme-arch``."""
        personal = super().build_model(ref, input_shape=input_shape, num_classes=num_classes)
        meme = super().build_model(
            ModelRef(self.options.meme_arch), input_shape=input_shape, num_classes=num_classes
        )
        return MutualPair(personal, meme)

    def load_weights(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> str:
        """Load the server's meme, then the personal model from the node's state.

        Returns
        -------
        str
            Where the personal model came from: ``"personal"`` or ``"fresh"``.

        Raises
        ------
        ConfigError
            If the server sent no meme, or one that is not exactly a
            ``fml-meme-arch`` of this task: server and client disagree on the run
            config.
        """
        pair = _pair(model)
        meme = rnd.content.array_records.get(wire.ARRAYS)
        if meme is None:
            raise ConfigError(
                "the server sent no meme model (no 'arrays' record); the server and this "
                "client run different schemes (check run-config 'strategy')"
            )
        try:
            load_state_record(pair.meme, meme)
        except ConfigError as err:
            raise ConfigError(
                f"the server's meme is not a '{self.options.meme_arch}' of this task ({err}); "
                "server and client disagree on run-config 'fml-meme-arch'"
            ) from err
        rest = RecordDict({k: v for k, v in rnd.content.items() if k != wire.ARRAYS})
        return super().load_weights(pair.personal, dataclasses.replace(rnd, content=rest), state)

    def loss_fn(self) -> LossFn:
        """Return the mutual objective with ``fml-alpha`` and ``fml-beta``."""
        return mutual_loss(alpha=self.options.alpha, beta=self.options.beta)

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Return the base records with the trained meme as the weights, under its own names."""
        return super().finish_round(_pair(model).meme, rnd, outcome, state)

    def save_state(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Keep the personal model (not the meme: the server sends it every round)."""
        super().save_state(_pair(model).personal, rnd, state)
