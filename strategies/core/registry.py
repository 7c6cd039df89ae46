"""Registry of schemes: one name, one module, server and client side together.

A :class:`Scheme` is the contract between a scheme and the rest of Tessera: its name
(the one source: :func:`register_scheme` gives it to the server classes), its
server and client, its typed options, the defaults it owns (architecture family,
normalisation) and a :attr:`~Scheme.validate` hook that refuses, with the fix, a run
config it would not honour. :func:`resolve_run` is how the ServerApp and the
ClientApp read a run config: both see the same resolved values.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from strategies.core.client import ClientAlgorithm
from tessera.config import ConfigError, RunConfig

if TYPE_CHECKING:
    from strategies.core.nodes import NodeInfo


OptionsT = TypeVar("OptionsT")
"""A scheme's options type (the result of its ``parse_options``)."""


class SchemeError(ValueError):
    """Unknown or duplicate scheme name."""


class ServerRunner(Protocol):
    """What the ServerApp reads from a scheme's server side, and nothing more."""

    @property
    def rounds(self) -> Sequence[Mapping[str, Any]]:
        """The round records so far (as written to ``metrics.jsonl``)."""
        ...

    @property
    def nodes(self) -> Mapping[int, NodeInfo]:
        """The nodes that passed the handshake."""
        ...

    @property
    def final_metrics(self) -> Mapping[str, Any]:
        """What the end-of-run hook returned (merged into ``summary.json``)."""
        ...

    def start(self, grid: Grid, *, num_rounds: int, timeout: float) -> Result:
        """Run rounds up to ``num_rounds``."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint (run-config ``resume``)."""
        ...


@dataclass(frozen=True)
class Scheme(Generic[OptionsT]):
    """A registered scheme.

    Attributes
    ----------
    name : str
        The run-config ``strategy`` value; :func:`register_scheme` sets it as the
        ``name`` of :attr:`server` (when it is a class) and of :attr:`server_classes`.
    server : Callable[..., ServerRunner]
        Builds the server side: ``server(env=..., options=..., results=...)``.
    client : type[ClientAlgorithm]
        The client side.
    parse_options : Callable[[Mapping[str, Any]], OptionsT]
        Parses the scheme's own run-config keys into a typed object.
    default_family : str
        The architecture family used when run-config ``model-family`` is empty.
    description : str
        One line for listings and the docs' generated scheme table.
    family_of : Callable[[OptionsT], str] or None
        For a scheme whose family depends on its options (``local`` with
        ``local-like``): the family given the parsed options; None: always
        ``default_family``.
    norm : str
        The normalisation used when run-config ``norm`` is empty (the sub-model
        schemes: ``"static-batch"``, their papers' choice).
    validate : Callable[[RunConfig, OptionsT], None] or None
        Raises :class:`~tessera.config.ConfigError` naming the key and the fix for a
        run config the scheme would not honour (a key it would ignore, an
        aggregator it cannot use).
    server_classes : tuple[type, ...]
        The classes a server *factory* may build (FedHeNN's two modes), named too.
    personalise : bool
        Whether run-config ``personalise`` applies: the scheme's nodes train the
        whole model they receive and send it back (weight sharing). A scheme whose
        nodes keep a personal model of their own already, or share a part of it,
        refuses any mode but ``none``.
    config_defaults : Mapping[str, float | bool | str]
        Run-config keys whose default the scheme owns: each replaces the value
        declared in ``pyproject.toml`` when the run leaves the key at that declared
        value (:func:`apply_config_defaults`). FlexiFed's direction check is
        ``trust-threshold=-0.1``: measured, the common 0 costs its clean accuracy on
        skewed data (``docs/pages/robustness.md``).
    """

    name: str
    server: Callable[..., ServerRunner]
    client: type[ClientAlgorithm[OptionsT]]
    parse_options: Callable[[Mapping[str, Any]], OptionsT]
    default_family: str
    description: str
    family_of: Callable[[OptionsT], str] | None = None
    norm: str = "batch"
    validate: Callable[[RunConfig, OptionsT], None] | None = None
    server_classes: tuple[type, ...] = ()
    personalise: bool = False
    config_defaults: Mapping[str, float | bool | str] = field(default_factory=dict)

    def family(self, options: OptionsT) -> str:
        """Return the architecture family when run-config ``model-family`` is empty."""
        return self.default_family if self.family_of is None else self.family_of(options)


@dataclass(frozen=True)
class ResolvedRun(Generic[OptionsT]):
    """A run config read for one scheme: the common keys, the scheme and its options."""

    run: RunConfig
    scheme: Scheme[OptionsT]
    options: OptionsT


_SCHEMES: dict[str, Scheme[Any]] = {}

SCHEME_MODULES: Mapping[str, str] = {
    "ensemble": "strategies.ensemble.scheme",
    "fedavg": "strategies.baselines.fedavg",
    "fedavg-groups": "strategies.baselines.fedavg_groups",
    "fedfa": "strategies.submodel.fedfa",
    "fedgh": "strategies.prototypes.fedgh",
    "fedhe": "strategies.felo.scheme",
    "fedhenn": "strategies.fedhenn.scheme",
    "fedprox": "strategies.baselines.fedprox",
    "fedproto": "strategies.prototypes.fedproto",
    "fedtgp": "strategies.prototypes.fedtgp",
    "felo": "strategies.felo.scheme",
    "flexifed": "strategies.submodel.flexifed",
    "flwr-fedavg": "strategies.baselines.flwr_fedavg",
    "fml": "strategies.fml.scheme",
    "heterofl": "strategies.submodel.heterofl",
    "lg-fedavg": "strategies.prototypes.lgfedavg",
    "local": "strategies.baselines.local",
    "nefl": "strategies.submodel.nefl",
    "velo": "strategies.felo.scheme",
}
"""Where each built-in scheme registers itself: the module :func:`get_scheme` imports.

Schemes are imported when first named, not all at once: a ClientApp imports only its
run's scheme. That matters in deployment, where Flower re-imports the app's modules
for every message (``flwr.common.object_ref.load_app`` unloads the modules of the
previous FAB directory), so every scheme imported up front is paid once a message.
A test checks that each listed module defines its scheme and that every built-in scheme is listed.
"""


def load_scheme_module(name: str) -> None:
    """Import the module that registers built-in scheme ``name`` (nothing if unknown)."""
    module = SCHEME_MODULES.get(name)
    if module is not None and name not in _SCHEMES:
        importlib.import_module(module)


def no_options(run_config: Mapping[str, Any]) -> None:
    """Option parser of schemes that have no options of their own."""
    return None


def register_scheme(scheme: Scheme[OptionsT]) -> Scheme[OptionsT]:
    """Register ``scheme`` and give its server classes its name.

    Raises
    ------
    SchemeError
        If the name is taken, or a server class already serves another scheme.
    """
    if scheme.name in _SCHEMES:
        raise SchemeError(f"scheme '{scheme.name}' is already registered")
    classes = ((scheme.server,) if isinstance(scheme.server, type) else ()) + scheme.server_classes
    for other in _SCHEMES.values():
        taken = [c for c in classes if c is other.server or c in other.server_classes]
        if taken:
            raise SchemeError(
                f"{taken[0].__name__} is already the server of scheme '{other.name}'; give "
                f"'{scheme.name}' a subclass of its own (its name is set from the registration)"
            )
    for cls in classes:
        cls.name = scheme.name  # type: ignore[attr-defined]
    _SCHEMES[scheme.name] = scheme
    return scheme


def resolve_run(run_config: Mapping[str, Any]) -> ResolvedRun[Any]:
    """Read a run config as its scheme reads it: common keys, scheme, options, checks.

    An empty ``norm`` becomes the scheme's own (:attr:`Scheme.norm`), a key left at
    its declared default takes the scheme's own where it has one
    (:attr:`Scheme.config_defaults`), and the scheme's :attr:`~Scheme.validate` hook
    runs. The ServerApp and every ClientApp call this, so both sides see the same
    values.

    Raises
    ------
    ConfigError
        If a value is invalid or the scheme refuses it (the message names the key
        and the fix).
    SchemeError
        If run-config ``strategy`` names no scheme.
    """
    strategy = RunConfig.strategy_of(run_config)
    scheme: Scheme[Any] = get_scheme(strategy)
    run_config = apply_config_defaults(scheme, run_config)
    run = RunConfig.from_flower(run_config, default_norm=scheme.norm)
    options = scheme.parse_options(run_config)
    check_personalise(scheme, run, options)
    check_weight_keys(scheme, run, options)
    if scheme.validate is not None:
        scheme.validate(run, options)
    return ResolvedRun(run, scheme, options)


def apply_config_defaults(
    scheme: Scheme[OptionsT], run_config: Mapping[str, Any]
) -> Mapping[str, Any]:
    """Return ``run_config`` with the scheme's own defaults where the run left the declared ones.

    Flower sends the whole ``[tool.flwr.app.config]`` table, overrides applied, so a
    key whose value equals the declared default was not set by the run (or was set
    to that value, which reads the same); such a key of
    :attr:`Scheme.config_defaults` takes the scheme's value. A key set to anything
    else keeps it. Run-config ``scheme-defaults=false`` keeps every value as given
    (a run that wants the declared value itself). Where the declared table cannot be
    read (an app without its ``pyproject.toml``), nothing can be told apart and the
    values stand.

    Examples
    --------
    >>> from tessera.config.declared import declared_defaults
    >>> flexifed = get_scheme("flexifed")
    >>> declared_defaults()["trust-threshold"], dict(flexifed.config_defaults)
    (0.0, {'trust-threshold': -0.1})
    >>> apply_config_defaults(flexifed, {"trust-threshold": 0.0})["trust-threshold"]
    -0.1
    >>> apply_config_defaults(flexifed, {"trust-threshold": 0.2})["trust-threshold"]
    0.2
    >>> given = {"trust-threshold": 0.0, "scheme-defaults": False}
    >>> apply_config_defaults(flexifed, given)["trust-threshold"]
    0.0
    """
    from tessera.config.declared import changed_keys, declared_defaults
    from tessera.config.reader import ConfigReader

    if not scheme.config_defaults:
        return run_config
    if "scheme-defaults" in run_config and not ConfigReader(run_config, "run-config").get(
        "scheme-defaults", bool
    ):
        return run_config
    if declared_defaults() is None:
        return run_config
    keys = [key for key in scheme.config_defaults if key in run_config]
    changed = set(changed_keys(run_config, keys))
    own = {key: scheme.config_defaults[key] for key in keys if key not in changed}
    return {**run_config, **own} if own else run_config


WEIGHT_ONLY_KEYS = (
    "aggregator",
    "clip-factor",
    "clip-ceiling",
    "bound-growth",
    "cohort-bound",
    "server-trust",
    "trust-threshold",
    "clip-norm",
    "krum-byzantine",
    "pre-aggregation",
    "bucket-size",
    "cc-tau",
    "cc-iterations",
)
"""Run-config keys that only act on weight updates (the Aggregator seam and its bounds)."""


def check_weight_keys(scheme: Scheme[OptionsT], run: RunConfig, options: OptionsT) -> None:
    """Refuse a changed weight-only key for a scheme whose nodes send no weights.

    FedHe, FedProto, FedTGP, FedGH, ``local`` (and Felo without weight sharing,
    FedHeNN across architectures) merge no weights, so :data:`WEIGHT_ONLY_KEYS` would
    be ignored; a value other than the declared default
    (:func:`~tessera.config.declared.changed_keys`), or the scheme's own
    (:attr:`Scheme.config_defaults`), is refused, naming the keys that bound what
    these schemes do exchange.

    Raises
    ------
    ConfigError
        Naming the changed keys and the fix.
    """
    from tessera.config.declared import changed_keys

    if scheme.client(run=run, options=options).sends_weights:
        return
    values = run.to_dict()
    changed = [
        key
        for key in changed_keys(values, WEIGHT_ONLY_KEYS)
        if key not in scheme.config_defaults or values[key] != scheme.config_defaults[key]
    ]
    if changed:
        raise ConfigError(
            f"run-config {', '.join(repr(k) for k in changed)} set, but '{scheme.name}' "
            "sends no weights, so they would be ignored; leave them at their defaults "
            "(class knowledge and prototypes are bounded by 'knowledge-clip-factor' and "
            "merged by 'knowledge-merge')"
        )


def personalisable_schemes() -> list[str]:
    """Return the registered schemes that accept run-config ``personalise``."""
    return [name for name in list_schemes() if _SCHEMES[name].personalise]


def check_personalise(scheme: Scheme[OptionsT], run: RunConfig, options: OptionsT) -> None:
    """Refuse run-config ``personalise`` for a scheme whose nodes share no whole model.

    Raises
    ------
    ConfigError
        If ``personalise`` is not ``none`` and the scheme is not
        :attr:`Scheme.personalise`, or its nodes send no weights with these options
        (Felo without ``felo-share-weights``): the message names the schemes that
        accept it.
    """
    mode = run.personalise.mode
    if mode == "none":
        return
    if not scheme.personalise or not scheme.client(run=run, options=options).sends_weights:
        raise ConfigError(
            f"run-config 'personalise' is '{mode}' but '{scheme.name}' shares no whole "
            "model with its nodes (they keep a personal model or share a part of it "
            "already); set personalise='none', or use one of "
            f"{', '.join(personalisable_schemes())}"
        )


def get_scheme(name: str) -> Scheme[Any]:
    """Return the scheme called ``name``.

    Raises
    ------
    SchemeError
        If no scheme has that name; the message lists the known ones.
    """
    load_scheme_module(name)
    try:
        return _SCHEMES[name]
    except KeyError:
        raise SchemeError(
            f"unknown strategy '{name}'; set run-config 'strategy' to one of: "
            f"{', '.join(list_schemes())}"
        ) from None


def list_schemes() -> list[str]:
    """Names of all registered schemes (the built-in ones imported first), sorted."""
    for name in SCHEME_MODULES:
        load_scheme_module(name)
    return sorted(_SCHEMES)
