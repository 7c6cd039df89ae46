"""Federated schemes: a package each, or a module in a family's package.

Each registers itself on import, and is imported when first named
(:func:`get_scheme`; :data:`~strategies.core.registry.SCHEME_MODULES` says where each
lives), so a ClientApp pays only for its run's scheme. The machinery every scheme shares (the round
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

from strategies.core.registry import (
    Scheme,
    SchemeError,
    get_scheme,
    list_schemes,
    register_scheme,
    resolve_run,
)

__all__ = [
    "Scheme",
    "SchemeError",
    "get_scheme",
    "list_schemes",
    "register_scheme",
    "resolve_run",
]
