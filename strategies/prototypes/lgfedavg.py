"""LG-FedAvg (Liang et al. 2020) as HtFLlib runs it: personal bodies, one averaged head.

Every node's model is its own zoo body projected to ``feature-dim`` plus a linear
head ``Linear(feature-dim, classes)`` of the same shape on every node. Only the
head (:data:`~strategies.prototypes.head.HEAD_KEYS`) travels: the server sends the
global head, the node puts it into its personal model (whose body it keeps in its
state, :class:`~strategies.prototypes.client.GlobalHeadClient`), trains the whole
model with cross-entropy and replies with its trained head alone. The server
averages the heads of all nodes, whatever their bodies, as one group of
:class:`~strategies.core.groups.GroupModels` through the run's aggregator (the
bounded ``mean`` by default, example-weighted with each reply's capped weight:
the heads are untrusted weights like any other).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from models.base import TesseraModel
from strategies.core.client import Record, RoundInput, RoundOutcome
from strategies.core.context import RoundContext
from strategies.core.groups import GroupModels, GroupRound, SharedGroup, restore_shared
from strategies.core.registry import Scheme, register_scheme
from strategies.core.validation import ClientReply, ReplySchema
from strategies.prototypes.client import GlobalHeadClient
from strategies.prototypes.head import head_record, head_spec
from strategies.prototypes.options import FeatureOptions
from strategies.prototypes.server import GlobalHeadStrategy
from tessera import wire
from tessera.config import RunConfig
from tessera.node_state import NodeState

__all__ = ["HEAD_GROUP", "SCHEME", "LGFedAvgClient", "LGFedAvgOptions", "LGFedAvgStrategy"]

HEAD_GROUP = "head"
"""The one group of the server's :class:`GroupModels`: the head every node shares."""


@dataclass(frozen=True)
class LGFedAvgOptions(FeatureOptions):
    """LG-FedAvg's options: ``feature-dim``, the head's input size on every node."""

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> LGFedAvgOptions:
        """Read ``feature-dim``; a :class:`ConfigError` names a bad value."""
        return cls(**cls.read(run_config))


class LGFedAvgClient(GlobalHeadClient[LGFedAvgOptions]):
    """An LG-FedAvg node: the global head put in, the whole model trained, the head sent."""

    def __init__(self, *, run: RunConfig, options: LGFedAvgOptions) -> None:
        super().__init__(run=run, options=options)
        self.sends_weights = True

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Return the base records with the weights record cut to the trained head."""
        assert isinstance(model, TesseraModel)
        records = super().finish_round(model, rnd, outcome, state)
        records[wire.ARRAYS] = head_record(model)
        return records


class LGFedAvgStrategy(GlobalHeadStrategy[LGFedAvgOptions]):
    """LG-FedAvg's server: the heads of all nodes averaged as one group (module docstring).

    The run's aggregator folds each head as its reply is pulled (a
    :class:`~strategies.core.groups.GroupRound` in the round's context); a round
    that is skipped leaves the global head as it was. The server has no body to
    train a head of its own on its pool, so the bounded ``mean`` bounds the heads by
    their distances alone (``clip-factor``), without run-config ``server-trust``'s
    direction check.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.heads = SharedGroup(HEAD_GROUP, self.new_heads())

    def new_heads(self) -> GroupModels:
        """Return the head's :class:`GroupModels`, at the seeded initial head."""
        return GroupModels(self.aggregator, self._initial_group)

    def _initial_group(self, group: str) -> dict[str, np.ndarray]:
        if group != HEAD_GROUP:
            raise ValueError(f"lg-fedavg has one group, '{HEAD_GROUP}'")
        return self.initial_head()

    def global_head(self) -> Mapping[str, np.ndarray]:
        """Return the current global head."""
        return self.heads.get()

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """Exactly the head's arrays: ``head.weight`` and ``head.bias``, float32, finite."""
        spec = head_spec(num_classes=self.env.num_classes, feature_dim=self.options.feature_dim)
        return ReplySchema(arrays=spec)

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Fold the reply's head (at its capped weight) into the round's one group."""
        return self.heads.fold(ctx.state(GroupRound), reply)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Replace the global head by the aggregate (all or nothing, finite)."""
        return self.heads.commit(ctx.state(GroupRound))

    def state_dict(self) -> dict[str, Any]:
        """Return the base state and the head's group (weights and clip scale)."""
        return {**super().state_dict(), "global_head": self.heads.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, every field checked before anything is restored.

        Raises
        ------
        CheckpointError
            Naming the file, the field and the fix, if ``global_head`` is missing,
            names another group than ``head``, or its arrays are not exactly a
            finite head of this run's shape.
        """
        heads = restore_shared(state, "global_head", HEAD_GROUP, self.new_heads())
        super().load_state_dict(state)
        self.heads = heads


SCHEME = register_scheme(
    Scheme(
        name="lg-fedavg",
        server=LGFedAvgStrategy,
        client=LGFedAvgClient,
        parse_options=LGFedAvgOptions.parse,
        default_family="cnn",
        description="LG-FedAvg: one head averaged across all nodes, personal bodies",
    )
)
