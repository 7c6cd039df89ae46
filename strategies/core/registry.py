"""Registry of schemes: one name, one module, server and client side together."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from strategies.core.client import ClientAlgorithm

if TYPE_CHECKING:
    from strategies.core.nodes import NodeInfo


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
class Scheme:
    """A registered scheme.

    Attributes
    ----------
    name : str
        The run-config ``strategy`` value.
    server : Callable[..., ServerRunner]
        Builds the server side: ``server(env=..., options=..., results=...)``.
    client : type[ClientAlgorithm]
        The client side.
    parse_options : Callable[[Mapping[str, Any]], Any]
        Parses the scheme's own run-config keys into a typed object.
    default_family : str
        The architecture family used when run-config ``model-family`` is empty.
    description : str
        One line for ``--help`` style listings and the README.
    family_of : Callable[[Any], str] or None
        For a scheme whose family depends on its options (``local`` with
        ``local-like``): the family given the parsed options; None: always
        ``default_family``.
    """

    name: str
    server: Callable[..., ServerRunner]
    client: type[ClientAlgorithm]
    parse_options: Callable[[Mapping[str, Any]], Any]
    default_family: str
    description: str
    family_of: Callable[[Any], str] | None = None

    def family(self, options: Any) -> str:
        """Return the architecture family when run-config ``model-family`` is empty."""
        return self.default_family if self.family_of is None else self.family_of(options)


_SCHEMES: dict[str, Scheme] = {}


def no_options(run_config: Mapping[str, Any]) -> None:
    """Option parser of schemes that have no options of their own."""
    return None


def register_scheme(scheme: Scheme) -> Scheme:
    """Register ``scheme``; a duplicate name raises :class:`SchemeError`."""
    if scheme.name in _SCHEMES:
        raise SchemeError(f"scheme '{scheme.name}' is already registered")
    _SCHEMES[scheme.name] = scheme
    return scheme


def get_scheme(name: str) -> Scheme:
    """Return the scheme called ``name``.

    Raises
    ------
    SchemeError
        If no scheme has that name; the message lists the known ones.
    """
    try:
        return _SCHEMES[name]
    except KeyError:
        raise SchemeError(
            f"unknown strategy '{name}'; set run-config 'strategy' to one of: "
            f"{', '.join(list_schemes())}"
        ) from None


def list_schemes() -> list[str]:
    """Names of all registered schemes, sorted."""
    return sorted(_SCHEMES)
