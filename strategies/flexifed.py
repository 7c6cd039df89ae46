"""FlexiFed (Wang et al.): depth-only slices, common layers shared, the rest personal.

Nodes train slices of one global model that differ in depth only (every section
keeps its first blocks, all channels). FlexiFed's aggregation strategies, run-config
``flexifed-strategy``:

- ``max-common`` (default): every layer is averaged over every node whose
  architecture has it (layers are identified by their key, ``sections.{s}.{b}``),
  which with nested depth slices is coverage averaging;
- ``basic-common``: only the layers that *every* architecture in the federation has
  are averaged across all nodes; the others are averaged only among the nodes of
  the same architecture, which keep them as their personal layers.

Each architecture's model (the common layers and its own) is evaluated on the
server test set; clients report personalised accuracy on their own test split.

Not built: ``clustered-common`` (it needs a rule to cluster architectures, which a
single family's depth slices do not give).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strategies.registry import Scheme, register_scheme
from strategies.submodel.scheme import SubModelClient, SubModelOptions, SubModelStrategy
from tessera.config import ConfigError, ConfigReader

STRATEGIES = ("max-common", "basic-common")
"""FlexiFed's aggregation strategies built here."""


@dataclass(frozen=True)
class FlexiFedOptions(SubModelOptions):
    """The sub-model options plus ``flexifed-strategy``."""

    strategy: str = "max-common"

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FlexiFedOptions:
        """Read the options from the run config."""
        strategy = ConfigReader(run_config, "run-config").get(
            "flexifed-strategy", str, "max-common"
        )
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"run-config 'flexifed-strategy' is '{strategy}'; use one of "
                f"{', '.join(STRATEGIES)} (clustered-common is not built)"
            )
        return cls(**cls.read(run_config), strategy=strategy)


class FlexiFedClient(SubModelClient):
    """A FlexiFed node: picks a depth, keeps every channel."""

    width_flexible = False
    depth_flexible = True


class FlexiFedStrategy(SubModelStrategy):
    """FlexiFed's server (module docstring)."""

    name = "flexifed"
    width_flexible = False
    depth_flexible = True

    def private_keys(self, arch: str) -> frozenset[str]:
        """Basic-Common: the layers of ``arch`` that some architecture in use lacks."""
        if self.options.strategy != "basic-common":
            return frozenset()
        archs = set(self.assignment.values()) | {arch}
        keys = [frozenset(self.array_spec(a)) for a in sorted(archs)]
        common = frozenset.intersection(*keys)
        return frozenset(self.array_spec(arch)) - common


SCHEME = register_scheme(
    Scheme(
        name="flexifed",
        server=FlexiFedStrategy,
        client=FlexiFedClient,
        parse_options=FlexiFedOptions.parse,
        default_family="preresnet",
        description="FlexiFed: depth slices, common layers shared, the others personal",
    )
)
