"""What a SuperNode's node config says about the node: :class:`NodeConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.config.choices import ATTACKS, OMNISCIENT_ATTACKS
from tessera.config.reader import ConfigError, ConfigReader


@dataclass(frozen=True)
class NodeConfig:
    """What a SuperNode's ``--node-config`` (or simulation) says about this node.

    Attributes
    ----------
    partition_id, num_partitions : int | None
        The node's data partition (simulation, or deployment on shared data).
    arch : str | None
        Forces an architecture instead of the device-aware choice.
    device_profile : str | None
        Names a predefined device profile instead of probing.
    data_path : str | None
        A local ``.npz`` file the device trains on instead of a partition.
    state_dir : str | None
        A folder where the node keeps its state across restarts (profile,
        personal model, scheme state); ``None`` keeps it in memory only.
    attack : str | None
        Makes this node hostile (the attack harness, :mod:`client_app.attacks`):
        one of :data:`ATTACKS` but the :data:`OMNISCIENT_ATTACKS`, which need the
        round's honest updates and so the in-process grid.
    """

    partition_id: int | None
    num_partitions: int | None
    arch: str | None
    device_profile: str | None
    data_path: str | None
    state_dir: str | None = None
    attack: str | None = None

    @property
    def owner(self) -> str:
        """Which data this node trains on, as stored with its state."""
        if self.data_path is not None:
            return f"data:{self.data_path}"
        return f"partition:{self.partition_id}/{self.num_partitions}"

    @classmethod
    def from_flower(cls, node_config: Mapping[str, Any]) -> NodeConfig:
        """Parse Flower's ``context.node_config``.

        Raises
        ------
        ConfigError
            If the partition keys are inconsistent or neither data source is given.
        """
        r = ConfigReader(node_config, "node-config")
        keys = r.keys()
        pid = r.get("partition-id", int) if "partition-id" in keys else None
        nparts = r.get("num-partitions", int) if "num-partitions" in keys else None
        data_path = r.optional_str("data-path")
        if data_path is None:
            if pid is None or nparts is None:
                raise ConfigError(
                    "node-config needs either 'partition-id' and 'num-partitions' "
                    "or 'data-path'; start the SuperNode with e.g. --node-config "
                    '"partition-id=0 num-partitions=3"'
                )
            if nparts < 1 or not 0 <= pid < nparts:
                raise ConfigError(
                    f"node-config partition-id={pid} num-partitions={nparts} is "
                    "invalid: partition-id must be in [0, num-partitions)"
                )
        return cls(
            partition_id=pid,
            num_partitions=nparts,
            arch=r.optional_str("arch"),
            device_profile=r.optional_str("device-profile"),
            data_path=data_path,
            state_dir=r.optional_str("state-dir"),
            attack=_node_attack(r.optional_str("attack")),
        )


def _node_attack(value: str | None) -> str | None:
    if value is None:
        return None
    name = value.strip().lower()
    client_side = [a for a in ATTACKS if a not in OMNISCIENT_ATTACKS]
    if name in OMNISCIENT_ATTACKS:
        raise ConfigError(
            f"node-config 'attack' is '{value}', which forges its update from the honest "
            "updates of the round: only the in-process harness (benchmarks/robustness.py) "
            f"can run it; a node alone can run {', '.join(client_side)}"
        )
    if name not in ATTACKS:
        raise ConfigError(
            f"node-config 'attack' is '{value}'; use one of {', '.join(client_side)} or "
            "leave it out"
        )
    return name
