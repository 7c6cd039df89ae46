"""The bounded ``mean``'s direction check: does an update point the server's way.

FLTrust's idea (Cao et al. NDSS 2021): the server trains the model on its own
trusted pool and compares. An update whose learned parameters have a cosine of at
most ``threshold`` with the server's own update is dropped whole by
:class:`strategies.core.mean.MeanAccumulator`. :class:`DirectionCheck` holds the
server's direction, finds the part of it an entry is compared with (the whole
model's, a slice of it, or the direction a sub-model update came with) and turns a
measured dot product into that cosine.

Under label skew the server's update on its whole pool is the wrong yardstick: a
node holding two classes of ten learns to predict those two, and an honest update
can point away from training on all ten (measured: cosines of -0.8 under
pathological(2)); under Dirichlet(0.5) label proportions the check dropped one to
five of eight honest updates a round. So an update from a node whose claimed label
proportions are further than :data:`MIX_GATE` (total variation) from the pool's is
compared with the server's own update on a :class:`PoolMix`: the pool's examples of
the node's classes, drawn to the node's proportions when the pool's own differ from
them (:func:`reference_mix`). One is made per model, mix and round, at most
:data:`MAX_CLASS_DIRECTIONS` a round (:class:`ClassDirections`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from strategies.core.aggregators import Index
from strategies.core.measure import is_parameter, squared_distance
from strategies.core.sums import Checked
from tessera.data import ArrayDataset

log = logging.getLogger("flwr.tessera")

MIX_GATE = 0.2
"""A node whose claimed label proportions are within this total variation distance of
the server pool's is compared with the server's update on the whole pool; further, with
its :class:`PoolMix` (:func:`reference_mix`). The sampling noise of an IID node stays
under it: at most 0.18 over the IID splits of digits into 5, 8 and 10 nodes (103 to
207 examples each, 3 seeds), while every Dirichlet(0.5) node but one measured 0.24 to
0.64."""

MAX_CLASS_DIRECTIONS = 16
"""At most this many mix-restricted server updates are trained a round (over all the
models a :class:`ClassDirections` serves); past it an update is compared with the made
one nearest its mix (a bound on the server work a fleet claiming many mixes can
cause)."""


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    """Return half the L1 distance of two distributions (each normalised here).

    Examples
    --------
    >>> total_variation(np.array([1.0, 1.0]), np.array([3.0, 1.0]))
    0.25
    >>> total_variation(np.array([2, 0]), np.array([0, 5]))
    1.0
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    return float(0.5 * np.abs(p / p.sum() - q / q.sum()).sum())


@dataclass(frozen=True)
class PoolMix:
    """The examples of the server pool a node's update is compared with.

    Attributes
    ----------
    counts : tuple[int, ...]
        Per class id, how many examples the server trains on (0: none of that class).
    resample : bool
        ``False``: the pool's own examples of the classes with a count (``counts`` are
        the pool's). ``True``: each class's count drawn from the pool's examples of it,
        every one of them as often as fits and the rest without repeats.
    """

    counts: tuple[int, ...]
    resample: bool

    @property
    def classes(self) -> frozenset[int]:
        """The classes trained on."""
        return frozenset(c for c, n in enumerate(self.counts) if n > 0)

    def distance(self, other: PoolMix) -> float:
        """Total variation distance of the two mixes' label proportions."""
        size = max(len(self.counts), len(other.counts))
        mine = np.zeros(size)
        theirs = np.zeros(size)
        mine[: len(self.counts)] = self.counts
        theirs[: len(other.counts)] = other.counts
        return total_variation(mine, theirs)

    def select(self, pool: ArrayDataset, seed: Sequence[int]) -> ArrayDataset:
        """Return the examples of ``pool`` this mix trains on (drawn with ``seed``)."""
        if not self.resample:
            keep = np.isin(pool.y, np.fromiter(self.classes, dtype=np.int64))
            return ArrayDataset(pool.x[keep], pool.y[keep])
        rng = np.random.default_rng([*map(int, seed), *self.counts])
        picks = []
        for c, k in enumerate(self.counts):
            have = np.flatnonzero(pool.y == c)
            if k <= 0 or len(have) == 0:
                continue
            repeats, rest = divmod(k, len(have))
            picks.append(np.tile(have, repeats))
            picks.append(rng.choice(have, size=rest, replace=False))
        if not picks:
            return ArrayDataset(pool.x[:0], pool.y[:0])
        idx = np.sort(np.concatenate(picks))
        return ArrayDataset(pool.x[idx], pool.y[idx])


def _shares_to_counts(shares: np.ndarray, total: int) -> npt.NDArray[np.int64]:
    """Round ``shares * total`` to integers summing to ``total`` (largest remainders)."""
    exact = np.asarray(shares, dtype=np.float64) * total
    counts: npt.NDArray[np.int64] = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


def reference_mix(
    label_counts: Sequence[int], pool_counts: Sequence[int], *, gate: float = MIX_GATE
) -> PoolMix | None:
    """Return the pool mix a node's update is compared with, or ``None`` for the whole pool.

    Parameters
    ----------
    label_counts : Sequence[int]
        The node's claimed examples per class (its handshake).
    pool_counts : Sequence[int]
        The server pool's examples per class.
    gate : float
        Proportions within this total variation distance count as the same.

    Returns
    -------
    PoolMix or None
        ``None`` when the node's proportions over the pool's classes are within
        ``gate`` of the pool's (or it claims none of them). Otherwise the pool's
        examples of the classes the node holds, as they are when their proportions
        are within ``gate`` of the node's, else drawn to the node's proportions (as
        many examples as the pool holds of those classes).

    Examples
    --------
    >>> reference_mix([10, 10, 10, 10], [5, 5, 5, 5]) is None
    True
    >>> reference_mix([0, 10, 0, 10], [5, 5, 5, 5])  # two classes: the pool's own
    PoolMix(counts=(0, 5, 0, 5), resample=False)
    >>> reference_mix([30, 10, 0, 0], [5, 5, 5, 5])  # 3:1, drawn to it
    PoolMix(counts=(8, 2, 0, 0), resample=True)
    """
    pool = np.asarray(pool_counts, dtype=np.int64)
    claimed = np.zeros(len(pool), dtype=np.float64)
    size = min(len(pool), len(label_counts))
    claimed[:size] = np.asarray(label_counts[:size], dtype=np.float64)
    claimed[pool <= 0] = 0.0
    if claimed.sum() <= 0 or pool.sum() <= 0:
        return None
    if total_variation(claimed, pool) <= gate:
        return None
    own = np.where(claimed > 0, pool, 0)
    if total_variation(claimed, own) <= gate:
        return PoolMix(tuple(int(n) for n in own), resample=False)
    drawn = _shares_to_counts(claimed / claimed.sum(), int(own.sum()))
    return PoolMix(tuple(int(n) for n in drawn), resample=True)


def update_cosine(
    update: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    direction: Mapping[str, np.ndarray],
    index: Mapping[str, Index] | None = None,
) -> float | None:
    """Return the cosine of ``update - reference`` with ``direction`` (learned parameters).

    Over the entries all three hold that are learned parameters (as
    :class:`DirectionCheck` compares), in float64; ``index`` places a slice's entries
    in the reference. ``None`` when nothing is compared, a norm is zero or a value is
    not finite.

    Examples
    --------
    >>> ref = {"w": np.zeros(2), "bn.running_mean": np.zeros(1)}
    >>> up = {"w": np.array([1.0, 1.0]), "bn.running_mean": np.array([-9.0])}
    >>> round(update_cosine(up, ref, {"w": np.array([1.0, 0.0]), "bn.running_mean": np.ones(1)}), 4)
    0.7071
    """
    dot = nu = nd = 0.0
    for key, along in direction.items():
        if key not in update or key not in reference or not is_parameter(key, along):
            continue
        start = reference[key] if index is None or key not in index else reference[key][index[key]]
        if start.shape != update[key].shape or along.shape != update[key].shape:
            return None
        diff = update[key].astype(np.float64).ravel() - start.astype(np.float64).ravel()
        d = along.astype(np.float64).ravel()
        dot += float(diff @ d)
        nu += float(diff @ diff)
        nd += float(d @ d)
    if not (nu > 0 and nd > 0 and math.isfinite(dot) and math.isfinite(nu * nd)):
        return None
    return max(-1.0, min(1.0, dot / math.sqrt(nu * nd)))


def along_mix(
    update: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    mix: PoolMix,
    direction: Mapping[str, np.ndarray],
    threshold: float,
    index: Mapping[str, Index] | None = None,
) -> bool:
    """Return whether an update is compared with its mix's direction (else the whole pool's).

    A mix drawn to a node's proportions repeats the pool's few examples of its large
    classes, and for a large model its training alone is a noisy yardstick (the
    ensemble's MobileNetV2 under Dirichlet(0.5): honest updates at cosines of -0.04
    to 0 with it, two of five dropped a round). So an update of a drawn mix passes
    when it points along either the mix's training or the whole pool's: it is
    compared with the mix's when its cosine with it is above ``threshold``, and with
    the whole pool's otherwise. Either way it must point along an honest training of
    the server's. A class-restricted mix (``resample=False``) is always used.
    """
    if not mix.resample:
        return True
    cosine = update_cosine(update, reference, direction, index)
    return cosine is not None and cosine > threshold


@dataclass
class ClassDirections:
    """The server's mix-restricted updates made in one round, by model and mix.

    Attributes
    ----------
    limit : int
        The most that are made (:data:`MAX_CLASS_DIRECTIONS`); past it :meth:`get`
        returns the made one of the same model nearest the asked mix (``None``
        without one: the caller compares with the whole pool's update).
    made : dict[tuple[str, PoolMix], dict[str, np.ndarray] | None]
        Those made so far (``None``: made and unusable).
    """

    limit: int = MAX_CLASS_DIRECTIONS
    made: dict[tuple[str, PoolMix], dict[str, np.ndarray] | None] = field(default_factory=dict)
    _warned: bool = False

    def get(
        self,
        model: str,
        mix: PoolMix,
        make: Callable[[], dict[str, np.ndarray] | None],
    ) -> dict[str, np.ndarray] | None:
        """Return the update of ``model`` on ``mix``, made by ``make`` the first time."""
        key = (model, mix)
        if key not in self.made:
            if len(self.made) >= self.limit:
                if not self._warned:
                    log.warning(
                        "more than %d label mixes this round: further skewed updates of "
                        "'%s' are compared with the server's update on the nearest mix made",
                        self.limit,
                        model,
                    )
                    self._warned = True
                near = [(m.distance(mix), d) for (name, m), d in self.made.items() if name == model]
                near = [(dist, d) for dist, d in near if d is not None]
                return min(near, key=lambda pair: pair[0])[1] if near else None
            self.made[key] = make()
        return self.made[key]


class DirectionCheck:
    """The server's own update of a model, which the updates of a round are compared with.

    Parameters
    ----------
    reference : Mapping[str, np.ndarray]
        The current global weights (names, shapes and dtypes the direction must have).
    direction : Mapping[str, np.ndarray] | None
        The server's own update on its pool (trained minus reference), per entry;
        ``None`` (or a zero, non-finite or misshapen one) switches the check off.
        Only learned parameters are compared.
    threshold : float
        An update whose cosine with the direction is at most this is refused.
    """

    def __init__(
        self,
        reference: Mapping[str, np.ndarray],
        direction: Mapping[str, np.ndarray] | None,
        threshold: float,
    ) -> None:
        self.threshold = float(threshold)
        self.direction: dict[str, np.ndarray] | None = None
        self.norms2: dict[str, float] = {}
        """Squared L2 norm of each entry of the direction (learned parameters)."""
        if direction is not None:
            keys = [k for k in reference if is_parameter(k, reference[k])]
            good = all(
                k in direction
                and direction[k].shape == reference[k].shape
                and direction[k].dtype == reference[k].dtype
                for k in keys
            )
            norms2 = {
                k: squared_distance(direction[k], np.zeros_like(direction[k])) for k in keys if good
            }
            norm2 = sum(norms2.values())
            if good and keys and math.isfinite(norm2) and norm2 > 0:
                self.direction = {k: np.ascontiguousarray(direction[k]) for k in keys}
                self.norms2 = norms2

    def own(
        self, checked: Checked, direction: Mapping[str, np.ndarray] | None
    ) -> dict[str, np.ndarray] | None:
        """Return the direction an update came with, if it fits the update's entries.

        Parameters
        ----------
        checked : Checked
            The update's checked entries.
        direction : Mapping[str, np.ndarray] | None
            The server's own update of the slice the update was trained as.

        Returns
        -------
        dict[str, np.ndarray] or None
            Its entries compared (contiguous), or ``None`` (the check is off, none
            came, or one is missing or misshapen: the slice of :attr:`direction` is
            used).
        """
        if direction is None or self.direction is None:
            return None
        own = {
            k: np.ascontiguousarray(direction[k])
            for k, (v, _) in checked.items()
            if k in self.direction and k in direction
        }
        if all(  # finite: it comes from pool_direction, which checks that once
            k in own and own[k].shape == v.shape and own[k].dtype == v.dtype
            for k, (v, _) in checked.items()
            if k in self.direction
        ):
            return own
        return None

    def along(
        self, key: str, where: Index | None, own: Mapping[str, np.ndarray] | None
    ) -> np.ndarray | None:
        """Return the part of the direction that entry ``key`` (at ``where``) is compared with."""
        if self.direction is None or key not in self.direction:
            return None
        if own is not None:
            return own[key]
        along = self.direction[key]
        return along if where is None else along[where]

    def cosine(self, dot: float, distances: Mapping[str, float], norm2: float) -> float | None:
        """Cosine of an update's learned parameters with the direction (``None``: unknown)."""
        if self.direction is None:
            return None
        distance = distances.get("parameters", 0.0)
        if distance <= 0 or norm2 <= 0 or not math.isfinite(distance):
            return None
        return max(-1.0, min(1.0, dot / (distance * math.sqrt(norm2))))
