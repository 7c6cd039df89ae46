"""The Aggregator seam: how accepted weight updates become the next global weights.

Every weight-averaging path of every scheme goes through an :class:`Aggregator`
chosen by run-config ``aggregator``: the server asks it for an :class:`Accumulator`
per model at the start of a round, folds each accepted reply into it *as the reply
is pulled* (the reply's arrays can then be dropped, so server memory is O(model),
not O(clients x model)), and takes the result at the end of the round. A round
that is skipped (too few replies) simply discards its accumulators, and the global
weights stay as they were.

Coverage: a reply may cover only part of a global entry (a sub-model's channel
prefix) or leave entries out. :meth:`Accumulator.add` takes, per entry, the index
(a tuple of slices) its values occupy; every global entry is then averaged over the
replies that cover it, and an entry nobody covered keeps the reference (current
global) value.

This module holds the seam (the protocols, the report, the settings, the
registry); the aggregators live beside it: ``mean``, the example-weighted mean
(FedAvg) bounded by default, in :mod:`strategies.core.mean` (its distances in
:mod:`strategies.core.measure`, its float64 sums in :mod:`strategies.core.sums`),
the robust ones in :mod:`strategies.core.robust`. Each registers itself under its
name (:func:`register_aggregator`); :func:`get_aggregator` imports both modules
first, so a name is found whatever was imported before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from strategies.core.mixing import PRE_AGGREGATIONS, PreAggregation
from tessera.config import ConfigError, RunConfig

Index = tuple[slice, ...]
"""Where a reply's entry sits inside the global entry (one slice per dimension)."""


@dataclass(frozen=True)
class Clip:
    """One update whose distance from the global model was scaled down.

    Attributes
    ----------
    position : int
        Its place in the round's fold order (0-based).
    kind : str
        Which entries were clipped (:func:`entry_kind`).
    distance : float
        Their L2 distance from the global model before clipping.
    bound : float
        The distance they were clipped to.
    """

    position: int
    kind: str
    distance: float
    bound: float


@dataclass(frozen=True)
class AccumulatorReport:
    """What an accumulator did this round, for the round record and the next round.

    Attributes
    ----------
    medians : Mapping[str, float]
        Per kind of entry (:func:`entry_kind`), the lower median of the positive L2
        distances of the round's updates from the global model (empty when the
        accumulator does not measure them); the next round's clipping bound of
        ``mean`` is ``clip-factor`` times this.
    clips : tuple[Clip, ...]
        Updates that were scaled down.
    relative : Mapping[str, tuple[float, ...]]
        Per kind of entry, each accepted update's distance (what it told the scale:
        :func:`~strategies.core.scales.scale_evidence`, in whole-model units) over
        the L2 norm of the model's entries of that kind: what
        :class:`~strategies.core.groups.GroupModels` draws the cohort's scale from
        (empty when the accumulator does not measure distances).
    cohort : Mapping[str, float]
        An input, not a result: per kind, the whole cohort's scale relative to a
        model's norm (:meth:`strategies.core.groups.GroupModels.pooled_scale`). The
        ``mean`` of the next round bounds every update of this model by at most
        ``clip-factor`` times it times the norm of the model's entries of that kind,
        besides its own scale (empty: no such bound).
    """

    medians: Mapping[str, float] = field(default_factory=dict)
    clips: tuple[Clip, ...] = ()
    relative: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    cohort: Mapping[str, float] = field(default_factory=dict)


class Accumulator(Protocol):
    """Folds updates of one model, one at a time, into the next global weights."""

    @property
    def count(self) -> int:
        """Number of updates folded in so far."""
        ...

    def add(
        self,
        update: Mapping[str, np.ndarray],
        weight: float,
        *,
        index: Mapping[str, Index] | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
        stretch: float = 1.0,
    ) -> None:
        """Fold one update in (see the module docstring for ``index``).

        ``direction``, when given, is the server's own update of the model this
        update was trained as (a sub-model slice's own, shaped like the update's
        entries): aggregators that check directions compare with it instead of
        the slice of the accumulator's direction; others ignore it.

        ``stretch`` is the multiple of a typical node's distance this update may
        move the model by (its share of the examples,
        :func:`strategies.core.scales.bound_stretch`): aggregators with a distance
        bound from the cohort's scale stretch it; others ignore it.
        """
        ...

    def result(self) -> dict[str, np.ndarray]:
        """Return the aggregated weights (raises if nothing was added)."""
        ...

    def report(self) -> AccumulatorReport:
        """Return what was measured and clipped (call after :meth:`result`)."""
        ...


class Aggregator(Protocol):
    """Makes an :class:`Accumulator` for one model and one round."""

    @property
    def name(self) -> str:
        """The run-config ``aggregator`` value."""
        ...

    def accumulator(
        self,
        reference: Mapping[str, np.ndarray],
        *,
        previous: AccumulatorReport | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
    ) -> Accumulator:
        """Start aggregating updates of the model whose current weights are ``reference``.

        ``previous`` is the report of the same model's last committed round (``None``
        for its first), for aggregators whose bound carries over between rounds.
        ``direction`` is the server's own update of the model on its pool (trained
        minus ``reference``), for aggregators that check where an update points.
        """
        ...


def lower_median(values: Sequence[float]) -> float:
    """Return the lower median of ``values`` (an element of them; raises if empty)."""
    if not values:
        raise ValueError("the median of nothing is undefined")
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


STATISTICS_SUFFIXES = ("running_mean", "running_var")
"""Entries that are batch-norm statistics, not learned parameters."""


def entry_kind(key: str) -> str:
    """Return ``"statistics"`` for batch-norm running statistics, else ``"parameters"``.

    The two are bounded separately: running statistics move by far more than the
    learned parameters (a running variance of 1 can become 50 in one round), so a
    single distance would be dominated by them and bound the parameters loosely.
    """
    return "statistics" if key.endswith(STATISTICS_SUFFIXES) else "parameters"


DIRECTION = "direction"
"""The :class:`Clip` kind of an update dropped by the direction check: its ``distance``
is the update's cosine with the server's own update, its ``bound`` the threshold."""

UNMOVED = "unmoved"
"""The :class:`Clip` kind of an update a bounded ``mean`` drops because its learned
parameters are exactly the global model's (a free-rider, or a node whose training
did not run): it would only dilute the others' steps. ``distance`` and ``bound`` 0."""

DROPPED = frozenset({DIRECTION, UNMOVED})
"""The :class:`Clip` kinds that drop an update whole (the others scale it down)."""


DEFAULT_GROWTH = 2.0
"""Largest factor a bounded ``mean``'s scale may move between rounds (``bound-growth``)."""


@dataclass(frozen=True)
class AggregatorSettings:
    """The run-config knobs of the aggregators (:mod:`strategies.core.robust`).

    Attributes
    ----------
    clip_factor : float
        ``clip-factor``: ``mean`` clips each update's distance from the global model
        to this multiple of the cohort's median distance (0: off).
    trim_fraction : float
        ``trim-fraction``: share cut from each end per coordinate (``trimmed-mean``).
    krum_byzantine : int
        ``krum-byzantine``: the ``f`` of (multi-)Krum.
    clip_norm : float
        ``clip-norm``: largest L2 distance of an update from the global model
        (``norm-clip``).
    growth : float
        ``bound-growth``: largest factor ``mean``'s clip scale moves per round.
    ceiling : float
        ``clip-ceiling``: ``mean`` never lets an update move the global model by more
        than this multiple of the model's own L2 norm, per kind of entry (0: off).
    threshold : float
        ``trust-threshold``: ``mean`` drops an update whose cosine with the server's
        own update on its pool is at most this (when the server computes one).
    pre_aggregation : PreAggregation
        ``pre-aggregation``: how the buffered rules mix the round's updates first
        (:mod:`strategies.core.mixing`).
    bucket_size : int
        ``bucket-size``: updates per bucket (``pre-aggregation=bucketing``).
    cc_tau : float
        ``cc-tau``: the clipping radius of ``centered-clip`` (0: the median distance
        of the round's updates from the global model).
    cc_iterations : int
        ``cc-iterations``: how many times ``centered-clip`` moves its centre.
    seed : int
        The run's ``seed`` (the bucketing shuffle).
    """

    clip_factor: float = 0.0
    trim_fraction: float = 0.1
    krum_byzantine: int = 1
    clip_norm: float = 10.0
    growth: float = DEFAULT_GROWTH
    ceiling: float = 0.0
    threshold: float = 0.0
    pre_aggregation: PreAggregation = "none"
    bucket_size: int = 2
    cc_tau: float = 0.0
    cc_iterations: int = 3
    seed: int = 0

    @classmethod
    def from_run(cls, run: RunConfig) -> AggregatorSettings:
        """Take the settings from a parsed run config."""
        return cls(
            clip_factor=run.aggregation.clip_factor,
            trim_fraction=run.aggregation.trim_fraction,
            krum_byzantine=run.aggregation.krum_byzantine,
            clip_norm=run.aggregation.clip_norm,
            growth=run.aggregation.bound_growth,
            ceiling=run.aggregation.clip_ceiling,
            threshold=run.aggregation.trust_threshold,
            pre_aggregation=run.aggregation.pre_aggregation,
            bucket_size=run.aggregation.bucket_size,
            cc_tau=run.aggregation.cc_tau,
            cc_iterations=run.aggregation.cc_iterations,
            seed=run.seed,
        )


AggregatorFactory = Callable[[AggregatorSettings], Aggregator]


_AGGREGATORS: dict[str, AggregatorFactory] = {}
_MIXES: set[str] = set()
"""Aggregators that keep the round's updates and so can mix them first."""


def _load_aggregators() -> None:
    """Import the modules that register the aggregators (never at import time: cycles)."""
    import strategies.core.mean
    import strategies.core.robust  # noqa: F401


def register_aggregator(name: str, factory: AggregatorFactory, *, mixes: bool = False) -> None:
    """Register an aggregator factory under ``name`` (a duplicate raises).

    ``mixes``: the aggregator keeps the round's updates and applies run-config
    ``pre-aggregation`` to them (a streaming one refuses it).
    """
    if name in _AGGREGATORS:
        raise ValueError(f"aggregator '{name}' is already registered")
    _AGGREGATORS[name] = factory
    if mixes:
        _MIXES.add(name)


def list_aggregators() -> list[str]:
    """Names of the registered aggregators."""
    _load_aggregators()
    return sorted(_AGGREGATORS)


def get_aggregator(name: str, settings: AggregatorSettings | None = None) -> Aggregator:
    """Build the aggregator called ``name`` with ``settings`` (defaults when omitted).

    Raises
    ------
    ConfigError
        If no aggregator has that name (the message lists the known ones), or
        ``pre-aggregation`` is unknown or asked of a streaming aggregator.
    """
    _load_aggregators()
    if name not in _AGGREGATORS:
        raise ConfigError(
            f"run-config 'aggregator' is '{name}'; use one of {', '.join(list_aggregators())}"
        )
    chosen = settings if settings is not None else AggregatorSettings()
    if chosen.pre_aggregation not in PRE_AGGREGATIONS:
        raise ConfigError(
            f"run-config 'pre-aggregation' is '{chosen.pre_aggregation}'; use one of "
            f"{', '.join(PRE_AGGREGATIONS)}"
        )
    if chosen.pre_aggregation != "none" and name not in _MIXES:
        raise ConfigError(
            f"run-config 'pre-aggregation' is '{chosen.pre_aggregation}', but aggregator "
            f"'{name}' streams the updates and cannot mix them; use an aggregator that keeps "
            f"them ({', '.join(sorted(_MIXES))}) or pre-aggregation='none'"
        )
    return _AGGREGATORS[name](chosen)
