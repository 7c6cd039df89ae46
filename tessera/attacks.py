"""Which partitions attack: the seeded draw of the attack harness, shared by nodes and server.

In simulation the hostile nodes are chosen by run-config ``attack`` (one or more
attack names, comma-separated) and ``attack-fraction``: ``round(attack-fraction x
num-partitions)`` partitions (at least one when the fraction is positive) are drawn
with ``numpy.random.default_rng([seed, ATTACK_STREAM])``, and the named attacks are
dealt to them in turn. Every node computes the same draw from its own node config;
the server computes it too, only to record it (``config.json``, and which selected
nodes attacked in each round). In deployment a node attacks when its node-config
``attack`` says so, and the server does not know.

The hostile behaviours themselves live in :mod:`client_app.attacks`.
"""

from __future__ import annotations

import numpy as np

from tessera.config import RunConfig

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
    if not run.attack:
        return {}
    drawn = attacked_partitions(num_partitions, run.attack_fraction, run.seed)
    return {p: run.attack[i % len(run.attack)] for i, p in enumerate(drawn)}
