"""Which checkpoint may continue which run: the run-config keys that define an experiment."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.checkpoint import source_of
from tessera.config import ConfigError, RunConfig
from tessera.state_checks import StateFileError, get_mapping, get_str

__all__ = ["RESUME_IDENTITY_KEYS", "check_identity"]

RESUME_IDENTITY_KEYS = (
    "strategy",
    "dataset",
    "partitioner",
    "dirichlet-alpha",
    "classes-per-client",
    "server-pool-fraction",
    "local-test-fraction",
    "seed",
    "model-family",
    "norm",
)
"""Run-config keys a resumed run must share with the checkpoint (they define the
experiment); the others (rounds, timeouts, quorum) may change on resume."""


def check_identity(state: Mapping[str, Any], run: RunConfig, scheme: str) -> None:
    """Refuse a checkpoint of another scheme or another experiment.

    The checkpoint must name ``scheme`` and record the ``run_config`` it was written
    under, with every key of :data:`RESUME_IDENTITY_KEYS` equal to ``run``'s.

    Raises
    ------
    ConfigError
        If the checkpoint is of another scheme or another experiment (the message
        names the checkpoint file, lists the keys that differ and says to use the
        original values).
    StateFileError
        If ``scheme`` or ``run_config`` is missing or malformed, or ``run_config``
        lacks an identity key.
    """
    saved_scheme = get_str(state, "scheme")
    if saved_scheme != scheme:
        raise ConfigError(
            f"cannot resume from checkpoint {source_of(state)}: it is of scheme "
            f"'{saved_scheme}' but run-config 'strategy' is '{scheme}'; resume with "
            "the same strategy"
        )
    saved = get_mapping(state, "run_config")
    missing = [k for k in RESUME_IDENTITY_KEYS if k not in saved]
    if missing:
        raise StateFileError(
            "run_config",
            f"lacks the keys that define the experiment {missing}, so it cannot "
            "be told apart from another experiment's",
        )
    current = run.to_dict()
    changed = [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in RESUME_IDENTITY_KEYS
        if saved.get(k) != current.get(k)
    ]
    if changed:
        raise ConfigError(
            f"cannot resume from checkpoint {source_of(state)}: run-config keys that "
            f"define the experiment differ from the checkpoint's field 'run_config' "
            f"({'; '.join(changed)}); use the original values"
        )
