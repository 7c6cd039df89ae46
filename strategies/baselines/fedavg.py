"""FedAvg: every participating client trains one shared architecture.

Two ways to make a mixed fleet fit one architecture (FedHeNN's Figure 1):

- default: the largest architecture that the weakest device can train (the minimum of
  the devices' own choices), so strong devices are held back;
- ``fedavg-arch=<name>`` forces one; with ``fedavg-exclude-unfit=true`` the devices
  whose own choice is smaller than it are left out of training instead (without an
  explicit ``fedavg-arch`` that flag picks the largest architecture any device chose).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from strategies.baselines.fedavg_groups import FedAvgGroupsStrategy
from strategies.core.client import ClientAlgorithm
from strategies.core.context import RoundContext
from strategies.core.nodes import NodeInfo
from strategies.core.registry import Scheme, register_scheme
from strategies.core.validation import ClientReply
from tessera.config import ConfigError, ConfigReader


@dataclass(frozen=True)
class FedAvgOptions:
    """Options of ``fedavg`` (run-config ``fedavg-arch``, ``fedavg-exclude-unfit``)."""

    arch: str | None
    exclude_unfit: bool

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FedAvgOptions:
        """Read the options from the run config."""
        r = ConfigReader(run_config, "run-config")
        arch = r.optional_str("fedavg-arch")
        if arch is not None:
            from models import list_models

            if arch not in list_models():
                raise ConfigError(
                    f"run-config 'fedavg-arch' is '{arch}', which is not a registered "
                    f"model; use one of {', '.join(list_models())} or leave it empty"
                )
        return cls(arch=arch, exclude_unfit=r.get("fedavg-exclude-unfit", bool, False))


FedAvgOptionsT = TypeVar("FedAvgOptionsT", bound=FedAvgOptions)
"""The options type of a scheme built on ``fedavg`` (a :class:`FedAvgOptions`)."""


class FedAvgStrategy(FedAvgGroupsStrategy[FedAvgOptionsT]):
    """One global model of one architecture, example-weighted averaging.

    ``fedavg-groups`` where every node is assigned the same architecture.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shared_arch: str | None = None

    @property
    def global_arrays(self) -> dict[str, np.ndarray] | None:
        """The global weights (``None`` before the shared architecture is chosen)."""
        if self.shared_arch is None:
            return None
        return self.models.get(self.shared_arch)

    def _choose_shared(self, nodes: Mapping[int, NodeInfo]) -> str:
        opts = self.options
        if opts.arch is not None:
            return opts.arch
        pick = max if opts.exclude_unfit else min
        # Size ranks only order architectures within one family: a node forced onto
        # another family (node-config 'arch') does not choose for the federation.
        own = [i for i in nodes.values() if i.family == self.env.family] or list(nodes.values())
        return pick(own, key=lambda i: i.size_rank).arch

    def assign_architectures(self, nodes: Mapping[int, NodeInfo]) -> dict[int, str | None]:
        """All nodes on the shared architecture; unfit ones out if so configured."""
        if not nodes:
            return {}
        if self.shared_arch is None:
            self.shared_arch = self._choose_shared(nodes)
        from models import model_entry

        entry = model_entry(self.shared_arch)
        out: dict[int, str | None] = {}
        for node_id, info in nodes.items():
            unfit = info.family == entry.family and info.size_rank < entry.size_rank
            out[node_id] = None if (unfit and self.options.exclude_unfit) else self.shared_arch
        return out

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Commit the average; name the shared architecture in the round record."""
        return {**super().aggregate(ctx, replies), "shared_arch": self.shared_arch}

    def describe(self) -> dict[str, Any]:
        """Options and the architecture chosen."""
        return {
            "fedavg-arch": self.options.arch,
            "fedavg-exclude-unfit": self.options.exclude_unfit,
            "shared_arch": self.shared_arch,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the groups' state plus the shared architecture."""
        return {**super().state_dict(), "shared_arch": self.shared_arch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the groups' state and the shared architecture, checked.

        ``shared_arch`` must be ``None`` (not chosen yet) or a registered model
        whose weights the group models hold.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        from tessera.checkpoint import refusal
        from tessera.state_checks import StateFileError

        try:
            shared = checked_shared_arch(state)
        except StateFileError as err:
            raise refusal(state, err) from err
        super().load_state_dict(state)
        if shared is not None and shared not in self.models.arrays and self.completed_round >= 1:
            raise refusal(
                state,
                StateFileError(
                    "shared_arch",
                    f"is '{shared}', whose weights field 'group_models.arrays' does not hold",
                ),
            )
        self.shared_arch = shared


def checked_shared_arch(state: Mapping[str, Any]) -> str | None:
    """Return checkpoint entry ``shared_arch``: ``None`` or a registered model's name.

    Raises
    ------
    StateFileError
        If it is neither.
    """
    from models import list_models
    from tessera.state_checks import StateFileError, get_str

    if state.get("shared_arch") is None:
        return None
    shared = get_str(state, "shared_arch")
    if shared not in list_models():
        raise StateFileError("shared_arch", f"is '{shared}', which is not a registered model")
    return shared


class FedAvgClient(ClientAlgorithm[FedAvgOptionsT]):
    """Cross-entropy training of the received global model."""


SCHEME = register_scheme(
    Scheme(
        name="fedavg",
        server=FedAvgStrategy,
        client=FedAvgClient,
        parse_options=FedAvgOptions.parse,
        default_family="cnn",
        description="FedAvg on one shared architecture (weakest device's, or forced)",
        personalise=True,
    )
)
