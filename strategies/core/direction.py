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
pathological(2)). So an update from a node whose label counts cover at most
:data:`SKEW_SHARE` of the pool's classes is compared with the server's own update
on the pool's examples of those classes (:func:`skewed_classes`), made once per
model, class set and round, at most :data:`MAX_CLASS_DIRECTIONS` of them a round
(:class:`ClassDirections`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from strategies.core.aggregators import Index
from strategies.core.measure import is_parameter, squared_distance
from strategies.core.sums import Checked

log = logging.getLogger("flwr.tessera")

SKEW_SHARE = 0.5
"""A node whose label counts cover at most this share of the pool's classes is compared
with the server's update on its classes only (:func:`skewed_classes`)."""

MAX_CLASS_DIRECTIONS = 16
"""At most this many class-restricted server updates are trained a round (over all the
models a :class:`ClassDirections` serves); past it an update is compared with the whole
pool's (a bound on the server work a fleet claiming many class sets can cause)."""


def skewed_classes(
    label_counts: Sequence[int], pool_classes: Iterable[int], *, share: float = SKEW_SHARE
) -> frozenset[int] | None:
    """Return the classes a node's update is compared on, or ``None`` for the whole pool.

    Parameters
    ----------
    label_counts : Sequence[int]
        The node's claimed examples per class (its handshake).
    pool_classes : Iterable[int]
        The classes the server pool holds examples of.
    share : float
        The node must hold at most this share of the pool's classes.

    Returns
    -------
    frozenset[int] or None
        The pool classes the node holds, when they are at least one and at most
        ``share`` of the pool's classes; otherwise ``None``.

    Examples
    --------
    >>> sorted(skewed_classes([0, 5, 0, 3], range(4)))
    [1, 3]
    >>> skewed_classes([1, 5, 0, 3], range(4)) is None  # three of four classes
    True
    >>> skewed_classes([0, 0, 9, 0], [0, 1, 3]) is None  # holds no class of the pool
    True
    """
    pool = frozenset(int(c) for c in pool_classes)
    held = frozenset(c for c, n in enumerate(label_counts) if n > 0) & pool
    if not held or len(held) > share * len(pool):
        return None
    return held


@dataclass
class ClassDirections:
    """The server's class-restricted updates made in one round, by model and class set.

    Attributes
    ----------
    limit : int
        The most that are made (:data:`MAX_CLASS_DIRECTIONS`); past it :meth:`get`
        returns ``None`` (the caller compares with the whole pool's update).
    made : dict[tuple[str, frozenset[int]], dict[str, np.ndarray] | None]
        Those made so far (``None``: made and unusable).
    """

    limit: int = MAX_CLASS_DIRECTIONS
    made: dict[tuple[str, frozenset[int]], dict[str, np.ndarray] | None] = field(
        default_factory=dict
    )
    _warned: bool = False

    def get(
        self,
        model: str,
        classes: frozenset[int],
        make: Callable[[], dict[str, np.ndarray] | None],
    ) -> dict[str, np.ndarray] | None:
        """Return the update of ``model`` on ``classes``, made by ``make`` the first time."""
        key = (model, classes)
        if key not in self.made:
            if len(self.made) >= self.limit:
                if not self._warned:
                    log.warning(
                        "more than %d class sets this round: further skewed updates of "
                        "'%s' are compared with the server's update on its whole pool",
                        self.limit,
                        model,
                    )
                    self._warned = True
                return None
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
