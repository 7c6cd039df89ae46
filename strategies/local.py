"""Local training only: the floor every heterogeneous scheme must beat."""

from __future__ import annotations

from typing import Any

from strategies.base import HeteroStrategy
from strategies.client import ClientAlgorithm
from strategies.registry import Scheme, no_options, register_scheme
from tessera.config import RunConfig


class LocalStrategy(HeteroStrategy):
    """Sends only the round's config; nothing is aggregated."""

    name = "local"


class LocalClient(ClientAlgorithm):
    """Keeps its own model across rounds and never shares it."""

    def __init__(self, *, run: RunConfig, options: Any) -> None:
        super().__init__(run=run, options=options)
        self.keeps_personal_model = True
        self.sends_weights = False


SCHEME = register_scheme(
    Scheme(
        name="local",
        server=LocalStrategy,
        client=LocalClient,
        parse_options=no_options,
        default_family="cnn",
        description="each client trains alone on its own architecture (no communication)",
    )
)
