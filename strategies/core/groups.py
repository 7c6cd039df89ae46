"""Global weights per architecture group, aggregated through the Aggregator seam.

:class:`GroupModels` is the weight-averaging component every weight-sharing scheme
uses (``fedavg`` and ``fedprox`` with one group, ``fedavg-groups``, Felo's weight
sharing, FedHeNN's homogeneous mode). It holds what outlives a round: the weights,
each group's last report (its clip bound) and, with ``cohort-bound``, the cohort's
scale over the groups. What one round gathers, an
accumulator per group opened lazily and who sent each update, is a
:class:`GroupRound` in the round's context (``ctx.state(GroupRound)``): the round
either commits it (it reached its quorum) or drops it with the context, and the
global weights stay as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import RecordDict

from strategies.core.aggregators import (
    DEFAULT_GROWTH,
    DIRECTION,
    DROPPED,
    UNMOVED,
    Accumulator,
    AccumulatorReport,
    Aggregator,
    Index,
)
from strategies.core.direction import ClassDirections, PoolMix, along_mix
from strategies.core.scales import cohort_scale, parse_scale_key
from strategies.core.sums import check_update
from strategies.core.validation import ClientReply
from tessera import wire

log = logging.getLogger("flwr.tessera")


PoolDirection = Callable[
    [str, Mapping[str, np.ndarray], PoolMix | None], dict[str, np.ndarray] | None
]
"""The server's own update of a group's weights on its pool, or on a label mix of it
(:meth:`strategies.core.strategy.HeteroStrategy.pool_direction`)."""


class NonFiniteStateError(ArithmeticError):
    """An aggregate (weights, kernel, targets) is not finite: it must not be shipped."""


def non_finite_entries(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the floating entries of ``arrays`` that hold a NaN or an infinity."""
    return [
        key
        for key, value in arrays.items()
        if np.issubdtype(np.asarray(value).dtype, np.floating)
        and not bool(np.all(np.isfinite(value)))
    ]


@dataclass
class GroupRound:
    """What :class:`GroupModels` gathers during one round, kept in the round's context.

    Attributes
    ----------
    pending : dict[str, Accumulator]
        One accumulator per architecture group that received an update.
    senders : dict[str, list[int | None]]
        The node of each folded update, in folding order (names clipped updates).
    directions : ClassDirections
        The server's updates on the label mixes of label-skewed nodes, made this round.
    """

    pending: dict[str, Accumulator] = field(default_factory=dict)
    senders: dict[str, list[int | None]] = field(default_factory=dict)
    directions: ClassDirections = field(default_factory=ClassDirections)


@dataclass(frozen=True)
class GroupCommit:
    """What :meth:`GroupModels.commit` did.

    Attributes
    ----------
    sizes : dict[str, int]
        Updates folded per group.
    clips : list[dict[str, Any]]
        Updates clipped or dropped: node, arch, kind, distance, bound.
    """

    sizes: dict[str, int]
    clips: list[dict[str, Any]]


class GroupModels:
    """One set of global weights per architecture, folded through the Aggregator seam.

    Parameters
    ----------
    aggregator : Aggregator
        Folds updates into new weights.
    initial : Callable[[str], dict[str, np.ndarray]]
        Seeded initial weights of an architecture (the first time it is needed).
    direction : PoolDirection, optional
        The server's own update of an architecture's current weights on its pool
        (:meth:`strategies.core.strategy.HeteroStrategy.pool_direction`), asked once per
        group and round when its first update arrives, for aggregators that check
        where updates point; ``None`` (or a ``None`` result) leaves it out.
    mixes : Callable[[int], PoolMix | None], optional
        The pool mix a node's update is compared on
        (:meth:`strategies.core.strategy.HeteroStrategy.reference_mix`): for a
        label-skewed node, :meth:`fold` compares its update with ``direction`` on
        that mix (once per group, mix and round) instead of the whole pool's.
    cohort : bool, optional
        Run-config ``cohort-bound``: after a round that folded updates into two or
        more groups, :meth:`commit` pools every group's accepted distances relative
        to its model's norm into the cohort's scale (:meth:`pooled_scale`), and
        every group's next accumulator bounds its updates by it too. A group of two
        or three nodes has no honest majority: one hostile node in it picks its
        group's median (the largest honest distance) and rides it; of the whole
        cohort's it only picks which honest distance is the median. Off: each group
        is bounded by its own distances only.
    """

    def __init__(
        self,
        aggregator: Aggregator,
        initial: Callable[[str], dict[str, np.ndarray]],
        direction: PoolDirection | None = None,
        mixes: Callable[[int], PoolMix | None] | None = None,
        *,
        cohort: bool = False,
    ) -> None:
        self.aggregator = aggregator
        self.initial = initial
        self.direction = direction
        self.mixes = mixes
        self.cohort = cohort
        self.arrays: dict[str, dict[str, np.ndarray]] = {}
        self.reports: dict[str, AccumulatorReport] = {}
        """Each group's last committed accumulator report (carries the clip bound)."""
        self.relative: dict[str, float] = {}
        """The cohort's scale per kind, relative to a model's norm (:meth:`pooled_scale`)."""

    def get(self, arch: str) -> dict[str, np.ndarray]:
        """Return the current global weights of ``arch`` (initialised on first use)."""
        if arch not in self.arrays:
            self.arrays[arch] = self.initial(arch)
        return self.arrays[arch]

    def fold(
        self,
        rnd: GroupRound,
        arch: str,
        update: Mapping[str, np.ndarray],
        weight: float,
        *,
        index: Mapping[str, Index] | None = None,
        node: int | None = None,
        direction: Mapping[str, np.ndarray] | None = None,
        stretch: float = 1.0,
    ) -> None:
        """Fold one accepted update of ``arch`` (sent by ``node``) into ``rnd``'s accumulator.

        ``direction``: the server's own update of the slice the update was trained
        as (see :meth:`Accumulator.add`). Without it, a label-skewed node's update is
        compared with the server's update on the node's label mix (``mixes``).
        ``stretch``: the reply's :attr:`~strategies.core.validation.ClientReply.stretch`
        (see :meth:`Accumulator.add`).
        """
        if direction is None and node is not None:
            direction = self._class_direction(rnd, arch, node, update, index)
        if arch not in rnd.pending:
            current = self.get(arch)
            toward = None if self.direction is None else self.direction(arch, current, None)
            previous = self._previous(arch)
            if toward is None:
                acc = self.aggregator.accumulator(current, previous=previous)
            else:
                acc = self.aggregator.accumulator(current, previous=previous, direction=toward)
            rnd.pending[arch] = acc
            rnd.senders[arch] = []
        acc = rnd.pending[arch]
        before = acc.count
        if direction is None:
            acc.add(update, weight, index=index, stretch=stretch)
        else:
            acc.add(update, weight, index=index, direction=direction, stretch=stretch)
        if acc.count > before:
            rnd.senders[arch].append(node)

    def _previous(self, arch: str) -> AccumulatorReport | None:
        """Return what ``arch``'s next accumulator starts from (last report, cohort scale)."""
        report = self.reports.get(arch)
        if not (self.cohort and self.relative):
            return report
        return replace(report or AccumulatorReport(), cohort=dict(self.relative))

    def pooled_scale(self, reports: Mapping[str, AccumulatorReport]) -> dict[str, float]:
        """Return the cohort's next relative scale per kind from one round's group reports.

        Per kind, :func:`~strategies.core.scales.cohort_scale` of every group's
        :attr:`~strategies.core.aggregators.AccumulatorReport.relative` distances,
        moved by at most the aggregator's ``growth`` from the current scale. Only a
        round of two or more groups sets it (one group's own bound is already its
        median); a kind no round set keeps its scale.
        """
        scales = dict(self.relative)
        if not self.cohort or len(reports) < 2:
            return scales
        growth = float(getattr(self.aggregator, "growth", DEFAULT_GROWTH))
        pooled: dict[str, list[float]] = {}
        for report in reports.values():
            for kind, values in report.relative.items():
                pooled.setdefault(kind, []).extend(values)
        for kind, distances in sorted(pooled.items()):
            scale = cohort_scale(distances, scales.get(kind), growth)
            if scale is not None:
                scales[kind] = scale
        return scales

    def _class_direction(
        self,
        rnd: GroupRound,
        arch: str,
        node: int,
        update: Mapping[str, np.ndarray],
        index: Mapping[str, Index] | None,
    ) -> dict[str, np.ndarray] | None:
        """Return the server's update of ``arch`` on ``node``'s label mix, if it is skewed.

        ``None`` (the whole pool's) for a drawn mix the update does not point along
        (:func:`~strategies.core.direction.along_mix`).
        """
        if self.direction is None or self.mixes is None:
            return None
        mix = self.mixes(node)
        if mix is None:
            return None
        pool_direction, current = self.direction, self.get(arch)
        own = rnd.directions.get(arch, mix, lambda: pool_direction(arch, current, mix))
        threshold = float(getattr(self.aggregator, "threshold", 0.0))
        if own is None or not along_mix(update, current, mix, own, threshold, index):
            return None
        return own

    def check(
        self,
        arch: str,
        update: Mapping[str, np.ndarray],
        *,
        index: Mapping[str, Index] | None = None,
    ) -> None:
        """Raise what :meth:`fold` would raise for ``update``'s names, dtypes and shapes.

        A reply folded in two steps (a sub-model's shared and private parts) checks
        its second part first, so it is folded whole or not at all.

        Raises
        ------
        AggregationError
            If an entry is unknown, of another dtype, or does not fit its index.
        """
        check_update(self.get(arch), update, index)

    def commit(self, rnd: GroupRound) -> GroupCommit:
        """Replace each group's weights by its aggregate in ``rnd``.

        Every aggregate is computed and checked before any is kept, so the commit is
        all or nothing.

        Returns
        -------
        GroupCommit
            Updates per group, and the updates clipped or dropped.

        Raises
        ------
        NonFiniteStateError
            If an aggregate holds a non-finite value; every group keeps its weights.
        """
        results: dict[str, dict[str, np.ndarray]] = {}
        reports: dict[str, AccumulatorReport] = {}
        for arch, acc in sorted(rnd.pending.items()):
            if acc.count > 0:
                results[arch] = acc.result()
                reports[arch] = acc.report()
                bad = non_finite_entries(results[arch])
                if bad:
                    raise NonFiniteStateError(
                        f"the aggregate of '{arch}' has non-finite values in {bad[:3]}; "
                        "it is not shipped and the group keeps its weights"
                    )
        clips: list[dict[str, Any]] = []
        for arch, report in reports.items():
            senders = rnd.senders.get(arch, [])
            for clip in report.clips:
                node = senders[clip.position] if clip.position < len(senders) else None
                clips.append(
                    {
                        "node": node,
                        "arch": arch,
                        "kind": clip.kind,
                        "distance": clip.distance,
                        "bound": clip.bound,
                    }
                )
                if clip.kind == UNMOVED:
                    log.warning(
                        "node %s: update of '%s' dropped: its learned parameters are the "
                        "global model's, unchanged (it trained nothing)",
                        node,
                        arch,
                    )
                    continue
                if clip.kind == DIRECTION:
                    log.warning(
                        "node %s: update of '%s' dropped: its cosine with the server's own "
                        "update on its pool is %.3f, at most trust-threshold %g",
                        node,
                        arch,
                        clip.distance,
                        clip.bound,
                    )
                    continue
                # per node at DEBUG: with clip-factor 1 about half the cohort is clipped
                # every round, thousands of lines a round in a large federation
                log.debug(
                    "node %s: %s of '%s' clipped from distance %.4g to %.4g (aggregator '%s')",
                    node,
                    clip.kind,
                    arch,
                    clip.distance,
                    clip.bound,
                    self.aggregator.name,
                )
            clipped_nodes = {c.position for c in report.clips if c.kind not in DROPPED}
            if clipped_nodes:
                log.info(
                    "'%s': %d of %d update(s) clipped to the bound (aggregator '%s'; "
                    "which and by how much: 'clipped' in metrics.jsonl)",
                    arch,
                    len(clipped_nodes),
                    rnd.pending[arch].count,
                    self.aggregator.name,
                )
            self.reports[arch] = report
        sizes = {arch: rnd.pending[arch].count for arch in results}
        self.relative = self.pooled_scale(reports)
        self.arrays.update(results)
        return GroupCommit(sizes=sizes, clips=clips)

    def state_dict(self) -> dict[str, Any]:
        """Return the global weights, each group's median distance and the cohort's scale."""
        state: dict[str, Any] = {
            "arrays": {arch: dict(arrays) for arch, arrays in self.arrays.items()},
            "medians": {arch: dict(r.medians) for arch, r in self.reports.items() if r.medians},
        }
        if self.relative:
            state["cohort"] = dict(self.relative)
        return state

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        *,
        required: Collection[str] = (),
        nonempty: bool = False,
    ) -> None:
        """Restore :meth:`state_dict`, after checking all of it against the architectures.

        ``state`` must be a mapping. Each group's arrays must have exactly the names,
        shapes and dtypes of ``initial(arch)`` and be finite; each median distance
        must be a scale key of a restored group mapped to a finite number > 0 and at
        most :data:`~tessera.state_checks.MEDIAN_LIMIT` times the norm of the group's
        weights (at least 1, :func:`checked_medians`), so a restored clip bound is
        never switched off; the cohort's scale (relative to a model's norm) must map
        entry kinds to finite numbers > 0 and at most ``MEDIAN_LIMIT``. Nothing is
        restored unless everything passes.

        Parameters
        ----------
        state : Mapping[str, Any]
            The checkpoint entry (``group_models``, read back).
        required : Collection[str], optional
            Groups the entry must hold (a sub-model scheme's global model).
        nonempty : bool, optional
            Whether the entry must hold at least one group (a checkpoint written
            after a round holds the weights of every group its nodes trained).

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        from tessera.checkpoint import field_of, refusal
        from tessera.state_checks import (
            MEDIAN_KINDS,
            MEDIAN_LIMIT,
            StateFileError,
            arrays_problem,
            get_mapping,
            positive_float,
        )

        where = field_of(state, "group_models")
        try:
            if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
                raise StateFileError(
                    where, f"is {type(state).__name__}; expected a mapping of the group models"
                )
            legacy = "arrays" not in state  # older checkpoints hold the arrays only
            groups = state if legacy else get_mapping(state, "arrays", where=where)
            arrays: dict[str, dict[str, np.ndarray]] = {}
            for arch, group in groups.items():
                field = f"{where}.{arch}" if legacy else f"{where}.arrays.{arch}"
                try:
                    expected = self.initial(arch)
                except Exception as err:  # an unknown name fails in the model registry
                    raise StateFileError(
                        field, f"names architecture '{arch}', which this run cannot build ({err})"
                    ) from err
                problem = arrays_problem(group, expected, where=field)
                if problem is not None:
                    raise problem
                arrays[arch] = {str(k): np.asarray(v) for k, v in group.items()}
            held = where if legacy else f"{where}.arrays"
            absent = sorted(set(required) - set(arrays))
            if absent:
                raise StateFileError(
                    held,
                    f"holds no weights of {absent} (it holds {sorted(arrays)}); a "
                    "checkpoint written after a round holds them",
                )
            if nonempty and not arrays:
                raise StateFileError(
                    held,
                    "holds no group's weights; a checkpoint written after a round holds "
                    "those of every group its nodes trained",
                )
            reports: dict[str, AccumulatorReport] = {}
            saved = {} if legacy else get_mapping(state, "medians", where=where, default={})
            for arch in saved:
                field = f"{where}.medians.{arch}"
                if arch not in arrays:
                    raise StateFileError(field, f"is for '{arch}', which has no arrays")
                kinds = get_mapping(saved, arch, where=f"{where}.medians")
                reports[arch] = AccumulatorReport(
                    medians=checked_medians(kinds, field=field, arrays=arrays[arch])
                )
            relative: dict[str, float] = {}
            scales = {} if legacy else get_mapping(state, "cohort", where=where, default={})
            for kind, value in scales.items():
                field = f"{where}.cohort.{kind}"
                if kind not in MEDIAN_KINDS:
                    raise StateFileError(
                        field, f"is not an entry kind; expected one of {MEDIAN_KINDS}"
                    )
                relative[str(kind)] = positive_float(value, where=field, maximum=MEDIAN_LIMIT)
        except StateFileError as err:
            raise refusal(state, err) from err
        self.arrays = arrays
        self.reports = reports
        self.relative = relative


def weights_norm(arrays: Mapping[str, np.ndarray]) -> float:
    """Return the L2 norm of all of ``arrays`` together (in float64)."""
    return float(
        np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in arrays.values()))
    )


def checked_medians(
    kinds: Mapping[str, Any], *, field: str, arrays: Mapping[str, np.ndarray]
) -> dict[str, float]:
    """Return a checkpoint's median distances of one model, checked against its weights.

    Each key must be a scale key (:func:`~strategies.core.scales.parse_scale_key`) of
    an entry kind of :data:`~tessera.state_checks.MEDIAN_KINDS`, covering at most
    the model's number of elements, and each value a finite number > 0 and at most
    :data:`~tessera.state_checks.MEDIAN_LIMIT` times the norm of ``arrays`` (at
    least 1), so a restored clip bound is never switched off.

    Parameters
    ----------
    kinds : Mapping[str, Any]
        Scale key to median distance, as read back.
    field : str
        Where ``kinds`` sits in the checkpoint (``group_models.medians.cnn-1``).
    arrays : Mapping[str, np.ndarray]
        The (already checked) weights the distances were measured on.

    Returns
    -------
    dict[str, float]
        The medians by scale key.

    Raises
    ------
    StateFileError
        Naming the first key or value that fails.
    """
    from tessera.state_checks import MEDIAN_KINDS, MEDIAN_LIMIT, StateFileError, positive_float

    limit = MEDIAN_LIMIT * max(1.0, weights_norm(arrays))
    size = sum(int(np.asarray(v).size) for v in arrays.values())
    restored: dict[str, float] = {}
    for kind, value in kinds.items():
        try:
            entry, covered = parse_scale_key(str(kind))
        except ValueError as err:
            raise StateFileError(f"{field}.{kind}", str(err)) from err
        if entry not in MEDIAN_KINDS or (covered is not None and covered > size):
            raise StateFileError(
                f"{field}.{kind}",
                f"is not a scale key; expected one of {MEDIAN_KINDS}, optionally "
                f"with @all or @<covered elements, at most {size}>",
            )
        restored[str(kind)] = positive_float(value, where=f"{field}.{kind}", maximum=limit)
    return restored


def without_arrays(reply: ClientReply) -> ClientReply:
    """Return the reply without its weights (kept for the round record once they are folded)."""
    content = RecordDict({k: v for k, v in reply.content.items() if k != wire.ARRAYS})
    return replace(reply, arrays=None, content=content)


def fold_weights(models: GroupModels, rnd: GroupRound, reply: ClientReply) -> ClientReply:
    """Fold a validated reply's weights (at its capped :attr:`ClientReply.weight`); drop them.

    Raises
    ------
    ValueError
        If the reply carries no weights (the reply schema should have demanded them).
    """
    if reply.arrays is None:
        raise ValueError(f"node {reply.node_id} sent no weights")
    models.fold(
        rnd, reply.arch, reply.arrays, reply.weight, node=reply.node_id, stretch=reply.stretch
    )
    return without_arrays(reply)


@dataclass
class SharedGroup:
    """One model every node shares, whatever its own architecture.

    LG-FedAvg's head and FML's meme: the single group :attr:`name` of a
    :class:`GroupModels`, so every reply is folded through the run's aggregator (the
    bounded ``mean`` by default, at the reply's capped weight) and a round commits
    all or nothing.

    Attributes
    ----------
    name : str
        The group's name; also the stem of the round record's keys
        (``<name>_updates``, ``<name>_clipped``).
    models : GroupModels
        The group's weights and bound.
    """

    name: str
    models: GroupModels

    def get(self) -> Mapping[str, np.ndarray]:
        """Return the shared model's current weights."""
        return self.models.get(self.name)

    def fold(self, rnd: GroupRound, reply: ClientReply) -> ClientReply:
        """Fold a validated reply's weights into the round; return it without them.

        Raises
        ------
        ValueError
            If the reply carries no weights (the reply schema should have demanded them).
        """
        if reply.arrays is None:
            raise ValueError(f"node {reply.node_id} sent no {self.name}")
        self.models.fold(
            rnd, self.name, reply.arrays, reply.weight, node=reply.node_id, stretch=reply.stretch
        )
        return without_arrays(reply)

    def commit(self, rnd: GroupRound) -> dict[str, Any]:
        """Replace the shared model by the round's aggregate; return the record's entries."""
        done = self.models.commit(rnd)
        return {
            f"{self.name}_updates": done.sizes.get(self.name, 0),
            f"{self.name}_clipped": done.clips,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the group's checkpoint entry (weights and clip scale)."""
        return self.models.state_dict()


def required_entry(state: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """Return mapping entry ``key`` of checkpoint ``state`` (``group_models``, ``global_head``).

    Raises
    ------
    CheckpointError
        Naming the file, the field and the fix, if it is missing or not a mapping.
    """
    from tessera.checkpoint import refusal
    from tessera.state_checks import StateFileError, get_mapping

    try:
        return get_mapping(state, key)
    except StateFileError as err:
        raise refusal(state, err) from err


def restore_shared(
    state: Mapping[str, Any], key: str, name: str, fresh: GroupModels
) -> SharedGroup:
    """Read a :class:`SharedGroup` back from checkpoint entry ``key``, checked.

    Parameters
    ----------
    state : Mapping[str, Any]
        The checkpoint.
    key : str
        Its entry (``global_head``, ``global_meme``).
    name : str
        The group the entry must hold.
    fresh : GroupModels
        A new group store of this run, which checks the saved arrays' shapes.

    Raises
    ------
    CheckpointError
        Naming the file, the field and the fix, if the entry is missing, holds
        another group, or arrays that do not fit.
    """
    from tessera.checkpoint import refusal
    from tessera.state_checks import StateFileError

    fresh.load_state_dict(required_entry(state, key))
    if name not in fresh.arrays:
        raise refusal(state, StateFileError(f"{key}.arrays", f"holds no '{name}'"))
    return SharedGroup(name, fresh)
