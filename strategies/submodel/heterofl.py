"""HeteroFL (Diao et al., ICLR 2021): width-only slices, averaged by coverage.

Each node trains the channel prefix ``[:c_out, :c_in]`` of every layer of one global
model at its own width ratio (run-config ``submodel-widths``, HeteroFL's levels
``1, 1/2, 1/4, 1/8`` by default); every global element is averaged over the nodes
whose slice covers it, weighted by their examples, and elements nobody covered keep
their value. Masked cross-entropy (``submodel-mask-classes``), the scaler
(``submodel-scaler``) and static batch norm (``norm="static-batch"``: statistics
recomputed on server data before every evaluation) are HeteroFL's; all are in
:mod:`strategies.submodel.server`. The coverage average goes through the injected
:class:`~strategies.core.aggregators.Aggregator`, so the default update bound (``clip-factor``)
and the robust aggregators that support coverage apply.

With run-config ``heterofl-rolling=true`` the slices follow FedRolex's rolling window
(Alam et al., NeurIPS 2022) instead of the fixed prefix: after every round the
server rolls each channel dimension of the global model back by one
(:func:`~strategies.submodel.roll_channels`, which leaves the function it computes
unchanged), so the prefix the next round cuts starts one channel further on (round ``r``
trains channels ``r-1 .. r-2+c`` mod ``C`` of the original model), and
over ``C`` rounds every channel of a width-``C`` layer is trained by narrow nodes too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from strategies.core.context import RoundContext
from strategies.core.registry import Scheme, register_scheme
from strategies.core.validation import ClientReply
from strategies.submodel.client import SubModelClient
from strategies.submodel.extract import roll_channels
from strategies.submodel.options import SubModelOptions, validate_submodel
from strategies.submodel.server import SubModelStrategy
from tessera.config import ConfigReader


@dataclass(frozen=True)
class HeteroFLOptions(SubModelOptions):
    """The sub-model options plus ``heterofl-rolling`` (FedRolex's window)."""

    rolling: bool = False
    width_flexible: bool = True
    depth_flexible: bool = False

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> HeteroFLOptions:
        """Read the options from the run config."""
        rolling = ConfigReader(run_config, "run-config").get("heterofl-rolling", bool, False)
        return cls(**cls.read(run_config), rolling=rolling)


class HeteroFLClient(SubModelClient[HeteroFLOptions]):
    """A HeteroFL node: picks a width, keeps every block."""


class HeteroFLStrategy(SubModelStrategy[HeteroFLOptions]):
    """HeteroFL's server: prefix slices out, coverage average in."""

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Commit the coverage average; with ``heterofl-rolling``, move the window by one."""
        out = super().aggregate(ctx, replies)
        if self.options.rolling:
            self.models.arrays[self.global_name] = roll_channels(self.global_state, self.layout, -1)
            out["window_shift"] = 1
        return out


SCHEME = register_scheme(
    Scheme(
        name="heterofl",
        server=HeteroFLStrategy,
        client=HeteroFLClient,
        parse_options=HeteroFLOptions.parse,
        default_family="preresnet",
        norm="static-batch",
        validate=validate_submodel,
        description="HeteroFL: width slices of one global model, averaged by coverage "
        "(FedRolex's rolling window as an option)",
        personalise=True,
    )
)
