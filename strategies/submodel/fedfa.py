"""FedFA (Park et al.): width and depth slices, layer grafting, scalable aggregation.

Each node trains a slice of one global model in width and depth (the largest its
device fits). On the server every reply is first *grafted* back to the global depth
(FedFA Algorithm 2: each section's last block is repeated until the section has the
global number of blocks, :func:`~strategies.submodel.graft`), so every global block
receives every client's contribution ("complete aggregation"). The grafted slices
are then combined by *scalable aggregation* (Algorithm 1, lines 12-22,
:class:`~strategies.submodel.ScalableAccumulator`): per layer, each client's update is
scaled to the cohort's typical norm, then averaged by coverage.

That scaling is FedFA's defence against a client whose update is out of scale, and
here it is a bound (:mod:`strategies.submodel.aggregate` gives the maths and the
measurements behind it):

- a client is scaled to the median norm of the *others* (at most; the paper's
  cohort mean holds the client's own norm, so an oversized update raised its own
  reference and scaled every honest layer up);
- run-config ``clip-factor`` bounds the full L2 norm of a scaled update to that
  multiple of the reference, so values hidden above the percentile the norm
  ignores are bounded too (at 3 nearly every honest layer is within it and keeps
  the paper's factor; at 1 full norms are compared throughout);
  ``clip-factor=0`` leaves FedFA's trimmed norm alone;
- batch-norm running statistics, which are not scaled, are folded by the
  ``aggregator`` (``mean`` with ``clip-factor``): each update's statistics are
  clipped to ``clip-factor`` times the cohort's median distance, as in the other
  schemes;
- a layer that fewer than two clients moved takes the reference of the last round
  that had one (kept in the checkpoint).

Run-config ``aggregator`` must be ``mean`` (the buffered robust rules compare whole
updates, not slices). With ``fedfa-scaling=false`` the grafted slices are folded
by that aggregator as HeteroFL's are (coverage mean, bounded by ``clip-factor``).

Options: ``fedfa-scaling`` (default true; false: plain coverage average of the
grafted slices), ``fedfa-target`` (``updates``, default, or ``weights``),
``fedfa-trim`` (``magnitude``, default, ``signed`` or ``central``),
``fedfa-percentile`` (95), ``fedfa-weighted`` (weight clients by examples, default
true; the paper's Algorithm 1 weights by ``N_Dc``), ``fedfa-slices`` (``both``,
default, ``width`` or ``depth``: the paper's FedFA (Width) and FedFA (Depth), compared
with HeteroFL and FlexiFed on the same axis), ``fedfa-max-factor`` (10; 0:
unbounded as in the paper): the largest factor a client's layer is scaled *up* by,
since a layer whose update is nearly zero (a width-1/8 slice's normalisation layer
keeps one value after trimming) otherwise gets factors in the thousands and wrecks
the global model (measured: factor 1.5e5, accuracy 75 % -> 9 % in one round). Why
these readings are the defaults is in :mod:`strategies.submodel.aggregate`.

Memory: each grafted reply is folded as it arrives
(:class:`~strategies.submodel.ScalableAccumulator`): the factor ``rho / e_c`` is
linear in the layer's reference ``rho``, so the server keeps one running sum per
layer and each client's norms, O(model), and multiplies by ``rho`` at the end. Only
layers that may end up capped by ``fedfa-max-factor`` (a norm well under the
running reference) are kept apart until the round ends.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

import numpy as np

from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import DIRECTION, AccumulatorReport
from strategies.core.context import RoundContext
from strategies.core.groups import (
    GroupRound,
    NonFiniteStateError,
    non_finite_entries,
    without_arrays,
)
from strategies.core.registry import Scheme, register_scheme
from strategies.core.validation import ClientReply
from strategies.submodel.aggregate import ScalableAccumulator
from strategies.submodel.client import SubModelClient
from strategies.submodel.extract import coverage_index
from strategies.submodel.graft import graft
from strategies.submodel.norms import Target, Trim
from strategies.submodel.options import SubModelOptions, check_aggregator
from strategies.submodel.server import SubModelStrategy, slice_counts
from tessera.config import ConfigError, ConfigReader, RunConfig

log = logging.getLogger("flwr.tessera")

_L = TypeVar("_L", bound=str)

TARGETS: tuple[Target, ...] = get_args(Target)
"""Run-config ``fedfa-target`` values."""
TRIMS: tuple[Trim, ...] = get_args(Trim)
"""Run-config ``fedfa-trim`` values."""
Slices = Literal["both", "width", "depth"]
SLICES: tuple[Slices, ...] = get_args(Slices)
"""Run-config ``fedfa-slices``: the axes nodes may cut their slice along."""


@dataclass(frozen=True)
class FedFAOptions(SubModelOptions):
    """The sub-model options plus FedFA's aggregation (run-config ``fedfa-*``)."""

    scaling: bool = True
    target: Target = "updates"
    trim: Trim = "magnitude"
    percentile: float = 95.0
    weighted: bool = True
    slices: Slices = "both"
    max_factor: float = 10.0

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FedFAOptions:
        """Read the options from the run config."""
        r = ConfigReader(run_config, "run-config")
        percentile = r.get("fedfa-percentile", float, cls.percentile)
        target = _one_of("fedfa-target", r.get("fedfa-target", str, cls.target), TARGETS)
        trim = _one_of("fedfa-trim", r.get("fedfa-trim", str, cls.trim), TRIMS)
        max_factor = r.get("fedfa-max-factor", float, cls.max_factor)
        if not (max_factor == 0 or max_factor >= 1):
            raise ConfigError(
                f"run-config 'fedfa-max-factor' is {max_factor}; use 1 or more (e.g. 10), "
                "or 0 for the paper's unbounded factor"
            )
        slices = _one_of("fedfa-slices", r.get("fedfa-slices", str, cls.slices), SLICES)
        if not 0 < percentile <= 100:
            raise ConfigError(
                f"run-config 'fedfa-percentile' is {percentile}; use a value in (0, 100], e.g. 95"
            )
        return cls(
            **cls.read(run_config),
            scaling=r.get("fedfa-scaling", bool, cls.scaling),
            target=target,
            trim=trim,
            percentile=percentile,
            weighted=r.get("fedfa-weighted", bool, cls.weighted),
            slices=slices,
            max_factor=max_factor,
            width_flexible=slices in ("both", "width"),
            depth_flexible=slices in ("both", "depth"),
        )


class FedFAClient(SubModelClient[FedFAOptions]):
    """A FedFA node: picks a width and a depth (or one of them, ``fedfa-slices``)."""


@dataclass
class FedFARound:
    """What FedFA gathers during one round (kept in the round context)."""

    accumulator: ScalableAccumulator | None = None
    """The scalable aggregate, opened at the first reply."""
    senders: list[int] = field(default_factory=list)
    """Nodes whose update was folded, in order."""
    dropped: list[tuple[int, float]] = field(default_factory=list)
    """Nodes dropped by the direction check, with their cosine."""


class FedFAStrategy(SubModelStrategy[FedFAOptions]):
    """FedFA's server: graft every reply to the global depth, then scalable aggregation."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.references: dict[str, float] = {}
        """Per layer, the last reference norm a round computed (for a layer one client moves)."""
        self.statistics_report: AccumulatorReport | None = None
        """The last committed round's report on the statistics (carries their bound)."""

    def _accumulator(self) -> ScalableAccumulator:
        """Open this round's accumulator on the global weights (at the first reply)."""
        opts = self.options
        return ScalableAccumulator(
            self.global_state,
            target=opts.target,
            percentile=opts.percentile,
            trim=opts.trim,
            max_factor=opts.max_factor if opts.max_factor > 0 else math.inf,
            clip_factor=self.env.run.aggregation.clip_factor,
            previous=self.references,
            statistics=self.aggregator,
            previous_statistics=self.statistics_report,
            direction=self.pool_direction(self.global_name, self.global_state),
            threshold=self.env.run.aggregation.trust_threshold,
            ceiling=self.env.run.aggregation.clip_ceiling
            if self.env.run.aggregation.clip_factor > 0
            else 0.0,
        )

    def fold_view(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Graft a slice's arrays to the global depth (as :meth:`fold` grafts replies)."""
        return graft(arrays, self.layout, self.full.depths)

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Graft the reply to the global depth and fold it into this round's aggregate.

        With ``fedfa-scaling=false`` the grafted slice goes through the aggregator
        as HeteroFL's slices do.
        """
        if reply.arrays is None:
            raise ValueError(f"node {reply.node_id} sent no weights")
        grafted = graft(reply.arrays, self.layout, self.full.depths)
        index = coverage_index(self.global_state, grafted)
        weight = reply.weight if self.options.weighted else 1.0
        if not self.options.scaling:
            self.models.fold(
                ctx.state(GroupRound),
                self.global_name,
                grafted,
                weight,
                index=index,
                node=reply.node_id,
                stretch=reply.stretch,
            )
            return without_arrays(reply)
        state = ctx.state(FedFARound)
        if state.accumulator is None:
            state.accumulator = self._accumulator()
        accumulator = state.accumulator
        before, dropped = accumulator.count, len(accumulator.dropped)
        own = self.reply_direction(reply.arch, reply.node_id, grafted, index)
        accumulator.add(
            grafted,
            weight,
            index=index,
            direction=own,
            stretch=reply.stretch,
        )
        if accumulator.count > before:
            state.senders.append(reply.node_id)
        elif len(accumulator.dropped) > dropped:
            state.dropped.append((reply.node_id, accumulator.dropped[-1][1]))
            log.warning(
                "node %s: update dropped, cosine %.3g with the server's own update "
                "(fedfa, trust-threshold %g)",
                reply.node_id,
                accumulator.dropped[-1][1],
                self.env.run.aggregation.trust_threshold,
            )
        return without_arrays(reply)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Commit the folded slices (scalable aggregation unless ``fedfa-scaling=false``).

        The round record gets, besides the slices: ``capped_layers`` and
        ``late_capped_layers`` (factors held at ``fedfa-max-factor``),
        ``norm_bounded_layers`` (client layers scaled by their full norm: values
        above the percentile), ``unreferenced_layers`` (layers with no reference,
        factor 1) and ``clipped`` (updates whose statistics were clipped).
        """
        if not self.options.scaling:
            return super().aggregate(ctx, replies)
        state = ctx.state(FedFARound)
        accumulator, senders, dropped = state.accumulator, state.senders, state.dropped
        if accumulator is None or accumulator.count == 0:
            raise AggregationError("nothing to aggregate: no reply was folded")
        new = accumulator.result()
        bad = non_finite_entries(new)
        if bad:
            raise NonFiniteStateError(
                f"the aggregate has non-finite values in {bad[:3]}; it is not shipped and "
                "the global model keeps its weights"
            )
        report = accumulator.report()
        self.models.arrays[self.global_name] = new
        self.references = {**self.references, **accumulator.references}
        self.statistics_report = report
        clipped = [
            {
                "node": senders[c.position] if c.position < len(senders) else None,
                "arch": self.global_name,
                "kind": c.kind,
                "distance": c.distance,
                "bound": c.bound,
            }
            for c in report.clips
        ]
        for clip in clipped:
            log.info(
                "node %s: %s clipped from distance %.4g to %.4g (fedfa, clip-factor %g)",
                clip["node"],
                clip["kind"],
                clip["distance"],
                clip["bound"],
                self.env.run.aggregation.clip_factor,
            )
        clipped += [  # dropped by the direction check (logged as they arrived)
            {
                "node": node,
                "arch": self.global_name,
                "kind": DIRECTION,
                "distance": cosine,
                "bound": self.env.run.aggregation.trust_threshold,
            }
            for node, cosine in dropped
        ]
        return {
            "slices": slice_counts(replies),
            "capped_layers": accumulator.capped,
            "late_capped_layers": accumulator.late_caps,
            "norm_bounded_layers": accumulator.norm_bounded,
            "unreferenced_layers": accumulator.unreferenced,
            "clipped": clipped,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the sub-model state plus the layers' references and the statistics' scale."""
        report = self.statistics_report
        return {
            **super().state_dict(),
            "fedfa_references": dict(self.references),
            "fedfa_statistics_scale": {} if report is None else dict(report.medians),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the sub-model state, the references and the statistics' scale, checked.

        ``fedfa_references`` must map layers FedFA scales (floating parameters of
        the restored global model) to finite numbers > 0 and at most
        :data:`~tessera.state_checks.MEDIAN_LIMIT` times the layer's norm (at least
        1); ``fedfa_statistics_scale`` must hold median distances of the entries it
        does not scale (:func:`~strategies.core.groups.checked_medians`). A restored
        reference or bound is then never switched off. Neither is assigned unless
        both pass.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        from tessera.checkpoint import refusal
        from tessera.state_checks import StateFileError

        super().load_state_dict(state)
        try:
            references, scale = checked_fedfa_state(state, self.global_state)
        except StateFileError as err:
            raise refusal(state, err) from err
        self.references = references
        self.statistics_report = AccumulatorReport(medians=scale) if scale else None


def checked_fedfa_state(
    state: Mapping[str, Any], global_state: Mapping[str, np.ndarray]
) -> tuple[dict[str, float], dict[str, float]]:
    """Return FedFA's checkpoint entries, checked against the restored global model.

    Parameters
    ----------
    state : Mapping[str, Any]
        The checkpoint; ``fedfa_references`` and ``fedfa_statistics_scale`` may be
        absent (an older checkpoint: no reference, the statistics unbounded until
        the next round sets their scale).
    global_state : Mapping[str, np.ndarray]
        The restored global weights.

    Returns
    -------
    tuple[dict[str, float], dict[str, float]]
        The references per layer and the statistics' median distances.

    Raises
    ------
    StateFileError
        Naming the first field that fails.
    """
    from strategies.core.groups import checked_medians, weights_norm
    from strategies.submodel.norms import is_scaled
    from tessera.state_checks import MEDIAN_LIMIT, StateFileError, get_mapping, positive_float

    saved = get_mapping(state, "fedfa_references", default={})
    references: dict[str, float] = {}
    for key, value in saved.items():
        field = f"fedfa_references.{key}"
        layer = global_state.get(key)
        if layer is None or not is_scaled(key, layer):
            raise StateFileError(
                field, "is not a layer FedFA scales (a floating parameter of the global model)"
            )
        limit = MEDIAN_LIMIT * max(1.0, weights_norm({key: layer}))
        references[key] = positive_float(value, where=field, maximum=limit)
    plain = {k: v for k, v in global_state.items() if not is_scaled(k, v)}
    scale = checked_medians(
        get_mapping(state, "fedfa_statistics_scale", default={}),
        field="fedfa_statistics_scale",
        arrays=plain,
    )
    return references, scale


def _one_of(key: str, value: str, allowed: tuple[_L, ...]) -> _L:
    """Return ``value`` as one of ``allowed`` (a ``Literal``'s values) or refuse it."""
    for option in allowed:
        if value == option:
            return option
    raise ConfigError(f"run-config '{key}' is '{value}'; use one of {', '.join(allowed)}")


def validate_fedfa(run: RunConfig, options: FedFAOptions) -> None:
    """Refuse what FedFA would not honour: an aggregator other than the bounded mean.

    Its scalable aggregation folds the parameters itself and the batch-norm
    statistics through ``mean`` (run-config ``clip-factor`` bounds both); the robust
    aggregators cannot take its scaled, grafted updates.

    Raises
    ------
    ConfigError
        If run-config ``aggregator`` is not ``mean``.
    """
    check_aggregator("fedfa", run.aggregation.aggregator, ("mean",))


SCHEME = register_scheme(
    Scheme(
        name="fedfa",
        server=FedFAStrategy,
        client=FedFAClient,
        parse_options=FedFAOptions.parse,
        default_family="preresnet",
        norm="static-batch",
        validate=validate_fedfa,
        description="FedFA: width x depth slices, layer grafting, scalable aggregation",
        personalise=True,
    )
)
