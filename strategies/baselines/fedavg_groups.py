"""FedAvg within each architecture group; nothing is shared across groups."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from flwr.app import RecordDict

from strategies.core.client import ClientAlgorithm
from strategies.core.context import RoundContext
from strategies.core.groups import GroupModels, GroupRound, fold_weights, required_entry
from strategies.core.registry import Scheme, no_options, register_scheme
from strategies.core.strategy import HeteroStrategy
from strategies.core.validation import ClientReply, ReplySchema
from tessera import wire

GroupOptionsT = TypeVar("GroupOptionsT")
"""The options type of a scheme built on group averaging (``None`` for ``fedavg-groups``)."""


class FedAvgGroupsStrategy(HeteroStrategy[GroupOptionsT]):
    """One global model per architecture, each averaged over its own group.

    Replies are folded through the injected aggregator as they arrive
    (:class:`~strategies.core.groups.GroupModels`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.models = GroupModels(
            self.aggregator,
            self.initial_arrays,
            self.pool_direction,
            self.reference_mix,
            cohort=self.env.run.aggregation.cohort_bound,
        )

    @property
    def group_arrays(self) -> dict[str, dict[str, np.ndarray]]:
        """The current global weights per architecture."""
        return self.models.arrays

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Config plus the node's group model (one record per group and round)."""
        content = super().node_content(ctx, node_id, arch)
        content[wire.ARRAYS] = ctx.share(
            (wire.ARRAYS, arch), lambda: wire.numpy_to_record(self.models.get(arch))
        )
        return content

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """Demand the group model's arrays, exactly."""
        return ReplySchema(arrays=self.array_spec(arch))

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Fold the reply's weights into its group's accumulator."""
        return fold_weights(self.models, ctx.state(GroupRound), reply)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Commit each group's aggregate."""
        done = self.models.commit(ctx.state(GroupRound))
        return {"group_sizes": done.sizes, "clipped": done.clips}

    def global_models(self) -> Mapping[str, dict[str, np.ndarray]]:
        """One model per architecture group."""
        return dict(self.models.arrays)

    def state_dict(self) -> dict[str, Any]:
        """Return the base state plus the group models."""
        return {**super().state_dict(), "group_models": self.models.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the base state and the group models (entry ``group_models``).

        The entry is required, and after a round it must hold at least one group
        (:meth:`~strategies.core.groups.GroupModels.load_state_dict`): a run must
        never resume at round N with fresh weights.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        super().load_state_dict(state)
        self.models.load_state_dict(
            required_entry(state, "group_models"), nonempty=self.completed_round >= 1
        )


SCHEME = register_scheme(
    Scheme(
        name="fedavg-groups",
        server=FedAvgGroupsStrategy,
        client=ClientAlgorithm,
        parse_options=no_options,
        default_family="cnn",
        description="FedAvg within each architecture group, nothing shared across groups",
        personalise=True,
        # no node weighs more than the cohort's median claimed size: in a group of two
        # or three a node that lies about its size would otherwise weigh as much as
        # the group's largest honest node while riding its bound (inflate-boost:
        # 0.69x of clean on Dirichlet(0.5) with the common 2, 0.83x with 1;
        # robustness page)
        config_defaults={"weight-cap": 1.0},
    )
)
