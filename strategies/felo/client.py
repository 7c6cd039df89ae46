"""The client of Felo, Velo and FedHe.

It trains with the server's per-class targets and sends its per-class knowledge.
"""

from __future__ import annotations

import torch
from torch import nn

from models.base import TesseraModel
from models.spec import ModelRef
from strategies.core.client import ClientAlgorithm, Record, RoundInput, RoundOutcome
from strategies.felo.knowledge import (
    CLASS_TARGETS,
    KNOWLEDGE,
    collect_knowledge,
    knowledge_to_record,
    record_to_knowledge,
)
from strategies.felo.loss import ClassTargets, loss_terms
from strategies.felo.options import FeloOptions, build_scheme_model
from tessera.config import ConfigError, RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import LossFn


class FeloClient(ClientAlgorithm[FeloOptions]):
    """Client of ``felo``/``velo``/``fedhe``: equation (1), then per-class knowledge.

    With ``share_weights`` (Felo's default) it sends its weights for FedAvg within
    its architecture group; without (``felo-share-weights=false``, FedHe) it sends
    knowledge only and keeps a personal model in the node's state. Both are decided
    here, from the options.
    """

    def __init__(self, *, run: RunConfig, options: FeloOptions) -> None:
        super().__init__(run=run, options=options)
        self.sends_weights = options.share_weights
        self.keeps_personal_model = not options.share_weights
        self.targets: ClassTargets | None = None

    @property
    def felo(self) -> FeloOptions:
        """The options (a shorter name for :attr:`options`)."""
        return self.options

    def build_model(
        self, ref: ModelRef, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Build the zoo model, projected to ``feature-dim`` when features are exchanged."""
        return build_scheme_model(
            ref,
            input_shape=input_shape,
            num_classes=num_classes,
            norm=self.run.scheme.norm,
            flat_input=self.run.scheme.flat_input,
            options=self.felo,
        )

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Read the server's per-class targets, if it sent any (none in round 1)."""
        self.targets = None
        content = rnd.content
        if CLASS_TARGETS not in content.array_records:
            return
        num_classes = rnd.num_classes
        knowledge = record_to_knowledge(content.array_records[CLASS_TARGETS])
        width = None if knowledge.features is None else knowledge.features.shape[1]
        expected = self.felo.feature_dim if self.felo.exchange_features else None
        if width != expected or knowledge.logits.shape[1] != num_classes:
            raise ConfigError(
                f"the server's class targets have feature width {width} and "
                f"{knowledge.logits.shape[1]} logits but this client expects {expected} "
                f"and {num_classes}; server and client disagree on run-config "
                "'feature-dim' or the scheme"
            )
        device = next(model.parameters()).device
        self.targets = ClassTargets.from_knowledge(knowledge, num_classes).to(device)

    def loss_fn(self) -> LossFn:
        """Equation (1): ``CE + alpha * (MSE + KL)`` against the server's targets."""
        targets = self.targets
        alpha, temperature = self.felo.alpha, self.felo.temperature

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            assert isinstance(model, TesseraModel)
            return loss_terms(model, x, y, targets, temperature=temperature).total(alpha)

        return loss

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Return the base records plus the per-class means of the training data."""
        records = super().finish_round(model, rnd, outcome, state)
        records[KNOWLEDGE] = self.knowledge_record(model, outcome.train, outcome.device)
        return records

    def knowledge_record(
        self, model: nn.Module, train: ArrayDataset, device: torch.device
    ) -> Record:
        """Per-class mean features (if exchanged) and logits of ``train``."""
        assert isinstance(model, TesseraModel)
        knowledge = collect_knowledge(
            model,
            train,
            num_classes=model.num_classes,
            with_features=self.felo.exchange_features,
            device=device,
        )
        return knowledge_to_record(knowledge)
