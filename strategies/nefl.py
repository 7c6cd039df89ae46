"""NeFL (Kang et al.): width and depth slices; each slice keeps its own normalisation.

Nodes train slices of one global model in width and depth. NeFL splits a slice's
parameters into *consistent* ones, shared by every slice that holds them and
averaged by coverage, and *inconsistent* ones that belong to one sub-model: here
the normalisation layers (batch-norm weight, bias and statistics), averaged only
among the nodes that train the same slice
(:meth:`~strategies.submodel.scheme.SubModelStrategy.private_keys`). Each slice
is evaluated with its own normalisation.

Not built: NeFL's learnable step-size parameters for depth-scaled residual blocks
(the zoo's blocks have none), and its inplace knowledge distillation.
"""

from __future__ import annotations

from typing import Any

from strategies.registry import Scheme, register_scheme
from strategies.submodel.scheme import (
    SubModelClient,
    SubModelOptions,
    SubModelStrategy,
    norm_entries,
)


class NeFLClient(SubModelClient):
    """A NeFL node: picks a width and a depth."""

    width_flexible = True
    depth_flexible = True


class NeFLStrategy(SubModelStrategy):
    """NeFL's server: shared weights by coverage, normalisation per slice."""

    name = "nefl"
    width_flexible = True
    depth_flexible = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._norms: dict[str, frozenset[str]] = {}

    def private_keys(self, arch: str) -> frozenset[str]:
        """Return the slice's normalisation entries (NeFL's inconsistent parameters)."""
        if arch not in self._norms:
            exchanged = set(self.array_spec(arch))
            self._norms[arch] = norm_entries(self.build_model(arch)) & exchanged
        return self._norms[arch]


SCHEME = register_scheme(
    Scheme(
        name="nefl",
        server=NeFLStrategy,
        client=NeFLClient,
        parse_options=SubModelOptions.parse,
        default_family="preresnet",
        description="NeFL: width x depth slices, shared weights by coverage, norms per slice",
    )
)
