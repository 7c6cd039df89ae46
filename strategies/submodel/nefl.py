"""NeFL (Kang et al.): width and depth slices; each slice keeps its own normalisation and steps.

Nodes train slices of one global model in width and depth. NeFL splits a slice's
parameters into *consistent* ones, shared by every slice that holds them and
averaged by coverage, and *inconsistent* ones that belong to one sub-model,
averaged only among the nodes that train the same slice
(:meth:`~strategies.submodel.server.SubModelStrategy.private_keys`):

- the normalisation layers (batch-norm weight, bias and statistics);
- the learnable step sizes of the residual blocks (run-config
  ``nefl-learnable-step``, default true): NeFL reads a residual network as an ODE
  solver, ``x + s * F(x)``, and learns each block's step ``s`` (initialised to 1,
  as in the authors' code) per sub-model, so a slice that skips blocks can learn to
  take longer steps. The step is the block's ``step`` entry
  (:func:`models.layers.block_step`); the zoo builds it when ``block_step`` is on.

Each slice is evaluated with its own normalisation and steps. Not built: NeFL's
in-place knowledge distillation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.layers import BLOCK_STEP
from strategies.core.registry import Scheme, register_scheme
from strategies.submodel.client import SubModelClient, norm_entries
from strategies.submodel.options import SubModelOptions, validate_submodel
from strategies.submodel.server import SubModelStrategy
from tessera.config import ConfigReader


@dataclass(frozen=True)
class NeFLOptions(SubModelOptions):
    """The sub-model options plus ``nefl-learnable-step`` (per-block step sizes)."""

    learnable_step: bool = True

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> NeFLOptions:
        """Read the options from the run config."""
        step = ConfigReader(run_config, "run-config").get("nefl-learnable-step", bool, True)
        return cls(**cls.read(run_config), learnable_step=step)

    def model_kwargs(self) -> dict[str, Any]:
        """Build every slice with block step sizes when ``learnable_step``."""
        return {"block_step": self.learnable_step}


def step_entries(keys: frozenset[str] | set[str]) -> frozenset[str]:
    """Return the keys that are blocks' step sizes (last part ``step``).

    Examples
    --------
    >>> sorted(step_entries({"sections.0.1.step", "sections.0.1.conv1.weight", "stem.weight"}))
    ['sections.0.1.step']
    """
    return frozenset(k for k in keys if k.rsplit(".", 1)[-1] == BLOCK_STEP)


class NeFLClient(SubModelClient[NeFLOptions]):
    """A NeFL node: picks a width and a depth."""


class NeFLStrategy(SubModelStrategy[NeFLOptions]):
    """NeFL's server: shared weights by coverage, normalisation and steps per slice."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._private: dict[str, frozenset[str]] = {}

    def private_keys(self, arch: str) -> frozenset[str]:
        """Return the slice's normalisation and step entries (NeFL's inconsistent parameters)."""
        if arch not in self._private:
            exchanged = frozenset(self.array_spec(arch))
            norms = norm_entries(self.build_model(arch)) & exchanged
            self._private[arch] = norms | step_entries(exchanged)
        return self._private[arch]


SCHEME = register_scheme(
    Scheme(
        name="nefl",
        server=NeFLStrategy,
        client=NeFLClient,
        parse_options=NeFLOptions.parse,
        default_family="preresnet",
        norm="static-batch",
        validate=validate_submodel,
        description="NeFL: width x depth slices, shared weights by coverage, norms and "
        "block step sizes per slice",
        personalise=True,
    )
)
