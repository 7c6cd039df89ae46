"""Federated schemes: a package each, or a module in a family's package.

Each registers itself on import. The machinery every scheme shares (the round
loop, the node table, aggregation, reply validation, the client lifecycle, the
scheme registry) lives in
:mod:`strategies.core`. FedHeNN (:mod:`strategies.fedhenn`), Felo/Velo/FedHe
(:mod:`strategies.felo`), the heterogeneous ensemble (:mod:`strategies.ensemble`)
and FML (:mod:`strategies.fml`) are a package each; the sub-model schemes
(HeteroFL, FlexiFed, NeFL, FedFA) share :mod:`strategies.submodel`, the prototype
schemes (FedProto, FedTGP)
:mod:`strategies.prototypes` and the baselines (``fedavg-groups``, ``fedavg``,
``fedprox``, ``local``, ``flwr-fedavg``) :mod:`strategies.baselines`, one module
each.

``get_scheme(name)`` returns a :class:`~strategies.core.registry.Scheme` holding the
scheme's server strategy, its client algorithm and its option parser.
"""

from strategies import baselines, ensemble, fedhenn, felo, fml, prototypes, submodel
from strategies.baselines import fedavg, fedavg_groups, fedprox, flwr_fedavg, local
from strategies.core import robust
from strategies.core.registry import (
    Scheme,
    SchemeError,
    get_scheme,
    list_schemes,
    register_scheme,
    resolve_run,
)
from strategies.submodel import fedfa, flexifed, heterofl, nefl

__all__ = [
    "Scheme",
    "SchemeError",
    "baselines",
    "ensemble",
    "fedavg",
    "fedavg_groups",
    "fedfa",
    "fedhenn",
    "fedprox",
    "felo",
    "flexifed",
    "flwr_fedavg",
    "fml",
    "get_scheme",
    "heterofl",
    "list_schemes",
    "local",
    "nefl",
    "prototypes",
    "register_scheme",
    "resolve_run",
    "robust",
    "submodel",
]
