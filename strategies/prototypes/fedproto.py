"""FedProto (Tan et al., AAAI 2022): prototypes exchanged, count-weighted, personal models.

Each client trains its own (projected) model with cross-entropy plus
``proto-lambda`` times the squared distance of its features to the global
prototype of their class (:mod:`strategies.prototypes.client`), then sends its
per-class mean features and counts. The server averages them per class, weighted
by the counts (the paper's equation (5)), through the robust merge
(:mod:`strategies.prototypes.merge`), and sends the averages back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strategies.core.registry import Scheme, register_scheme
from strategies.prototypes.client import PrototypeClient
from strategies.prototypes.options import PrototypeOptions
from strategies.prototypes.server import PrototypeStrategy

__all__ = ["SCHEME", "FedProtoClient", "FedProtoOptions", "FedProtoStrategy"]


@dataclass(frozen=True)
class FedProtoOptions(PrototypeOptions):
    """FedProto's options: the shared ``feature-dim`` and ``proto-lambda``."""

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FedProtoOptions:
        """Read the options from the run config."""
        return cls(**cls.read(run_config))


class FedProtoClient(PrototypeClient[FedProtoOptions]):
    """A FedProto node: CE plus the prototype term, per-class means sent back."""


class FedProtoStrategy(PrototypeStrategy[FedProtoOptions]):
    """FedProto's server: the count-weighted (robust) merge is the next global prototype."""


SCHEME = register_scheme(
    Scheme(
        name="fedproto",
        server=FedProtoStrategy,
        client=FedProtoClient,
        parse_options=FedProtoOptions.parse,
        default_family="cnn",
        description="FedProto: per-class prototypes averaged by counts, personal models",
    )
)
