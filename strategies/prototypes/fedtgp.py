"""FedTGP (Zhang et al., AAAI 2024): trainable global prototypes, adaptive-margin contrast.

Clients are FedProto's (:mod:`strategies.prototypes.client`): cross-entropy plus
``proto-lambda`` times the distance of their features to the global prototypes,
per-class means and counts sent back. The server keeps trainable prototypes
(:class:`~strategies.prototypes.trainable.TrainablePrototypes`: class embeddings
through ``Linear + ReLU + Linear`` of width ``fedtgp-hidden-dim``) and, every round,
trains them for ``fedtgp-server-epochs`` epochs of SGD on the round's client
prototypes with the adaptive-margin contrastive loss, the margin
``min(max_c min_{c' != c} ||Q_c - Q_c'||, fedtgp-margin-max)`` computed from the
class centres ``Q`` (:mod:`strategies.prototypes.trainable`). It then sends the
trained network's prototype of every class some client holds.

Untrusted input: the training set is the clients' prototypes *after* the robust
merge has capped and bounded them (``knowledge-clip-factor``), and the class
centres are the robust merge itself (``knowledge-merge``), so one node cannot move
the margin or the targets without bound. The generator's weights are part of the
checkpoint.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from strategies.core.context import RoundContext
from strategies.core.registry import Scheme, register_scheme
from strategies.prototypes.client import PrototypeClient
from strategies.prototypes.merge import PrototypeMerge
from strategies.prototypes.options import Key, PrototypeOptions, read_keys
from strategies.prototypes.payload import ClassPrototypes
from strategies.prototypes.server import PrototypeStrategy
from strategies.prototypes.trainable import (
    TrainablePrototypes,
    adaptive_margin,
    train_prototypes,
)

__all__ = ["SCHEME", "FedTGPClient", "FedTGPOptions", "FedTGPStrategy"]


@dataclass(frozen=True)
class FedTGPOptions(PrototypeOptions):
    """FedTGP's options: the shared ones plus the server's training.

    Attributes
    ----------
    server_epochs : int
        Epochs of server training per round (``fedtgp-server-epochs``; the paper's 100).
    margin_max : float
        Cap ``tau`` of the adaptive margin (``fedtgp-margin-max``; the paper's 100).
    hidden_dim : int
        Hidden width of the prototype network (``fedtgp-hidden-dim``; the paper's
        code uses the feature size).
    """

    server_epochs: int = 100
    margin_max: float = 100.0
    hidden_dim: int = 128

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FedTGPOptions:
        """Read the shared keys and ``fedtgp-*``; a :class:`ConfigError` names a bad one."""
        own = {
            "server_epochs": Key("fedtgp-server-epochs", int, 100, 1, "use 1 or more epochs"),
            "margin_max": Key("fedtgp-margin-max", float, 100.0, 0, "use a cap >= 0, e.g. 100"),
            "hidden_dim": Key("fedtgp-hidden-dim", int, 128, 1, "use a positive width, e.g. 128"),
        }
        return cls(**cls.read(run_config), **read_keys(run_config, own))


class FedTGPClient(PrototypeClient[FedTGPOptions]):
    """A FedTGP node: FedProto's objective towards the trained global prototypes."""


@dataclass
class _Trained:
    """Hold this round's trained copy of the prototype network, committed with the prototypes."""

    network: TrainablePrototypes | None = None


class FedTGPStrategy(PrototypeStrategy[FedTGPOptions]):
    """FedTGP's server: trains its prototype network every round (module docstring)."""

    keeps_rows: ClassVar[bool] = True
    """The network trains on every node's bounded row, so nothing is folded."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.network = self.new_network()

    def new_network(self) -> TrainablePrototypes:
        """Return a freshly initialised prototype network, seeded by run-config ``seed``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.env.run.seed)
            return TrainablePrototypes(
                num_classes=self.env.num_classes,
                feature_dim=self.options.feature_dim,
                hidden_dim=self.options.hidden_dim,
            )

    def make_global(
        self, ctx: RoundContext, merge: PrototypeMerge
    ) -> tuple[ClassPrototypes, dict[str, Any]]:
        """Train a copy of the network on the bounded client prototypes; return its prototypes.

        The copy replaces the network in :meth:`commit_global`, once the prototypes
        are known to be finite.
        """
        started = time.perf_counter()
        rows, labels = merge.training_set()
        margin = adaptive_margin(torch.from_numpy(merge.merged.prototypes), self.options.margin_max)
        network = copy.deepcopy(self.network)
        run = self.env.run
        result = train_prototypes(
            network,
            rows,
            labels,
            margin=margin,
            epochs=self.options.server_epochs,
            batch_size=run.training.batch_size,
            learning_rate=run.training.learning_rate,
            generator=torch.Generator().manual_seed(int(ctx.rng.integers(2**62))),
        )
        ctx.state(_Trained).network = network
        ids = merge.merged.class_ids
        with torch.no_grad():
            generated = network(torch.from_numpy(ids.astype(np.int64))).numpy()
        protos = ClassPrototypes(ids, merge.merged.counts, generated.astype(np.float32))
        return protos, {
            "fedtgp_margin": margin,
            "fedtgp_loss": result.loss,
            "fedtgp_steps": result.steps,
            "fedtgp_seconds": time.perf_counter() - started,
        }

    def commit_global(self, ctx: RoundContext, protos: ClassPrototypes) -> None:
        """Keep the prototypes and the network trained this round."""
        super().commit_global(ctx, protos)
        trained = ctx.state(_Trained).network
        if trained is not None:
            self.network = trained

    def state_dict(self) -> dict[str, Any]:
        """Return the prototype state plus the network's weights."""
        weights = {k: v.detach().numpy().copy() for k, v in self.network.state_dict().items()}
        return {**super().state_dict(), "network": weights}

    def checked_scheme_state(self, state: Mapping[str, Any]) -> Callable[[], None]:
        """Check the prototypes and ``network`` (exactly this run's network's arrays, finite)."""
        from tessera.checkpoint import checked_arrays

        restore_prototypes = super().checked_scheme_state(state)
        network = self.new_network()
        weights = checked_arrays(state, "network", network.state_dict())
        network.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})

        def restore() -> None:
            restore_prototypes()
            self.network = network

        return restore


SCHEME = register_scheme(
    Scheme(
        name="fedtgp",
        server=FedTGPStrategy,
        client=FedTGPClient,
        parse_options=FedTGPOptions.parse,
        default_family="cnn",
        description="FedTGP: trainable global prototypes, adaptive-margin contrastive "
        "training on the server, personal models",
    )
)
