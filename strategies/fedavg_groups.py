"""FedAvg within each architecture group; nothing is shared across groups."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import RecordDict

from strategies.aggregation import weighted_average
from strategies.base import HeteroStrategy
from strategies.client import ClientAlgorithm
from strategies.registry import Scheme, no_options, register_scheme
from strategies.validation import ClientReply
from tessera import wire


class FedAvgGroupsStrategy(HeteroStrategy):
    """One global model per architecture, each averaged over its own group."""

    name = "fedavg-groups"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.group_arrays: dict[str, dict[str, np.ndarray]] = {}

    def node_content(self, server_round: int, node_id: int, arch: str) -> RecordDict:
        """Config plus the node's group model."""
        content = super().node_content(server_round, node_id, arch)
        if arch not in self.group_arrays:
            self.group_arrays[arch] = self.initial_arrays(arch)
        content[wire.ARRAYS] = wire.numpy_to_record(self.group_arrays[arch])
        return content

    def aggregate(self, server_round: int, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Example-weighted FedAvg inside each architecture group."""
        groups: dict[str, list[ClientReply]] = defaultdict(list)
        for reply in replies:
            groups[reply.arch].append(reply)
        for arch, members in groups.items():
            self.group_arrays[arch] = weighted_average(
                [m.arrays for m in members if m.arrays is not None],
                [m.num_examples for m in members],
            )
        return {"group_sizes": {a: len(m) for a, m in sorted(groups.items())}}

    def global_models(self) -> Mapping[str, dict[str, np.ndarray]]:
        """One model per architecture group."""
        return dict(self.group_arrays)


SCHEME = register_scheme(
    Scheme(
        name="fedavg-groups",
        server=FedAvgGroupsStrategy,
        client=ClientAlgorithm,
        parse_options=no_options,
        default_family="cnn",
        description="FedAvg within each architecture group, nothing shared across groups",
    )
)
