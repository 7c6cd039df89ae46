"""Typed, range-checked reads of Flower's flat config mappings.

:class:`ConfigReader` converts one kebab-case key at a time and applies the key's
declared range (:data:`LIMITS`); :func:`recording_reads` collects which keys were
read, so a test can check that the code reads exactly the keys ``pyproject.toml``
declares.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar, cast

T = TypeVar("T", int, float, str, bool)

MAX_ROUNDS = 100_000
"""Largest number of rounds any round-counting key accepts."""
MAX_NODES = 100_000
"""Largest number of nodes any node-counting key accepts (a fleet of 1e5 nodes)."""
MAX_FLOAT32 = 1e38
"""Largest magnitude a float32 weight holds with room to spare (float32 max 3.4e38)."""


@dataclass(frozen=True)
class Limit:
    """The range a numeric run-config key, or each item of a comma-separated list, lies in.

    Attributes
    ----------
    high : float
        Largest accepted value.
    fix : str
        What to do instead, for the error message.
    low : float or None
        Smallest accepted value; ``None`` where the key's own check (in
        :meth:`RunConfig.validate` or the scheme's options) gives the lower bound.
    """

    high: float
    fix: str
    low: float | None = None

    def check(self, key: str, raw: object, value: float) -> None:
        """Raise :class:`ConfigError` naming ``key``, ``raw`` and the fix if out of range."""
        if self.low is not None and not self.low <= value <= self.high:
            raise ConfigError(
                f"run-config key '{key}' has value {raw!r}, outside "
                f"[{_number(self.low)}, {_number(self.high)}]: {self.fix}"
            )
        if value > self.high:
            raise ConfigError(
                f"run-config key '{key}' has value {raw!r}, above the largest accepted "
                f"{_number(self.high)}: {self.fix}"
            )


def _number(value: float) -> str:
    """Print a bound as people write it: whole numbers in full, others in short form."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else f"{value:g}"


LIMITS: dict[str, Limit] = {
    # rounds and round counts
    "num-server-rounds": Limit(MAX_ROUNDS, f"use 1 to {MAX_ROUNDS} rounds"),
    "max-failed-rounds": Limit(MAX_ROUNDS, f"use 1 to {MAX_ROUNDS} skipped rounds"),
    "checkpoint-every": Limit(MAX_ROUNDS, f"use 0 (never) to {MAX_ROUNDS} rounds"),
    "align-every": Limit(MAX_ROUNDS, f"use 1 to {MAX_ROUNDS} rounds"),
    "cvae-interval": Limit(MAX_ROUNDS, f"use 1 to {MAX_ROUNDS} rounds"),
    "cvae-history": Limit(MAX_ROUNDS, f"use 0 (all rounds) to {MAX_ROUNDS} rounds"),
    "ensemble-tune-every": Limit(MAX_ROUNDS, f"use 0 (last round only) to {MAX_ROUNDS}"),
    # node counts
    "min-nodes": Limit(MAX_NODES, f"use 1 to {MAX_NODES} nodes"),
    "min-train-nodes": Limit(MAX_NODES, f"use 1 to {MAX_NODES} nodes"),
    "min-replies": Limit(MAX_NODES, f"use 1 to {MAX_NODES} replies"),
    "krum-byzantine": Limit(MAX_NODES, f"use 0 to {MAX_NODES} hostile nodes to tolerate"),
    "bucket-size": Limit(MAX_NODES, f"use 1 to {MAX_NODES} updates per bucket"),
    "cc-iterations": Limit(1_000, "use 1 to 1000 iterations"),
    # data and model sizes
    "classes-per-client": Limit(100_000, "use 1 to 100000 classes"),
    "local-epochs": Limit(1_000, "use 1 to 1000 local epochs"),
    "personalise-epochs": Limit(1_000, "use 1 to 1000 epochs"),
    "batch-size": Limit(65_536, "use a batch size of 1 to 65536"),
    "rad-size": Limit(1_000_000, "use at most 1000000 samples (capped at the server pool)"),
    "rad-batch": Limit(1_000_000, "use 0 (the whole RAD) or at most 1000000 rows"),
    "feature-dim": Limit(65_536, "use a feature size of 1 to 65536"),
    "cvae-latent-dim": Limit(65_536, "use a size of 1 to 65536"),
    "cvae-hidden-dim": Limit(65_536, "use a width of 1 to 65536"),
    "cvae-epochs": Limit(100_000, "use 1 to 100000 epochs"),
    "cvae-samples": Limit(100_000, "use 1 to 100000 samples per class"),
    "fedtgp-hidden-dim": Limit(65_536, "use a width of 1 to 65536"),
    "fedtgp-server-epochs": Limit(100_000, "use 1 to 100000 epochs"),
    "fedgh-server-epochs": Limit(100_000, "use 1 to 100000 epochs"),
    # optimiser budgets
    "ensemble-trials": Limit(100_000, "use 1 to 100000 trials per search, e.g. 50"),
    "ensemble-gradient-steps": Limit(10_000_000, "use 1 to 10000000 steps, e.g. 500"),
    # data
    "dirichlet-alpha": Limit(
        1e6,
        "use a concentration up to 1000000 (past about 1000 every node's label mix is "
        "the data set's, as with partitioner='iid'), e.g. 0.5",
    ),
    # attack harness
    "attack-inflate": Limit(10**9, "use a factor of 1 to 1000000000, e.g. 1000"),
    # fractions of a distribution and sub-model widths
    "fedfa-percentile": Limit(
        100.0, "use a percentile in [50, 100] (the share of values kept), e.g. 95", low=50.0
    ),
    "submodel-widths": Limit(
        1.0,
        "give width ratios in [1/64, 1] separated by commas, e.g. '1,0.5,0.25,0.125' "
        "(a slice narrower than 1/64 has no channel left in most layers)",
        low=1 / 64,
    ),
}
"""The range each bounded run-config key accepts, declared once: every
:class:`ConfigReader` applies it when it reads the key, whichever module reads it.
Every integer key has an upper bound (``seed`` has its own two-sided range); a
string key listed here is a comma-separated list whose every item is a number in
the range."""


class ConfigError(ValueError):
    """A run-config or node-config value is missing, of the wrong type or invalid."""


_READS: ContextVar[set[tuple[str, str]] | None] = ContextVar("tessera_config_reads", default=None)


@contextmanager
def recording_reads() -> Iterator[set[tuple[str, str]]]:
    """Collect ``(source, key)`` for every key a :class:`ConfigReader` reads inside.

    Yields
    ------
    set[tuple[str, str]]
        Filled while the block runs: ``("run-config", "proximal-mu")``, ...
    """
    reads: set[tuple[str, str]] = set()
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)


class ConfigReader:
    """Typed access to a flat Flower config mapping.

    Parameters
    ----------
    values : Mapping[str, Any]
        The raw ``run_config`` or ``node_config``.
    source : str
        Where the values come from, used in error messages (``"run-config"``).
    """

    def __init__(self, values: Mapping[str, Any], source: str) -> None:
        self._values = dict(values)
        self._source = source

    def _note(self, key: str) -> None:
        reads = _READS.get()
        if reads is not None:
            reads.add((self._source, key))

    def get(self, key: str, kind: type[T], default: T | None = None) -> T:
        """Return ``key`` converted to ``kind``; raise :class:`ConfigError` if bad.

        Parameters
        ----------
        key : str
            The kebab-case key.
        kind : type
            One of ``int``, ``float``, ``str``, ``bool``.
        default : optional
            Returned when the key is absent; without it a missing key raises. Run-
            config keys have none: their defaults live in ``pyproject.toml``.

        Returns
        -------
        int | float | str | bool
            The converted value.
        """
        self._note(key)
        if key not in self._values:
            if default is None:
                declared = (
                    " (it is declared in [tool.flwr.app.config] of pyproject.toml, which "
                    "Flower sends with every run: pass the whole table)"
                    if self._source == "run-config"
                    else ""
                )
                raise ConfigError(
                    f"{self._source} key '{key}' is missing; set it, e.g. "
                    f'--{self._source} "{key}=..."{declared}'
                )
            return default
        raw = self._values[key]
        try:
            value = _convert(raw, kind)
        except (TypeError, ValueError) as err:
            raise ConfigError(
                f"{self._source} key '{key}' has value {raw!r}, which is not a valid "
                f"{kind.__name__}; {err}"
            ) from err
        limit = LIMITS.get(key) if self._source == "run-config" else None
        if limit is not None:
            check_limit(key, raw, value, limit)
        return value

    def optional_str(self, key: str) -> str | None:
        """Return a string value, or ``None`` when absent or empty."""
        self._note(key)
        if key not in self._values:
            return None
        value = str(self._values[key]).strip()
        return value or None

    def keys(self) -> set[str]:
        """Return the keys present."""
        return set(self._values)


def _convert(raw: Any, kind: type[T]) -> T:
    """Convert ``raw`` to ``kind``; raise ``ValueError`` saying what to give instead."""
    value: int | float | str | bool
    if kind is bool:
        if isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str) and raw.lower() in {"true", "false", "1", "0"}:
            value = raw.lower() in {"true", "1"}
        elif isinstance(raw, int) and raw in (0, 1):
            value = bool(raw)
        else:
            raise ValueError("use true or false")
    elif kind is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError("use a whole number")
        value = int(raw)
    elif kind is float:
        if isinstance(raw, bool):
            raise ValueError("use a number")
        try:
            value = float(raw)
        except OverflowError:  # an int past float's range, e.g. 10**400
            raise ValueError("use a finite number") from None
        if not math.isfinite(value):
            raise ValueError("use a finite number")
    else:
        value = str(raw)
    return cast("T", value)


def check_limit(key: str, raw: object, value: object, limit: Limit) -> None:
    """Apply ``limit`` to a number, or to each item of a comma-separated list."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        limit.check(key, raw, value)
        return
    items = parse_csv(str(value), key=key)
    for item in items:
        try:
            number = float(item)
        except ValueError:
            raise ConfigError(
                f"run-config key '{key}' has value {raw!r}: item {item!r} is not a number; "
                f"{limit.fix}"
            ) from None
        if not math.isfinite(number):
            raise ConfigError(
                f"run-config key '{key}' has value {raw!r}: item {item!r} is not finite; "
                f"{limit.fix}"
            )
        limit.check(key, raw, number)


def require(condition: bool, key: str, value: object, fix: str) -> None:
    """Raise :class:`ConfigError` naming ``key``, ``value`` and ``fix`` unless ``condition``."""
    if not condition:
        raise ConfigError(f"run-config key '{key}' has invalid value {value!r}: {fix}")


def parse_csv(value: str | None, *, key: str = "value") -> tuple[str, ...]:
    """Split a comma-separated config value into stripped items.

    Parameters
    ----------
    value : str or None
        The raw text; ``None`` or blank gives ``()``.
    key : str, optional
        The run-config key, for the error message.

    Returns
    -------
    tuple[str, ...]
        The items, stripped.

    Raises
    ------
    ConfigError
        If an item is empty (``"a,,b"``, ``",,,"``, a trailing comma): a list with a
        hole is a typo, not "nothing".
    """
    if value is None or not value.strip():
        return ()
    items = tuple(item.strip() for item in value.split(","))
    if not all(items):
        raise ConfigError(
            f"run-config key '{key}' has value {value!r}, which has an empty name; "
            "separate names with single commas, e.g. 'a,b', or leave it empty"
        )
    return items
