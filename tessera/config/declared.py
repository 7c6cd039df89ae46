"""The run-config defaults as declared in ``pyproject.toml`` (``[tool.flwr.app.config]``).

Flower sends every app the whole table, overrides applied, so a key's value alone
cannot say whether a person set it. Comparing with the declared default can: a
scheme that ignores a key refuses a changed value rather than dropping it silently.
The table ships with the app (a FAB holds ``pyproject.toml`` at its root, beside
these packages); where it is missing, nothing is known to be changed.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["changed_keys", "declared_defaults"]

log = logging.getLogger("flwr.tessera")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
"""The project's ``pyproject.toml`` (the app's root in a FAB too)."""


@functools.lru_cache(maxsize=1)
def declared_defaults(path: Path = PYPROJECT) -> Mapping[str, Any] | None:
    """Return ``[tool.flwr.app.config]`` of ``path``, or ``None`` if it cannot be read."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: tomli (a dependency of flwr) is what tomllib was made from
        import tomli as tomllib
    try:
        with path.open("rb") as fh:
            table = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    except (OSError, KeyError, ValueError) as err:
        log.debug("no declared run-config defaults at %s: %s", path, err)
        return None
    return dict(table)


def changed_keys(values: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """Return those of ``keys`` whose value in ``values`` differs from the declared default.

    Parameters
    ----------
    values : Mapping[str, Any]
        Flat run-config values (:meth:`~tessera.config.RunConfig.to_dict`).
    keys : Iterable[str]
        The keys to look at.

    Returns
    -------
    list[str]
        In the order given; empty when the defaults cannot be read.

    Examples
    --------
    >>> changed_keys({"clip-factor": 1.0, "aggregator": "median"}, ["clip-factor", "aggregator"])
    ['aggregator']
    """
    declared = declared_defaults()
    if declared is None:
        return []
    return [k for k in keys if k in declared and k in values and values[k] != declared[k]]
