"""FedHeNN's two servers and the RAD sampler.

Homogeneous: FedAvg plus alignment to the previous global model. Heterogeneous:
``K_bar`` from the clients' kernels, sent as a low-rank factor with the next RAD.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from models.base import TesseraModel
from models.cost import count_parameters
from strategies.baselines.fedavg import FedAvgStrategy
from strategies.core.context import RoundContext, ServerEnv
from strategies.core.groups import NonFiniteStateError
from strategies.core.strategy import HeteroStrategy
from strategies.core.validation import ClientReply, ReplySchema
from strategies.fedhenn.kbar import (
    FactoredKernel,
    KernelAccumulator,
    average_kernel,
    factorise,
)
from strategies.fedhenn.options import HETEROGENEOUS, HOMOGENEOUS, FedHeNNOptions
from strategies.fedhenn.payload import (
    ALIGN,
    ETA_KEY,
    MIN_RAD_ROWS,
    MODE_KEY,
    PROBE,
    RAD_ROUND_KEY,
    REP,
    _stats_problem,
    alignment_metrics,
    representation_problem,
)
from tessera import wire
from tessera.config import ConfigError
from tessera.results import ResultsWriter

log = logging.getLogger("flwr.tessera")


class RadSampler:
    """Draw each round's RAD from the server pool's inputs only.

    Parameters
    ----------
    pool_x : np.ndarray
        ``ServerEnv.server_pool.x`` (the labels are never passed in).
    rad_size : int
        Requested rows; capped at the pool's size (logged once).
    seed : int
        Run seed; round ``t`` draws with ``numpy.random.default_rng([seed, t])``.
    dtype : str
        Wire dtype of the rows.
    """

    def __init__(self, pool_x: np.ndarray, *, rad_size: int, seed: int, dtype: str) -> None:
        if len(pool_x) < MIN_RAD_ROWS:
            raise ConfigError(
                f"FedHeNN draws its RAD from the server pool, which has {len(pool_x)} "
                f"samples; it needs at least {MIN_RAD_ROWS}: raise run-config "
                "'server-pool-fraction'"
            )
        self.pool_x = pool_x
        self.rows = min(rad_size, len(pool_x))
        self.seed = seed
        self.dtype = np.dtype(dtype)
        self._cache: dict[int, np.ndarray] = {}
        if self.rows < rad_size:
            log.info(
                "fedhenn: rad-size=%d but the server pool holds %d samples; the RAD is "
                "the whole pool (reshuffled) every round",
                rad_size,
                len(pool_x),
            )

    def draw(self, server_round: int) -> np.ndarray:
        """Return round ``server_round``'s RAD (the same array on every call)."""
        if server_round not in self._cache:
            rng = np.random.default_rng([self.seed, server_round])
            idx = rng.choice(len(self.pool_x), size=self.rows, replace=False)
            self._cache = {server_round: self.pool_x[np.sort(idx)].astype(self.dtype)}
        return self._cache[server_round]


class FedHeNNHomogeneousStrategy(FedAvgStrategy[FedHeNNOptions]):
    """FedAvg of one shared architecture plus the RAD for the CKA term."""

    def __init__(self, *, env: ServerEnv, options: FedHeNNOptions, **kwargs: Any) -> None:
        super().__init__(env=env, options=options, **kwargs)
        self.options: FedHeNNOptions = options
        self.rad = RadSampler(
            env.server_pool.x, rad_size=options.rad_size, seed=env.run.seed, dtype=options.precision
        )

    def train_config(self, ctx: RoundContext, node_id: int, arch: str) -> ConfigRecord:
        """FedAvg's config plus this round's eta and the mode."""
        config = super().train_config(ctx, node_id, arch)
        config[ETA_KEY] = self.options.eta(ctx.server_round)
        config[MODE_KEY] = HOMOGENEOUS
        return config

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Global weights, and the RAD when ``eta(t) > 0``."""
        content = super().node_content(ctx, node_id, arch)
        if self.options.eta(ctx.server_round) > 0:
            content[ALIGN] = ctx.share(
                ALIGN, lambda: wire.numpy_to_record({"x": self.rad.draw(ctx.server_round)})
            )
        return content

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """FedAvg's weights plus the alignment statistics."""
        return ReplySchema(arrays=self.array_spec(arch), extra=_stats_problem)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """FedAvg, plus the round's alignment metrics."""
        out = super().aggregate(ctx, replies)
        eta = self.options.eta(ctx.server_round)
        out.update(alignment_metrics(replies, eta))
        out["rad_rows"] = self.rad.rows if eta > 0 else 0
        return out

    def describe(self) -> dict[str, Any]:
        """FedAvg's description plus FedHeNN's options."""
        return {**super().describe(), **self.options.describe(), "rad_rows": self.rad.rows}


@dataclass
class KernelRound:
    """What a round folds of the probe representations (``knowledge-merge=mean``).

    Attributes
    ----------
    accumulator : KernelAccumulator
        ``K_bar``'s weighted sum so far.
    rep_bytes : list[int]
        Each folded representation's size, for the round record.
    peak_bytes : int
        The most the accumulator held during the round.
    """

    accumulator: KernelAccumulator
    rep_bytes: list[int] = field(default_factory=list)
    peak_bytes: int = 0


@dataclass(frozen=True)
class AlignmentTarget:
    """A ``K_bar`` ready to ship: the RAD it was built on and its factor."""

    x: np.ndarray
    kernel: FactoredKernel
    built_in_round: int


class FedHeNNHeterogeneousStrategy(HeteroStrategy[FedHeNNOptions]):
    """Personal models on their own architectures, aligned to the averaged kernel."""

    def __init__(self, *, env: ServerEnv, options: FedHeNNOptions, **kwargs: Any) -> None:
        super().__init__(env=env, options=options, **kwargs)
        self.options: FedHeNNOptions = options
        self.rad = RadSampler(
            env.server_pool.x, rad_size=options.rad_size, seed=env.run.seed, dtype=options.precision
        )
        self.target: AlignmentTarget | None = None
        self._feature_dims: dict[str, int] = {}
        self._capacities: dict[str, int] = {}
        self.rad_holders: dict[int, int] = {}
        """Node id -> the round whose probe RAD the node holds in its state."""

    def _probes(self, server_round: int) -> bool:
        """Whether this round's replies feed a ``K_bar`` that a later round uses."""
        return (
            server_round < self.env.run.scheme.num_server_rounds
            and self.options.eta(server_round + 1) > 0
        )

    def _aligns(self, server_round: int) -> bool:
        return self.options.eta(server_round) > 0 and self.target is not None

    def _feature_dim(self, arch: str) -> int:
        if arch not in self._feature_dims:
            model = self.build_model(arch)
            assert isinstance(model, TesseraModel)
            self._feature_dims[arch] = model.feature_dim
            self._capacities[arch] = count_parameters(model)
        return self._feature_dims[arch]

    def _holds_rad(self, node_id: int) -> bool:
        """Whether the node keeps the RAD of the current target in its state."""
        return self.target is not None and self.rad_holders.get(node_id) == (
            self.target.built_in_round
        )

    def train_config(self, ctx: RoundContext, node_id: int, arch: str) -> ConfigRecord:
        """Return the base config plus this round's eta (0 while there is no target)."""
        config = super().train_config(ctx, node_id, arch)
        aligns = self._aligns(ctx.server_round)
        config[ETA_KEY] = self.options.eta(ctx.server_round) if aligns else 0.0
        config[MODE_KEY] = HETEROGENEOUS
        if aligns and self._holds_rad(node_id):
            assert self.target is not None
            config[RAD_ROUND_KEY] = self.target.built_in_round
        return config

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Config, ``K_bar`` with its RAD (when aligning) and the probe RAD.

        The aligning RAD is left out for nodes that keep it from the round it was
        their probe (config ``fedhenn-rad-round`` tells them which).
        """
        content = super().node_content(ctx, node_id, arch)
        if self._aligns(ctx.server_round):
            assert self.target is not None
            target = self.target
            with_rad = not self._holds_rad(node_id)

            def build_align() -> ArrayRecord:
                align = {"target": target.kernel.factor}
                if with_rad:
                    align["x"] = target.x
                return wire.numpy_to_record(align)

            content[ALIGN] = ctx.share((ALIGN, with_rad), build_align)
        if self._probes(ctx.server_round):
            content[PROBE] = ctx.share(
                PROBE,
                lambda: wire.numpy_to_record({"x": self.rad.draw(ctx.server_round)}),
            )
        return content

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """Statistics, and the probe representation when one was asked for."""
        probed = self._probes(ctx.server_round)
        rows, dim = self.rad.rows, self._feature_dim(arch)

        def extra(content: RecordDict) -> str | None:
            problem = _stats_problem(content)
            if problem is None and probed:
                problem = representation_problem(content, rows=rows, dim=dim)
            return problem

        return ReplySchema(arrays=None, extra=extra)

    def _weight(self, reply: ClientReply) -> float:
        """Return what a reply's kernel weighs in ``K_bar`` (run-config ``kbar-weights``)."""
        if self.options.kbar_weights == "data":
            return reply.weight
        if self.options.kbar_weights == "capacity":
            self._feature_dim(reply.arch)
            return float(self._capacities[reply.arch])
        return 1.0

    def _weights(self, replies: Sequence[ClientReply]) -> list[float]:
        return [self._weight(r) for r in replies]

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Fold a probe representation into ``K_bar``'s sum as it arrives, and drop it.

        Only the ``mean`` merge streams: ``median`` and ``trimmed-mean`` rank every
        client's kernel entry by entry, so they keep the representations until the
        round ends.
        """
        if not self._probes(ctx.server_round) or (
            self.env.run.aggregation.knowledge_merge != "mean"
        ):
            return reply
        kernels = ctx.state(
            KernelRound, lambda: KernelRound(KernelAccumulator(self.options.kernel))
        )
        rep = reply.content.array_records[REP]["rep"].numpy()
        kernels.accumulator.add(rep, self._weight(reply))
        kernels.rep_bytes.append(int(rep.nbytes))
        kernels.peak_bytes = max(kernels.peak_bytes, kernels.accumulator.nbytes)
        content = RecordDict({k: v for k, v in reply.content.items() if k != REP})
        return replace(reply, content=content)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Average the probe representations' kernels into the next round's ``K_bar``."""
        server_round = ctx.server_round
        aligned = self._aligns(server_round)
        probed = self._probes(server_round)
        for node in ctx.failures:
            self.rad_holders.pop(node, None)
        if probed:
            for r in replies:
                self.rad_holders[r.node_id] = server_round
        out = alignment_metrics(replies, self.options.eta(server_round) if aligned else 0.0)
        n = self.rad.rows
        shipped = self.target.kernel.nbytes if aligned and self.target is not None else 0
        folded = ctx.scheme_state.get(KernelRound)
        reps = (
            [r.content.array_records[REP]["rep"].numpy() for r in replies]
            if probed and folded is None
            else []
        )
        sizes = [rep.nbytes for rep in reps] if folded is None else folded.rep_bytes
        rep_bytes = float(np.mean(sizes)) if sizes else 0.0
        # Per client and round: what n x n float32 kernels would weigh (K_i up when
        # probed, K_bar down when aligning) against what is shipped instead.
        out["kernel_bytes_naive"] = 4 * n * n * (int(probed) + int(aligned))
        out["kernel_bytes_sent"] = rep_bytes + shipped
        out["kbar_bytes_down"] = shipped
        out["rep_bytes_up"] = rep_bytes
        out["rad_rows"] = n if probed or aligned else 0
        if not reps and folded is None:
            return out
        started = time.perf_counter()
        run = self.env.run
        if isinstance(folded, KernelRound):  # streamed: the representations are gone
            exact = folded.accumulator.result()
            out["kbar_fold_peak_bytes"] = folded.peak_bytes
        else:
            exact = average_kernel(
                reps,
                self._weights(replies),
                kernel=self.options.kernel,
                merge=run.aggregation.knowledge_merge,
                trim_fraction=run.aggregation.trim_fraction,
            )
        factored = factorise(exact, energy=self.options.kbar_energy, dtype=self.options.precision)
        if not bool(np.all(np.isfinite(factored.factor))):
            raise NonFiniteStateError("the averaged kernel K_bar is not finite")
        self.target = AlignmentTarget(self.rad.draw(server_round), factored, server_round)
        out.update(
            {
                "kbar_rank": factored.rank,
                "kbar_energy": factored.energy,
                "kbar_cka": factored.cka,
                "kbar_bytes": factored.nbytes,
                "kbar_seconds": time.perf_counter() - started,
            }
        )
        if factored.cka < 0.99:
            log.warning(
                "round %d: transmitted K_bar has CKA %.4f to the exact one; raise "
                "run-config 'kbar-energy' or use fedhenn-precision='float32'",
                server_round,
                factored.cka,
            )
        return out

    def discard(self, ctx: RoundContext) -> None:
        """Keep the target (the round is skipped); nodes that failed may have lost their RAD."""
        for node in ctx.failures:
            self.rad_holders.pop(node, None)

    def describe(self) -> dict[str, Any]:
        """FedHeNN's options and the RAD rows actually used."""
        return {**self.options.describe(), "rad_rows": self.rad.rows}

    def state_dict(self) -> dict[str, Any]:
        """Return the base state, the current ``K_bar`` target and who holds which RAD."""
        target = None
        if self.target is not None:
            k = self.target.kernel
            target = {
                "x": self.target.x,
                "factor": k.factor,
                "rank": k.rank,
                "energy": k.energy,
                "cka": k.cka,
                "built_in_round": self.target.built_in_round,
            }
        return {
            **super().state_dict(),
            "target": target,
            "rad_holders": {str(n): r for n, r in self.rad_holders.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, the scheme's part checked before any is assigned.

        The base part is restored first (it refuses a checkpoint of another scheme
        or another experiment). ``target`` is ``None`` or a ``K_bar`` target
        (:func:`target_from_state`, checked against this run's RAD);
        ``rad_holders`` maps node ids of the checkpoint's node table to a round in
        ``[1, round]``.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        from tessera.checkpoint import refusal
        from tessera.state_checks import StateFileError, get_int, get_mapping

        super().load_state_dict(state)
        target = None
        if state.get("target") is not None:
            try:
                tree = get_mapping(state, "target")
            except StateFileError as err:
                raise refusal(state, err) from err
            target = target_from_state(
                tree,
                rows=self.rad.rows,
                sample_shape=tuple(int(d) for d in self.rad.pool_x.shape[1:]),
                last_round=self.completed_round,
            )
        try:
            holders: dict[int, int] = {}
            for node, rnd in get_mapping(state, "rad_holders", default={}).items():
                if not node.isdigit() or int(node) not in self.nodes:
                    raise StateFileError(
                        f"rad_holders.{node}", "is not a node id of the checkpoint's node table"
                    )
                holders[int(node)] = get_int({node: rnd}, node, where="rad_holders", minimum=1)
                if holders[int(node)] > self.completed_round:
                    raise StateFileError(
                        f"rad_holders.{node}",
                        f"is round {rnd}, after the checkpoint's round {self.completed_round}",
                    )
        except StateFileError as err:
            raise refusal(state, err) from err
        self.target = target
        self.rad_holders = holders


def target_from_state(
    state: Mapping[str, Any],
    *,
    rows: int,
    sample_shape: tuple[int, ...],
    last_round: int,
) -> AlignmentTarget:
    """Return the ``K_bar`` target of checkpoint entry ``target``, every field checked first.

    ``x`` must be the RAD's finite float rows (``rows`` samples of
    ``sample_shape``); ``factor`` a finite float ``(rows, rank)`` array whose
    largest magnitude is 1 (:func:`~strategies.fedhenn.kbar.factorise` scales it
    so); ``rank`` an integer in ``[1, rows]``; ``energy`` a number in ``(0, 1]``;
    ``cka`` a number in ``[0, 1]``; ``built_in_round`` a round in
    ``[1, last_round]``.

    Parameters
    ----------
    state : Mapping[str, Any]
        The entry (a :class:`~tessera.checkpoint.StateTree` names its file and
        field in the error).
    rows : int
        Rows of this run's RAD.
    sample_shape : tuple[int, ...]
        Shape of one server-pool sample.
    last_round : int
        The checkpoint's round.

    Returns
    -------
    AlignmentTarget
        The target.

    Raises
    ------
    CheckpointError
        Naming the checkpoint file, the field and the fix.
    """
    from tessera.checkpoint import checked_array, field_of, refusal
    from tessera.state_checks import StateFileError, get_int

    where = field_of(state)
    tolerance = 1e-6

    def field(key: str) -> str:
        return f"{where}.{key}" if where else key

    def fraction(key: str, low: float, *, open_low: bool) -> float:
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StateFileError(field(key), f"is {value!r}; expected a number")
        number = float(value)
        below = number <= low if open_low else number < low - tolerance
        if not math.isfinite(number) or below or number > 1.0 + tolerance:
            interval = f"({low:g}, 1]" if open_low else f"[{low:g}, 1]"
            raise StateFileError(field(key), f"is {number!r}; expected a number in {interval}")
        return number

    x = checked_array(state, "x", shape=(rows, *sample_shape))
    factor = checked_array(state, "factor", shape=(rows, None))
    try:
        rank = get_int(state, "rank", where=where, minimum=1)
        if factor.shape[1] != rank or rank > rows:
            raise StateFileError(
                field("rank"),
                f"is {rank} but the factor has {factor.shape[1]} columns and the RAD {rows} rows",
            )
        peak = float(np.max(np.abs(factor.astype(np.float64))))
        if not 0.0 < peak <= 1.0 + 1e-3:
            raise StateFileError(
                field("factor"), f"has largest magnitude {peak:.4g}; a K_bar factor is scaled to 1"
            )
        energy = fraction("energy", 0.0, open_low=True)
        cka = fraction("cka", 0.0, open_low=False)
        built = get_int(state, "built_in_round", where=where, minimum=1)
        if built > last_round:
            raise StateFileError(
                field("built_in_round"),
                f"is {built}, after the checkpoint's round {last_round}",
            )
    except StateFileError as err:
        raise refusal(state, err) from err
    kernel = FactoredKernel(factor=factor, rank=rank, energy=energy, cka=cka)
    return AlignmentTarget(x, kernel, built)


def fedhenn_server(
    *, env: ServerEnv, options: FedHeNNOptions, results: ResultsWriter | None
) -> HeteroStrategy[FedHeNNOptions]:
    """Build the server side of the mode ``options.mode``."""
    if options.mode == HOMOGENEOUS:
        return FedHeNNHomogeneousStrategy(env=env, options=options, results=results)
    return FedHeNNHeterogeneousStrategy(env=env, options=options, results=results)
