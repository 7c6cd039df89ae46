"""Which partitions attack: the seeded draw of the attack harness, shared by nodes and server.

In simulation the hostile nodes are chosen by run-config ``attack`` (one or more
attack names, comma-separated) and ``attack-fraction``: ``round(attack-fraction x
num-partitions)`` partitions (at least one when the fraction is positive) are drawn
with ``numpy.random.default_rng([seed, ATTACK_STREAM])``, and the named attacks are
dealt to them in turn. Every node computes the same draw from its own node config;
the server computes it too, only to record it (``config.json``, and which selected
nodes attacked in each round). In deployment a node attacks when its node-config
``attack`` says so, and the server does not know.

The hostile behaviours themselves live in :mod:`client_app.attacks`, their maths in
:mod:`tessera.attack_math`. The omniscient attacks (:data:`~tessera.config.OMNISCIENT_ATTACKS`)
need the round's honest updates, which only the in-process grid can show a node: a
real run refuses them (:func:`require_client_side`).
"""

from __future__ import annotations

import numpy as np

from tessera.config import OMNISCIENT_ATTACKS, ConfigError, RunConfig

ATTACK_STREAM = 0xA77AC
"""Second seed word of the attack draw (keeps it apart from every other seeded draw)."""


def attacked_partitions(num_partitions: int, fraction: float, seed: int) -> list[int]:
    """Draw the hostile partitions.

    Parameters
    ----------
    num_partitions : int
        Partitions (nodes) of the federation.
    fraction : float
        Share of them that attack, in ``[0, 1]``.
    seed : int
        Run-config ``seed``.

    Returns
    -------
    list[int]
        Sorted partition ids; empty when ``fraction`` is 0.
    """
    if fraction <= 0 or num_partitions < 1:
        return []
    count = min(num_partitions, max(1, round(fraction * num_partitions)))
    rng = np.random.default_rng([seed, ATTACK_STREAM])
    return sorted(int(p) for p in rng.choice(num_partitions, size=count, replace=False))


def attack_assignment(run: RunConfig, num_partitions: int) -> dict[int, str]:
    """Map each hostile partition to its attack (run-config ``attack`` dealt in turn)."""
    if not run.attack.kinds:
        return {}
    drawn = attacked_partitions(num_partitions, run.attack.fraction, run.seed)
    return {p: run.attack.kinds[i % len(run.attack.kinds)] for i, p in enumerate(drawn)}


def require_client_side(run: RunConfig) -> None:
    """Refuse attacks a real simulation or deployment cannot run.

    Parameters
    ----------
    run : RunConfig
        The run's configuration.

    Raises
    ------
    ConfigError
        If run-config ``attack`` names an omniscient attack (ALIE, IPM, min-max,
        min-sum, Mimic): it forges its update from the honest updates of the round,
        which only the in-process harness can show it.
    """
    omniscient = [a for a in run.attack.kinds if a in OMNISCIENT_ATTACKS]
    if omniscient:
        raise ConfigError(
            f"run-config key 'attack' names {', '.join(omniscient)}, which forge their "
            "update from the honest updates of the round: a real simulation or deployment "
            "cannot show a node those. Run them in the in-process harness "
            "(benchmarks/robustness.py, tessera.local_grid.LocalGrid with "
            "client_app.attacks.install_omniscient), or use client-side attacks here "
            "(e.g. dense-scale, bound-riding, ratchet, inflate)"
        )
