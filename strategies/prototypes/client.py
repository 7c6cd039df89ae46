"""The family's clients: personal projected models, pulled towards prototypes or given a head.

:class:`ProjectedClient` is what every scheme of the family shares: a personal
model (kept in the node's state, as ``local`` does) projected to ``feature-dim``.
:class:`GlobalHeadClient` (FedGH, LG-FedAvg) replaces that model's head by the
server's global head before training. :class:`PrototypeClient` (FedProto, FedTGP)
trains towards the global prototypes, as follows.

Objective per minibatch of ``N`` samples (FedProto's, as its official code and
HtFLlib compute it)::

    L = CE(h(f(x)), y) + lambda * 1/N sum_i m_i * MSE(f(x_i), p[y_i])

with ``f`` the model's projected ``forward_features``, ``h`` its head, ``p[c]`` the
server's global prototype of class ``c``, ``m_i = 1`` when the server sent one for
``y_i`` (0 otherwise: no term; round 1 is plain cross-entropy) and ``MSE`` the mean
over the feature entries. After training the node sends its per-class mean
features on its training data and their counts; it never sends weights and keeps
its model in the node's state (as ``local`` does).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from flwr.app import MetricRecord, RecordDict
from flwr.common.typing import MetricRecordValues
from torch import nn

from models.base import TesseraModel
from models.spec import ModelRef
from strategies.core.client import ClientAlgorithm, Record, RoundInput, RoundOutcome
from strategies.prototypes.head import load_global_head
from strategies.prototypes.options import (
    FeatureOptionsT,
    PrototypeOptionsT,
    build_prototype_model,
)
from strategies.prototypes.payload import (
    CLASS_PROTOTYPES,
    GLOBAL_PROTOTYPES,
    PROTO_ACCURACY,
    collect_prototypes,
    features_of,
    prototype_problem,
    prototypes_to_record,
    record_to_prototypes,
)
from tessera import wire
from tessera.config import ConfigError, RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import LossFn

__all__ = [
    "GlobalHeadClient",
    "ProjectedClient",
    "PrototypeClient",
    "PrototypeTable",
    "nearest_prototype_accuracy",
    "prototype_loss",
    "with_prototypes",
]

PrototypeTable = tuple[torch.Tensor, torch.Tensor]
"""``(known, prototypes)``: bool ``(C,)`` and ``(C, feature_dim)``, indexed by class."""


def prototype_loss(
    model: TesseraModel,
    x: torch.Tensor,
    y: torch.Tensor,
    table: PrototypeTable | None,
    proto_lambda: float,
) -> torch.Tensor:
    """Cross-entropy plus ``proto_lambda`` times the masked prototype MSE (module docstring)."""
    features = model.forward_features(x)
    ce = F.cross_entropy(model.forward_head(features), y)
    if table is None:
        return ce
    known, prototypes = table
    per_sample = ((features - prototypes[y]) ** 2).mean(dim=1)
    term = (per_sample * known[y].to(features.dtype)).sum() / y.shape[0]
    total: torch.Tensor = ce + proto_lambda * term
    return total


@torch.no_grad()
def nearest_prototype_accuracy(
    features: torch.Tensor, y: torch.Tensor, table: PrototypeTable
) -> float:
    """Share of samples whose nearest global prototype (L2) is their class's.

    Only classes the server sent a prototype for are candidates.
    """
    known, prototypes = table
    distances = torch.cdist(features, prototypes)
    distances[:, ~known] = float("inf")
    return float((distances.argmin(dim=1) == y).double().mean().item())


def with_prototypes(
    records: dict[str, Record], model: nn.Module, outcome: RoundOutcome
) -> dict[str, Record]:
    """Return ``records`` with record ``class-prototypes``: the trained model's per-class means.

    The mean features (eval mode) of the round's training data per class, with
    their counts (:func:`~strategies.prototypes.payload.collect_prototypes`): what
    FedProto, FedTGP and FedGH nodes send.
    """
    assert isinstance(model, TesseraModel)
    records[CLASS_PROTOTYPES] = prototypes_to_record(collect_prototypes(model, outcome.train))
    return records


class ProjectedClient(ClientAlgorithm[FeatureOptionsT]):
    """A node of the family: a personal zoo model projected to ``feature-dim``, no weights sent.

    Subclasses add what their scheme exchanges.
    """

    def __init__(self, *, run: RunConfig, options: FeatureOptionsT) -> None:
        super().__init__(run=run, options=options)
        self.sends_weights = False
        self.keeps_personal_model = True

    def build_model(
        self, ref: ModelRef, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Build the zoo model projected to ``feature-dim``."""
        return build_prototype_model(
            ref,
            input_shape=input_shape,
            num_classes=num_classes,
            norm=self.run.scheme.norm,
            flat_input=self.run.scheme.flat_input,
            feature_dim=self.options.feature_dim,
        )


class GlobalHeadClient(ProjectedClient[FeatureOptionsT]):
    """A node of FedGH or LG-FedAvg: its personal model with the server's head put in.

    The server sends its global head as the weights record, holding
    :data:`~strategies.prototypes.head.HEAD_KEYS` only; the node loads its personal
    model (the body it keeps) and replaces that model's head by the global one
    before training (:meth:`load_weights`, so a wrapper that remembers the starting
    weights, an attack, sees the head the node started from).
    """

    def load_weights(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> str:
        """Load the personal model, then the server's head over its own.

        Raises
        ------
        ConfigError
            If the server's head is not exactly a finite head of this model.
        """
        assert isinstance(model, TesseraModel)
        content = RecordDict({k: v for k, v in rnd.content.items() if k != wire.ARRAYS})
        source = super().load_weights(model, dataclasses.replace(rnd, content=content), state)
        head = rnd.content.array_records.get(wire.ARRAYS)
        if head is not None:
            load_global_head(model, head)
        return source


class PrototypeClient(ProjectedClient[PrototypeOptionsT]):
    """Client of ``fedproto`` and ``fedtgp`` (module docstring).

    Its reply also carries metric ``proto-accuracy``: the nearest-prototype accuracy
    of its trained model on its own test split against the global prototypes it
    received (FedProto's inference rule); the round record's personal accuracy stays
    the model's own head, as for every scheme.
    """

    def __init__(self, *, run: RunConfig, options: PrototypeOptionsT) -> None:
        super().__init__(run=run, options=options)
        self.table: PrototypeTable | None = None
        self.test: ArrayDataset | None = None

    def prepare_data(
        self, train: ArrayDataset, test: ArrayDataset
    ) -> tuple[ArrayDataset, ArrayDataset]:
        """Keep the test split for the nearest-prototype accuracy."""
        self.test = test
        return train, test

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Read the server's global prototypes, if it sent any (none in round 1).

        Raises
        ------
        ConfigError
            If they are malformed or of another width than ``feature-dim``: server
            and client disagree on the run config.
        """
        self.table = None
        record = rnd.content.array_records.get(GLOBAL_PROTOTYPES)
        if record is None:
            return
        problem = prototype_problem(
            wire.record_to_numpy(record),
            num_classes=rnd.num_classes,
            feature_dim=self.options.feature_dim,
        )
        if problem is not None:
            raise ConfigError(
                f"the server's global prototypes are unusable ({problem}); server and "
                "client disagree on run-config 'feature-dim' or the scheme"
            )
        device = next(model.parameters()).device
        known, table = record_to_prototypes(record).table(rnd.num_classes)
        self.table = (known.to(device), table.to(device))

    def loss_fn(self) -> LossFn:
        """Cross-entropy plus ``proto-lambda`` times the prototype MSE."""
        table, proto_lambda = self.table, self.options.proto_lambda

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            assert isinstance(model, TesseraModel)
            return prototype_loss(model, x, y, table, proto_lambda)

        return loss

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Return the base records, the prototypes and (with global ones) ``proto-accuracy``."""
        assert isinstance(model, TesseraModel)
        records = with_prototypes(super().finish_round(model, rnd, outcome, state), model, outcome)
        sent = records[wire.METRICS]
        if (
            self.table is not None
            and self.test is not None
            and len(self.test)
            and (isinstance(sent, MetricRecord))
        ):
            features = torch.from_numpy(features_of(model, self.test)).to(outcome.device)
            labels = torch.from_numpy(self.test.y.astype("int64")).to(outcome.device)
            metrics: dict[str, MetricRecordValues] = dict(sent)
            metrics[PROTO_ACCURACY] = nearest_prototype_accuracy(features, labels, self.table)
            records[wire.METRICS] = MetricRecord(metrics)
        return records
