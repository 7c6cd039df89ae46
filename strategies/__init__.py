"""Federated schemes: one module or package per scheme, each registering itself on import.

The machinery every scheme shares (the round loop, the node table, aggregation,
reply validation, the client lifecycle, the scheme registry) lives in
:mod:`strategies.core`; the sub-model schemes (HeteroFL, FlexiFed, NeFL, FedFA) share
:mod:`strategies.submodel`, one module each.

``get_scheme(name)`` returns a :class:`~strategies.core.registry.Scheme` holding the
scheme's server strategy, its client algorithm and its option parser.
"""

from strategies import (
    ensemble,
    fedavg,
    fedavg_groups,
    fedhenn,
    fedprox,
    felo,
    flwr_fedavg,
    local,
    submodel,
)
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
    "ensemble",
    "fedavg",
    "fedavg_groups",
    "fedfa",
    "fedhenn",
    "fedprox",
    "felo",
    "flexifed",
    "flwr_fedavg",
    "get_scheme",
    "heterofl",
    "list_schemes",
    "local",
    "nefl",
    "register_scheme",
    "resolve_run",
    "robust",
    "submodel",
]
