"""FedProx: FedAvg plus a proximal term mu/2 * ||w - w_global||^2 in the local loss."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from strategies.baselines.fedavg import FedAvgClient, FedAvgOptions, FedAvgStrategy
from strategies.core.client import RoundInput
from strategies.core.registry import Scheme, register_scheme
from tessera.config import ConfigError, ConfigReader
from tessera.node_state import NodeState
from tessera.training import LossFn, proximal_term


@dataclass(frozen=True)
class FedProxOptions(FedAvgOptions):
    """FedAvg's options plus ``proximal-mu``."""

    proximal_mu: float = 0.01

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FedProxOptions:
        """Read the options from the run config."""
        base = FedAvgOptions.parse(run_config)
        mu = ConfigReader(run_config, "run-config").get("proximal-mu", float, 0.01)
        if mu < 0:
            raise ConfigError(
                f"run-config 'proximal-mu' is {mu}; use a non-negative value, e.g. 0.01"
            )
        return cls(arch=base.arch, exclude_unfit=base.exclude_unfit, proximal_mu=mu)


class FedProxStrategy(FedAvgStrategy[FedProxOptions]):
    """FedAvg's server; the proximal term is the clients' alone.

    Each client reads ``proximal-mu`` from the run config it shares with the server,
    so nothing is sent for it.
    """


class FedProxClient(FedAvgClient[FedProxOptions]):
    """Cross-entropy plus the proximal term towards the received global weights."""

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Snapshot the global weights as the proximal anchor."""
        self._anchor = [p.detach().clone() for p in model.parameters()]

    def loss_fn(self) -> LossFn:
        """``CE + mu/2 * ||w - w_global||^2``."""
        mu = float(self.options.proximal_mu)
        anchor = self._anchor

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            task = nn.functional.cross_entropy(model(x), y)
            total: torch.Tensor = task + 0.5 * mu * proximal_term(model, anchor)
            return total

        return loss


SCHEME = register_scheme(
    Scheme(
        name="fedprox",
        server=FedProxStrategy,
        client=FedProxClient,
        parse_options=FedProxOptions.parse,
        default_family="cnn",
        description="FedProx (FedAvg + proximal term) on one shared architecture",
        personalise=True,
    )
)
