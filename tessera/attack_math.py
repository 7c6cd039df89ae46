"""The arithmetic of the attack suite: pure functions on float64 update vectors.

Every function here acts on *updates* ``u = w - w0`` (the learned parameters a node
sends, minus those it was sent) flattened into one float64 vector per node; a stack
of honest updates is an ``(n, d)`` array, one row per honest node. The attack
harness (:mod:`client_app.attacks`) turns replies into such vectors and the forged
vector back into a reply; nothing here knows about messages, models or Flower.

The attacks, with the papers they come from:

- **ALIE**, "A little is enough" (Baruch et al., NeurIPS 2019): ``mu - z sigma`` per
  coordinate, ``mu`` and ``sigma`` the honest mean and standard deviation, ``z`` from
  the number of nodes ``n`` and of attackers ``f`` (:func:`alie_z`);
- **IPM**, inner-product manipulation (Xie et al., UAI 2020): ``-epsilon mu``;
- **min-max** and **min-sum** (Shejwalkar & Houmansadr, NDSS 2021): ``mu + gamma p``
  with ``p`` a perturbation direction and ``gamma`` the largest value (halving
  search, :func:`largest_gamma`) that keeps the forged update as close to the honest
  ones as they are to each other: by the largest distance (min-max) or by the sum of
  squared distances (min-sum);
- **Mimic** (Karimireddy, He & Jaggi, ICLR 2022): a copy of one honest update, the
  one furthest along the honest updates' top principal direction (:func:`mimic_index`);
- **dense-scale**: every coordinate ``+-M``;
- **bound-riding**: ``-0.99 B d / |d|``, the reverse of a direction ``d`` scaled to
  just under a clip bound ``B`` (:func:`bound_riding`);
- **ratchet**: the honest update scaled by ``1e3`` in odd rounds and ``1e-9`` in even
  ones (:func:`ratchet_factor`), to push a cohort-relative bound up and down.

Standard deviations are the sample ones (``ddof=1``), as in the reference code of
ALIE and min-max/min-sum (``torch.std``); one honest update has deviation 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Literal

import numpy as np

Perturbation = Literal["std", "sign", "unit"]
"""Min-max/min-sum perturbation directions (run-config ``attack-perturbation``)."""
PERTURBATIONS: tuple[Perturbation, ...] = ("std", "sign", "unit")

GAMMA_START = 10.0
"""First ``gamma`` of the halving search (the reference code's ``lamda = 10``)."""
GAMMA_STEPS = 40
"""Steps of the halving search: ``gamma`` is found to ``GAMMA_START / 2**40``."""
BOUND_MARGIN = 0.99
"""Bound-riding sends this share of the estimated bound."""
RATCHET_UP = 1e3
"""Ratchet: factor on the honest update in odd rounds."""
RATCHET_DOWN = 1e-9
"""Ratchet: factor on the honest update in even rounds."""


def _stack(honest: np.ndarray) -> np.ndarray:
    stack = np.asarray(honest, dtype=np.float64)
    if stack.ndim != 2 or stack.shape[0] < 1:
        raise ValueError(
            f"honest updates must be a non-empty (n, d) stack, got shape {stack.shape}; "
            "pass one row per honest node"
        )
    return stack


def _spread(stack: np.ndarray) -> np.ndarray:
    """Per-coordinate sample standard deviation (0 for a single row)."""
    if stack.shape[0] < 2:
        return np.zeros(stack.shape[1])
    return np.asarray(np.std(stack, axis=0, ddof=1))


def alie_z(num_nodes: int, num_attackers: int) -> float:
    """Return ALIE's ``z`` for ``n`` nodes of which ``f`` attack (Baruch et al. 2019).

    ``s = floor(n / 2 + 1) - f`` honest nodes must be won over; ``z`` is the normal
    quantile that leaves ``(n - s) / n`` of the mass below: ``Phi^{-1}((n - s) / n)``.

    Parameters
    ----------
    num_nodes : int
        ``n``, nodes in the round (honest and hostile).
    num_attackers : int
        ``f``, hostile nodes among them.

    Returns
    -------
    float
        ``z``.

    Raises
    ------
    ValueError
        If ``(n - s) / n`` is not in ``(0, 1)`` (e.g. a hostile majority): the
        formula does not apply; set run-config ``attack-z`` instead.
    """
    if num_nodes < 1 or not 0 <= num_attackers <= num_nodes:
        raise ValueError(f"ALIE needs 0 <= f <= n and n >= 1, got n={num_nodes}, f={num_attackers}")
    s = math.floor(num_nodes / 2 + 1) - num_attackers
    share = (num_nodes - s) / num_nodes
    if not 0 < share < 1:
        raise ValueError(
            f"ALIE's z is undefined for n={num_nodes}, f={num_attackers} "
            f"((n - s) / n = {share}); set run-config 'attack-z' to a positive value, e.g. 1.0"
        )
    return NormalDist().inv_cdf(share)


def alie(honest: np.ndarray, z: float) -> np.ndarray:
    """Return ``mu - z sigma`` per coordinate of the honest updates."""
    stack = _stack(honest)
    return np.asarray(stack.mean(axis=0) - z * _spread(stack))


def ipm(honest: np.ndarray, epsilon: float) -> np.ndarray:
    """Return ``-epsilon`` times the mean of the honest updates."""
    return np.asarray(-epsilon * _stack(honest).mean(axis=0))


def perturbation(honest: np.ndarray, kind: Perturbation) -> np.ndarray:
    """Return min-max/min-sum's perturbation direction ``p``.

    ``std``: ``-sigma``; ``sign``: ``-sign(mu)``; ``unit``: ``-mu / |mu|`` (zero when
    ``mu`` is zero).
    """
    stack = _stack(honest)
    if kind == "std":
        return -_spread(stack)
    mu = stack.mean(axis=0)
    if kind == "sign":
        return np.asarray(-np.sign(mu))
    if kind == "unit":
        norm = float(np.linalg.norm(mu))
        return np.zeros_like(mu) if norm == 0 else np.asarray(-mu / norm)
    raise ValueError(f"perturbation '{kind}' is unknown; use one of {', '.join(PERTURBATIONS)}")


def largest_gamma(
    admissible: Callable[[float], bool], *, start: float = GAMMA_START, steps: int = GAMMA_STEPS
) -> float:
    """Return the largest admissible ``gamma`` found by the halving search of NDSS 2021.

    Start at ``gamma = start`` with step ``start / 2``; at each step move up by the
    step if ``gamma`` is admissible (and remember it), down otherwise, then halve the
    step. ``steps`` bounds the work.

    Parameters
    ----------
    admissible : Callable[[float], bool]
        Whether a ``gamma`` satisfies the attack's constraint.
    start : float, optional
        First ``gamma``; the search reaches at most ``2 * start``.
    steps : int, optional
        Number of tests.

    Returns
    -------
    float
        The largest admissible ``gamma`` tested, 0.0 if none was.
    """
    gamma, step, best = start, start / 2, 0.0
    for _ in range(steps):
        if admissible(gamma):
            best = max(best, gamma)
            gamma += step
        else:
            gamma -= step
        step /= 2
    return best


def squared_distances(points: np.ndarray, to: np.ndarray) -> np.ndarray:
    """Return ``|points_i - to_j|^2`` as an ``(n, m)`` matrix (float64)."""
    a, b = np.asarray(points, np.float64), np.asarray(to, np.float64)
    # row by row, not |a|^2 + |b|^2 - 2ab: exact enough for updates of any scale
    return np.array([((b - row) ** 2).sum(axis=1) for row in a]).reshape(len(a), len(b))


def min_max(
    honest: np.ndarray, kind: Perturbation = "std", *, steps: int = GAMMA_STEPS
) -> np.ndarray:
    """Return min-max's ``mu + gamma p`` (Shejwalkar & Houmansadr, NDSS 2021).

    ``gamma`` is the largest value such that the forged update's largest distance to
    an honest update is at most the largest distance between two honest updates.
    """
    stack = _stack(honest)
    mu, p = stack.mean(axis=0), perturbation(stack, kind)
    limit = float(squared_distances(stack, stack).max())

    def admissible(gamma: float) -> bool:
        forged = (mu + gamma * p)[None, :]
        return float(squared_distances(forged, stack).max()) <= limit

    return np.asarray(mu + largest_gamma(admissible, steps=steps) * p)


def min_sum(
    honest: np.ndarray, kind: Perturbation = "std", *, steps: int = GAMMA_STEPS
) -> np.ndarray:
    """Return min-sum's ``mu + gamma p`` (Shejwalkar & Houmansadr, NDSS 2021).

    ``gamma`` is the largest value such that the forged update's sum of squared
    distances to the honest updates is at most the largest such sum of an honest
    update to the others.
    """
    stack = _stack(honest)
    mu, p = stack.mean(axis=0), perturbation(stack, kind)
    limit = float(squared_distances(stack, stack).sum(axis=1).max())

    def admissible(gamma: float) -> bool:
        forged = (mu + gamma * p)[None, :]
        return float(squared_distances(forged, stack).sum()) <= limit

    return np.asarray(mu + largest_gamma(admissible, steps=steps) * p)


def mimic_index(honest: np.ndarray) -> int:
    """Return which honest update Mimic copies (Karimireddy et al. 2022).

    The one with the largest projection, in absolute value, of ``u_i - mu`` on the
    top principal direction of the honest updates (the direction of their largest
    variance); the first such on ties, the first update when they are all equal.
    The projections come from the ``n x n`` Gram matrix of the centred updates, so
    the cost is ``O(n^2 d)`` whatever the model size.
    """
    stack = _stack(honest)
    centred = stack - stack.mean(axis=0)
    gram = centred @ centred.T
    if not np.any(gram):
        return 0
    _, vectors = np.linalg.eigh(gram)  # eigenvalues ascending: the last is the top
    return int(np.argmax(np.abs(vectors[:, -1]).round(12)))


def mimic(honest: np.ndarray) -> np.ndarray:
    """Return a copy of the honest update chosen by :func:`mimic_index`."""
    stack = _stack(honest)
    return np.asarray(stack[mimic_index(stack)].copy())


def dense_signs(size: int, rng: np.random.Generator) -> np.ndarray:
    """Return ``size`` random signs ``+-1.0`` (dense-scale: multiply by ``M``)."""
    return np.asarray(np.where(rng.random(size) < 0.5, -1.0, 1.0))


def lower_median(values: np.ndarray) -> float:
    """Return the lower median of ``values`` (one of them, as the server's bound uses)."""
    ordered = np.sort(np.asarray(values, np.float64).ravel())
    if ordered.size == 0:
        raise ValueError("the median of nothing is undefined; pass at least one value")
    return float(ordered[(ordered.size - 1) // 2])


def bound_riding(direction: np.ndarray, bound: float) -> np.ndarray:
    """Return ``-0.99 B d / |d|``: ``d`` reversed, just under the bound ``B``.

    Zero when ``d`` is zero (there is no direction to reverse).
    """
    d = np.asarray(direction, np.float64)
    norm = float(np.linalg.norm(d))
    if norm == 0 or bound <= 0:
        return np.zeros_like(d)
    return np.asarray(-BOUND_MARGIN * bound * d / norm)


def ratchet_factor(server_round: int) -> float:
    """Return the ratchet's factor on the honest update: ``1e3`` in odd rounds, else ``1e-9``."""
    return RATCHET_UP if server_round % 2 == 1 else RATCHET_DOWN
