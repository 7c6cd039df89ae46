"""FedGH (Yi et al., ACM MM 2023): one global head, trained on the server on the prototypes.

Every node trains its personal model (its zoo body projected to ``feature-dim``,
then a linear head) with cross-entropy, after replacing its head by the server's
global head (:class:`~strategies.prototypes.client.GlobalHeadClient`). It then
sends its per-class prototypes and counts exactly as FedProto does
(:mod:`strategies.prototypes.payload`). The server keeps one global head
``Linear(feature-dim, classes)`` and, every round, trains it for
``fedgh-server-epochs`` epochs of SGD (``fedgh-server-lr``, batches of
``batch-size``) with cross-entropy on the round's client prototypes, each one a
sample of its class, and sends the trained head.

Untrusted input: the training set is the clients' prototypes *after* the robust
merge has capped their counts and bounded their rows (``knowledge-clip-factor``,
:func:`~strategies.prototypes.server.merge_replies`), so one node cannot pull the
head without bound; the head is committed only if it is finite. The head's weights
are the checkpoint's scheme state.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

from strategies.core.client import Record, RoundInput, RoundOutcome
from strategies.core.context import RoundContext
from strategies.core.groups import NonFiniteStateError, non_finite_entries
from strategies.core.registry import Scheme, register_scheme
from strategies.core.validation import ClientReply, ReplySchema
from strategies.prototypes.client import GlobalHeadClient, with_prototypes
from strategies.prototypes.head import head_arrays, linear_head
from strategies.prototypes.options import FeatureOptions, Key, read_keys
from strategies.prototypes.server import (
    GlobalHeadStrategy,
    claimed_prototypes,
    merge_replies,
    prototype_schema,
)
from strategies.prototypes.trainable import TrainingResult, sgd_epochs
from tessera.config import ConfigError, RunConfig
from tessera.node_state import NodeState

__all__ = ["SCHEME", "FedGHClient", "FedGHOptions", "FedGHStrategy", "train_head", "validate_fedgh"]


@dataclass(frozen=True)
class FedGHOptions(FeatureOptions):
    """FedGH's options: ``feature-dim`` and the server's training of the global head.

    Attributes
    ----------
    server_epochs : int
        Epochs of SGD on the round's client prototypes (``fedgh-server-epochs``).
    server_lr : float
        Learning rate of that SGD (``fedgh-server-lr``), above 0.
    """

    server_epochs: int = 100
    server_lr: float = 0.1

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FedGHOptions:
        """Read ``feature-dim`` and ``fedgh-*``; a :class:`ConfigError` names a bad one."""
        epochs = Key("fedgh-server-epochs", int, 100, 1, "use 1 or more epochs")
        rate = Key("fedgh-server-lr", float, 0.1, 0, "use a rate > 0, e.g. 0.1", above=True)
        own = read_keys(run_config, {"server_epochs": epochs, "server_lr": rate})
        return cls(**cls.read(run_config), **own)


def train_head(
    head: nn.Linear,
    rows: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    generator: torch.Generator,
) -> TrainingResult:
    """Train ``head`` with cross-entropy on ``rows`` (prototypes) of class ``labels``, SGD."""
    return sgd_epochs(
        head,
        rows,
        labels,
        lambda x, y: F.cross_entropy(head(x), y),
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        generator=generator,
    )


class FedGHClient(GlobalHeadClient[FedGHOptions]):
    """A FedGH node: the global head put in, cross-entropy training, prototypes sent back."""

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Return the base records and the per-class prototypes (FedProto's record)."""
        return with_prototypes(super().finish_round(model, rnd, outcome, state), model, outcome)


class FedGHStrategy(GlobalHeadStrategy[FedGHOptions]):
    """FedGH's server: trains its global head on the bounded prototypes (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head = self.initial_head()
        """The global head the next round sends."""

    def global_head(self) -> Mapping[str, np.ndarray]:
        """Return the trained head (the seeded initial head before round 1)."""
        return self.head

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """No weights; a valid ``class-prototypes`` record."""
        return prototype_schema(self.env.num_classes, self.options.feature_dim)

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Cut the reply's prototypes to its handshake label counts (:func:`claimed_prototypes`)."""
        return claimed_prototypes(ctx, reply, self.env, self.declared_labels(reply.node_id))[0]

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Train a copy of the head on the bounded prototypes; keep it if it is finite."""
        started = time.perf_counter()
        merge, clipped = merge_replies(ctx, replies, self.env)
        rows, labels = merge.training_set()
        head = linear_head(self.head)
        result = train_head(
            head,
            rows,
            labels,
            epochs=self.options.server_epochs,
            batch_size=self.env.run.training.batch_size,
            learning_rate=self.options.server_lr,
            generator=torch.Generator().manual_seed(int(ctx.rng.integers(2**62))),
        )
        trained = head_arrays(head)
        bad = non_finite_entries(trained)
        if bad:
            raise NonFiniteStateError(f"the trained global head is not finite in {bad}")
        self.head = trained
        return {
            "fedgh_loss": result.loss,
            "fedgh_steps": result.steps,
            "fedgh_seconds": time.perf_counter() - started,
            "prototype_classes": int(merge.merged.class_ids.shape[0]),
            "prototypes_clipped": clipped,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the base state and the global head."""
        return {**super().state_dict(), "global_head": {k: v.copy() for k, v in self.head.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, every field checked before anything is restored.

        Raises
        ------
        CheckpointError
            Naming the file, the field and the fix, if ``global_head`` is missing or
            not exactly a finite head of this run's shape.
        """
        from tessera.checkpoint import checked_arrays

        head = checked_arrays(state, "global_head", self.initial_head())
        super().load_state_dict(state)
        self.head = {k: v.astype(np.float32, copy=True) for k, v in head.items()}


def validate_fedgh(run: RunConfig, options: FedGHOptions) -> None:
    """Refuse what FedGH would not honour: a ``knowledge-merge`` other than ``mean``.

    Its server trains on every bounded client prototype, not on a merge, so no merge
    rule applies (``knowledge-clip-factor`` bounds the rows).

    Raises
    ------
    ConfigError
        If run-config ``knowledge-merge`` is not ``mean``.
    """
    if run.aggregation.knowledge_merge != "mean":
        raise ConfigError(
            f"run-config 'knowledge-merge' is '{run.aggregation.knowledge_merge}' but fedgh "
            "trains its head on every client prototype and merges none; leave it at 'mean' "
            "(knowledge-clip-factor bounds the prototypes)"
        )


SCHEME = register_scheme(
    Scheme(
        name="fedgh",
        server=FedGHStrategy,
        client=FedGHClient,
        parse_options=FedGHOptions.parse,
        default_family="cnn",
        validate=validate_fedgh,
        description="FedGH: one global head trained on the server on the clients' prototypes, "
        "personal bodies",
    )
)
