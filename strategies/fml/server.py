"""FML's server: one global meme, sent to every node, averaged over all of them.

Every round it sends the global meme (one record shared by all messages) and
demands exactly the meme's arrays back (names, shapes, float32, finite: anything
else is rejected with its reason before any arithmetic). The memes of all nodes,
whatever their personal architectures, are folded as one group of
:class:`~strategies.core.groups.GroupModels` through the run's aggregator (the
bounded ``mean`` by default, example-weighted with each reply's capped weight), as
LG-FedAvg averages its head. The meme is a whole model, so run-config
``server-trust`` can check where each update points (the server's own update of
the meme on its pool). The global accuracy is the meme's on the server's test set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
from flwr.app import RecordDict

from strategies.core.context import RoundContext
from strategies.core.direction import PoolMix
from strategies.core.groups import GroupModels, GroupRound, SharedGroup, restore_shared
from strategies.core.strategy import HeteroStrategy
from strategies.core.validation import ClientReply, ReplySchema
from strategies.fml.options import FMLOptions
from tessera import wire

__all__ = ["MEME_GROUP", "FMLStrategy"]

MEME_GROUP = "meme"
"""The one group of the server's :class:`GroupModels`: the meme every node shares."""


class FMLStrategy(HeteroStrategy[FMLOptions]):
    """Server of ``fml`` (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.memes = SharedGroup(MEME_GROUP, self.new_memes())

    def new_memes(self) -> GroupModels:
        """Return the meme's :class:`GroupModels`, at the seeded initial meme."""
        return GroupModels(
            self.aggregator, self._initial_group, self._meme_direction, self.reference_mix
        )

    def _initial_group(self, group: str) -> dict[str, np.ndarray]:
        if group != MEME_GROUP:
            raise ValueError(f"fml has one group, '{MEME_GROUP}'")
        return self.initial_arrays(self.options.meme_arch)

    def _meme_direction(
        self, group: str, weights: Mapping[str, np.ndarray], mix: PoolMix | None
    ) -> dict[str, np.ndarray] | None:
        return self.pool_direction(self.options.meme_arch, weights, mix)

    def global_meme(self) -> Mapping[str, np.ndarray]:
        """Return the current global meme (its ``state_dict`` names, exchanged entries)."""
        return self.memes.get()

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Config (the node's own ``arch``) and the global meme as the weights record."""
        content = super().node_content(ctx, node_id, arch)
        content[wire.ARRAYS] = ctx.share(
            wire.ARRAYS, lambda: wire.numpy_to_record(self.global_meme())
        )
        return content

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """Exactly the meme's arrays, whatever the node's own architecture."""
        return ReplySchema(arrays=self.array_spec(self.options.meme_arch))

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Fold the reply's meme (at its capped weight) into the round's one group."""
        return self.memes.fold(ctx.state(GroupRound), reply)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Replace the global meme by the aggregate (all or nothing, finite)."""
        return self.memes.commit(ctx.state(GroupRound))

    def global_models(self) -> Mapping[str, dict[str, np.ndarray]]:
        """Return the meme, evaluated on the server's test set as the run's global accuracy."""
        return {self.options.meme_arch: dict(self.global_meme())}

    def describe(self) -> dict[str, Any]:
        """Return the options (kebab-case keys, as in the run config)."""
        return {f"fml-{k.replace('_', '-')}": v for k, v in asdict(self.options).items()}

    def state_dict(self) -> dict[str, Any]:
        """Return the base state and the meme's group (weights and clip scale)."""
        return {**super().state_dict(), "global_meme": self.memes.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, every field checked before anything is restored.

        Raises
        ------
        CheckpointError
            Naming the file, the field and the fix, if ``global_meme`` is missing,
            names another group than ``meme``, or its arrays are not exactly a
            finite ``fml-meme-arch`` of this task.
        """
        memes = restore_shared(state, "global_meme", MEME_GROUP, self.new_memes())
        super().load_state_dict(state)
        self.memes = memes
