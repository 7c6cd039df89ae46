"""HeteroFL (Diao et al., ICLR 2021): width-only slices, averaged by coverage.

Each node trains the channel prefix ``[:c_out, :c_in]`` of every layer of one global
model at its own width ratio (run-config ``submodel-widths``, HeteroFL's levels
``1, 1/2, 1/4, 1/8`` by default); every global element is averaged over the nodes
whose slice covers it, weighted by their examples, and elements nobody covered keep
their value. Masked cross-entropy (``submodel-mask-classes``), the scaler
(``submodel-scaler``) and static batch norm (``norm="static-batch"``: statistics
recomputed on server data before every evaluation) are HeteroFL's; all are in
:mod:`strategies.submodel.scheme`. The coverage average goes through the injected
:class:`~strategies.aggregators.Aggregator`, so the default update bound (``clip-factor``)
and the robust aggregators that support coverage apply.

Not built: FedRolex's rolling window (the slice is always the prefix).
"""

from __future__ import annotations

from strategies.registry import Scheme, register_scheme
from strategies.submodel.scheme import SubModelClient, SubModelOptions, SubModelStrategy


class HeteroFLClient(SubModelClient):
    """A HeteroFL node: picks a width, keeps every block."""

    width_flexible = True
    depth_flexible = False


class HeteroFLStrategy(SubModelStrategy):
    """HeteroFL's server: prefix slices out, coverage average in."""

    name = "heterofl"
    width_flexible = True
    depth_flexible = False


SCHEME = register_scheme(
    Scheme(
        name="heterofl",
        server=HeteroFLStrategy,
        client=HeteroFLClient,
        parse_options=SubModelOptions.parse,
        default_family="preresnet",
        description="HeteroFL: width slices of one global model, averaged by coverage",
    )
)
