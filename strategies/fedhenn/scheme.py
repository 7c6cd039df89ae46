"""FedHeNN (Makhija et al., ICML 2022): align client representations through CKA.

Every client minimises ``task loss + eta(t) * (1 - CKA(K_i, K_target))`` where ``K_i``
is the kernel of its own representation (``forward_features``) of a Representation
Alignment Dataset (RAD) the server draws each round from its own pool
(``ServerEnv.server_pool.x``; labels are never read, client data never used).

One scheme, ``strategy="fedhenn"``, two variants (run-config ``fedhenn-mode``):

``homogeneous``
    All clients train one architecture (chosen as for ``fedavg``: the weakest
    device's, or ``fedavg-arch``); the server averages weights (FedAvg). The target
    is the kernel of the previous global model on this round's RAD: the client has
    the global weights, so it computes those representations itself (one no-grad,
    eval-mode pass over the RAD) and no kernel is ever sent.
``heterogeneous``
    Every client trains its own architecture (the device-aware choice) and keeps it
    in its state across rounds; no weights travel. Each round a client returns its
    representation of a fresh *probe* RAD; the server averages the clients' kernels
    into ``K_bar`` (uniform weights as in the paper, or by data size or model
    capacity) and sends it next round as a low-rank float16 factor together with
    that RAD (see :mod:`strategies.fedhenn.kbar`).

``eta(t) = eta0 * f(t)`` grows with the round as the paper prescribes; ``f`` is
``sqrt(t - 1)`` by default (the authors' script: ``eta0 * sqrt(iter)``, ``iter``
counted from 0), or ``t - 1``, or constant 1. With ``eta(t) = 0`` nothing of the
alignment happens (no RAD is sent, no extra forward pass, no random draw), so
homogeneous FedHeNN with ``eta0 = 0`` is FedAvg and heterogeneous is ``local``.

Local cost: instead of the whole RAD per minibatch (the authors' script), each
aligned step uses a random subset of ``rad-batch`` RAD rows (the target kernel's
rows for that subset are exact), every ``align-every`` steps, in eval mode (the
target kernels were computed in eval mode, and batch-norm statistics stay those of
the local data). Its forward and backward time is measured and reported per round
(``alignment_seconds``, ``alignment_share``).

Payload schema (records beside the foundation's ``config``/``arrays``/``metrics``):

- down ``fedhenn.align`` (ArrayRecord): ``x`` the RAD rows to align on; in
  heterogeneous mode also ``target``, the ``n x r`` factor of ``K_bar``. A node that
  returned its representation of that RAD when it was the probe keeps the RAD in its
  node state, so ``x`` is left out for it and config ``fedhenn-rad-round`` names the
  round whose probe to use (the RAD crosses the network once, not twice);
- down ``fedhenn.probe`` (ArrayRecord, heterogeneous): ``x`` the RAD to represent;
- down config ``fedhenn-eta`` (this round's eta) and ``fedhenn-mode``;
- up ``fedhenn.rep`` (ArrayRecord, heterogeneous, when probed): ``rep``, the
  ``n x feature_dim`` representation of the probe;
- up ``fedhenn.stats`` (MetricRecord): alignment timing and the mean CKA.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

from models.base import TesseraModel, count_parameters
from strategies.core.client import ClientAlgorithm, Record, RoundInput, RoundOutcome
from strategies.core.context import RoundContext, ServerEnv
from strategies.core.groups import NonFiniteStateError
from strategies.core.registry import Scheme, register_scheme
from strategies.core.strategy import HeteroStrategy
from strategies.core.validation import ClientReply, ReplySchema
from strategies.fedavg import FedAvgOptions, FedAvgStrategy
from strategies.fedhenn.cka import kernel_cka, linear_cka, rbf_cka, rbf_kernel
from strategies.fedhenn.kbar import FactoredKernel, average_kernel, factorise
from tessera import wire
from tessera.config import ConfigError, ConfigReader, RunConfig
from tessera.node_state import NodeState
from tessera.results import ResultsWriter
from tessera.training import LossFn, cross_entropy_loss

log = logging.getLogger("flwr.tessera")

HOMOGENEOUS = "homogeneous"
HETEROGENEOUS = "heterogeneous"
MODES = (HOMOGENEOUS, HETEROGENEOUS)
KERNELS = ("linear", "rbf")
ESTIMATORS = ("biased", "unbiased")
SCHEDULES = ("sqrt", "linear", "constant")
KBAR_WEIGHTS = ("uniform", "data", "capacity")
PRECISIONS = ("float16", "float32")

# Payload schema
ALIGN = "fedhenn.align"
PROBE = "fedhenn.probe"
REP = "fedhenn.rep"
STATS = "fedhenn.stats"
ETA_KEY = "fedhenn-eta"
MODE_KEY = "fedhenn-mode"
RAD_ROUND_KEY = "fedhenn-rad-round"
STATE_PROBE = "fedhenn.probe-rad"
"""Node state: the last probe RAD (``x``) this node represented."""
STATE_PROBE_META = "fedhenn.probe-rad-meta"
"""Node state: ``round`` of that probe."""
STAT_ALIGN_SECONDS = "alignment-seconds"
STAT_SETUP_SECONDS = "setup-seconds"
STAT_REP_SECONDS = "rep-seconds"
STAT_STEPS = "alignment-steps"
STAT_CKA = "cka-mean"
REQUIRED_STATS = (STAT_ALIGN_SECONDS, STAT_SETUP_SECONDS, STAT_REP_SECONDS, STAT_STEPS)

MIN_RAD_ROWS = 4
"""CKA needs a few samples (the unbiased estimator at least 4)."""


# ------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class FedHeNNOptions(FedAvgOptions):
    """FedHeNN's run-config options.

    ``fedavg-arch`` and ``fedavg-exclude-unfit`` choose the shared architecture of the
    homogeneous mode, as for ``fedavg``.

    Attributes
    ----------
    mode : str
        ``fedhenn-mode``: ``"heterogeneous"`` or ``"homogeneous"``.
    kernel : str
        ``cka-kernel``: ``"linear"`` (default) or ``"rbf"``.
    unbiased : bool
        ``cka-estimator="unbiased"`` (default ``"biased"``, the paper's).
    eta0 : float
        ``eta0``: the paper's tuned value for CIFAR, 0.001.
    eta_schedule : str
        ``eta-schedule``: ``"sqrt"`` (``eta0 * sqrt(t - 1)``), ``"linear"``
        (``eta0 * (t - 1)``) or ``"constant"``.
    rad_size : int
        ``rad-size``: the paper's 5000, capped at the server pool's size.
    rad_batch : int
        ``rad-batch``: RAD rows per aligned local step (0: the whole RAD).
    align_every : int
        ``align-every``: align on every k-th local step.
    kbar_weights : str
        ``kbar-weights``: ``"uniform"`` (the paper's 1/N), ``"data"`` or
        ``"capacity"`` (parameter count).
    kbar_energy : float
        ``kbar-energy``: fraction of ``||K_bar||_F^2`` kept by the factor; the CKA of
        the truncated to the exact ``K_bar`` is its square root (0.99 -> 0.995).
    precision : str
        ``fedhenn-precision``: dtype of the RAD, representations and factor on the
        wire, ``"float16"`` or ``"float32"``.
    """

    mode: str = HETEROGENEOUS
    kernel: str = "linear"
    unbiased: bool = False
    eta0: float = 0.001
    eta_schedule: str = "sqrt"
    rad_size: int = 5000
    rad_batch: int = 32
    align_every: int = 1
    kbar_weights: str = "uniform"
    kbar_energy: float = 0.99
    precision: str = "float16"

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FedHeNNOptions:
        """Read and validate the options from the run config.

        Raises
        ------
        ConfigError
            Naming the key, the value and the fix.
        """
        base = FedAvgOptions.parse(run_config)
        r = ConfigReader(run_config, "run-config")

        def choice(key: str, allowed: tuple[str, ...], default: str) -> str:
            value = r.get(key, str, default).strip().lower()
            if value not in allowed:
                raise ConfigError(
                    f"run-config '{key}' is '{value}'; use one of {', '.join(allowed)}"
                )
            return value

        def check(ok: bool, key: str, value: object, fix: str) -> None:
            if not ok:
                raise ConfigError(f"run-config '{key}' is {value!r}; {fix}")

        options = cls(
            arch=base.arch,
            exclude_unfit=base.exclude_unfit,
            mode=choice("fedhenn-mode", MODES, HETEROGENEOUS),
            kernel=choice("cka-kernel", KERNELS, "linear"),
            unbiased=choice("cka-estimator", ESTIMATORS, "biased") == "unbiased",
            eta0=r.get("eta0", float, 0.001),
            eta_schedule=choice("eta-schedule", SCHEDULES, "sqrt"),
            rad_size=r.get("rad-size", int, 5000),
            rad_batch=r.get("rad-batch", int, 32),
            align_every=r.get("align-every", int, 1),
            kbar_weights=choice("kbar-weights", KBAR_WEIGHTS, "uniform"),
            kbar_energy=r.get("kbar-energy", float, 0.99),
            precision=choice("fedhenn-precision", PRECISIONS, "float16"),
        )
        check(options.eta0 >= 0, "eta0", options.eta0, "use a non-negative value, e.g. 0.001")
        check(
            options.rad_size >= MIN_RAD_ROWS,
            "rad-size",
            options.rad_size,
            f"use at least {MIN_RAD_ROWS} samples, e.g. 5000 (capped at the server pool)",
        )
        check(
            options.rad_batch == 0 or options.rad_batch >= MIN_RAD_ROWS,
            "rad-batch",
            options.rad_batch,
            f"use 0 (the whole RAD) or at least {MIN_RAD_ROWS} rows, e.g. 32",
        )
        check(options.align_every >= 1, "align-every", options.align_every, "use 1 or more")
        check(
            0.0 < options.kbar_energy <= 1.0,
            "kbar-energy",
            options.kbar_energy,
            "use a fraction in (0, 1], e.g. 0.99",
        )
        return options

    def eta(self, server_round: int) -> float:
        """Return ``eta(t) = eta0 * f(t)``, 0 in round 1 for the growing schedules."""
        steps = max(server_round - 1, 0)
        if self.eta_schedule == "sqrt":
            return self.eta0 * math.sqrt(steps)
        if self.eta_schedule == "linear":
            return self.eta0 * steps
        return self.eta0

    def describe(self) -> dict[str, Any]:
        """Return the options with their run-config names."""
        return {
            "fedhenn-mode": self.mode,
            "cka-kernel": self.kernel,
            "cka-estimator": "unbiased" if self.unbiased else "biased",
            "eta0": self.eta0,
            "eta-schedule": self.eta_schedule,
            "rad-size": self.rad_size,
            "rad-batch": self.rad_batch,
            "align-every": self.align_every,
            "kbar-weights": self.kbar_weights,
            "kbar-energy": self.kbar_energy,
            "fedhenn-precision": self.precision,
        }


# ------------------------------------------------------------------------- server: RAD
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


# ------------------------------------------------------------------- server: validation
def _stats_problem(content: RecordDict) -> str | None:
    if STATS not in content.metric_records:
        return f"record '{STATS}' missing"
    record = content.metric_records[STATS]
    for key in REQUIRED_STATS:
        if key not in record:
            return f"metric '{key}' missing from the '{STATS}' record"
    for key, value in record.items():
        if isinstance(value, list) or not math.isfinite(float(value)):
            return f"'{STATS}' metric '{key}' must be a finite number, got {value!r}"
    return None


def representation_problem(content: RecordDict, *, rows: int, dim: int) -> str | None:
    """Check a reply's representation of the probe RAD; return a reason to reject.

    Parameters
    ----------
    content : RecordDict
        The reply's records.
    rows : int
        Rows of the probe RAD sent this round.
    dim : int
        The node's architecture's ``feature_dim``.

    Returns
    -------
    str | None
        Why the representation is unusable, or ``None``.
    """
    if REP not in content.array_records or "rep" not in content.array_records[REP]:
        return f"record '{REP}' with array 'rep' missing (the RAD representation)"
    try:
        rep = content.array_records[REP]["rep"].numpy()
    except Exception as err:
        return f"representation cannot be decoded: {err}"
    if rep.ndim != 2 or rep.shape[1] != dim:
        return f"representation has shape {rep.shape}, expected ({rows}, {dim})"
    if rep.shape[0] != rows:
        return f"representation has {rep.shape[0]} rows but the RAD has {rows}"
    if not np.issubdtype(rep.dtype, np.floating):
        return f"representation has dtype {rep.dtype}, expected floating point"
    values = rep.astype(np.float64)
    if not np.all(np.isfinite(values)):
        return "representation has non-finite values"
    if float(np.linalg.norm(values - values.mean(axis=0, keepdims=True))) <= 1e-12:
        return "representation has zero norm after centring (all RAD samples map to one point)"
    return None


def _stat(reply: ClientReply, key: str) -> float:
    return float(reply.content.metric_records[STATS][key])  # type: ignore[arg-type]


def alignment_metrics(replies: Sequence[ClientReply], eta: float) -> dict[str, Any]:
    """Round metrics on the clients' alignment work (from validated replies)."""
    per_client = []
    align_total, busy_total = 0.0, 0.0
    ckas = []
    for rep in sorted(replies, key=lambda r: r.node_id):
        align = _stat(rep, STAT_ALIGN_SECONDS)
        setup = _stat(rep, STAT_SETUP_SECONDS) + _stat(rep, STAT_REP_SECONDS)
        train = rep.metrics[wire.TRAIN_SECONDS]
        entry: dict[str, Any] = {
            "node": rep.node_id,
            "alignment_seconds": align,
            "setup_seconds": setup,
            "alignment_steps": int(_stat(rep, STAT_STEPS)),
            "alignment_share": (align + setup) / max(train + setup, 1e-12),
        }
        if STAT_CKA in rep.content.metric_records[STATS]:
            entry["cka"] = _stat(rep, STAT_CKA)
            ckas.append(entry["cka"])
        per_client.append(entry)
        align_total += align + setup
        busy_total += train + setup
    return {
        "eta": eta,
        "alignment_seconds": align_total / max(len(per_client), 1),
        "alignment_share": align_total / busy_total if busy_total > 0 else 0.0,
        "cka_mean": float(np.mean(ckas)) if ckas else None,
        "fedhenn_clients": per_client,
    }


# ------------------------------------------------------------- server: homogeneous mode
class FedHeNNHomogeneousStrategy(FedAvgStrategy):
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


# ----------------------------------------------------------- server: heterogeneous mode
@dataclass(frozen=True)
class AlignmentTarget:
    """A ``K_bar`` ready to ship: the RAD it was built on and its factor."""

    x: np.ndarray
    kernel: FactoredKernel
    built_in_round: int


class FedHeNNHeterogeneousStrategy(HeteroStrategy):
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
            server_round < self.env.run.num_server_rounds and self.options.eta(server_round + 1) > 0
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

    def _weights(self, replies: Sequence[ClientReply]) -> list[float]:
        if self.options.kbar_weights == "data":
            return [r.weight for r in replies]
        if self.options.kbar_weights == "capacity":
            for r in replies:
                self._feature_dim(r.arch)
            return [float(self._capacities[r.arch]) for r in replies]
        return [1.0] * len(replies)

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
        reps = [r.content.array_records[REP]["rep"].numpy() for r in replies] if probed else []
        rep_bytes = float(np.mean([rep.nbytes for rep in reps])) if reps else 0.0
        # Per client and round: what n x n float32 kernels would weigh (K_i up when
        # probed, K_bar down when aligning) against what is shipped instead.
        out["kernel_bytes_naive"] = 4 * n * n * (int(probed) + int(aligned))
        out["kernel_bytes_sent"] = rep_bytes + shipped
        out["kbar_bytes_down"] = shipped
        out["rep_bytes_up"] = rep_bytes
        out["rad_rows"] = n if probed or aligned else 0
        if not reps:
            return out
        started = time.perf_counter()
        run = self.env.run
        exact = average_kernel(
            reps,
            self._weights(replies),
            kernel=self.options.kernel,
            merge=run.knowledge_merge,
            trim_fraction=run.trim_fraction,
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
) -> HeteroStrategy:
    """Build the server side of the mode ``options.mode``."""
    if options.mode == HOMOGENEOUS:
        return FedHeNNHomogeneousStrategy(env=env, options=options, results=results)
    return FedHeNNHeterogeneousStrategy(env=env, options=options, results=results)


# ----------------------------------------------------------------------------- client
def alignment_cka(
    features: torch.Tensor,
    target: torch.Tensor,
    *,
    kernel: str,
    target_is_factor: bool,
    unbiased: bool,
) -> torch.Tensor:
    """CKA between a client's features and its target on the same RAD rows.

    Parameters
    ----------
    features : torch.Tensor
        ``m x d`` representation of the client (differentiable).
    target : torch.Tensor
        ``m x k``: the global model's representation (homogeneous) or the rows of
        ``K_bar``'s factor (heterogeneous, ``K_bar = target @ target.T``).
    kernel : str
        ``"linear"`` or ``"rbf"``.
    target_is_factor : bool
        Whether ``target`` is a kernel factor rather than a representation.
    unbiased : bool
        Unbiased HSIC estimator.

    Returns
    -------
    torch.Tensor
        A differentiable scalar in ``[0, 1]``.
    """
    if kernel == "linear":
        # linear CKA of (features, F) is the CKA of their linear kernels, i.e. of K_bar
        return linear_cka(features, target, unbiased=unbiased)
    if target_is_factor:
        return kernel_cka(rbf_kernel(features), target @ target.T, unbiased=unbiased)
    return rbf_cka(features, target, unbiased=unbiased)


def _tensor(record: ArrayRecord, key: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(record[key].numpy(), dtype=np.float32)).to(device)


class FedHeNNClient(ClientAlgorithm):
    """Client side of FedHeNN: cross-entropy plus ``eta * (1 - CKA)`` on RAD subsets.

    The mode is decided here, from the options. Homogeneous: the node trains the
    received global model, sends its weights, and aligns to that model's own
    representation of the RAD. Heterogeneous: the node keeps a personal model in its
    state, sends no weights, aligns to the factor of ``K_bar`` and reports its
    representation of the probe RAD, which it also keeps in its state (the server
    then need not send that RAD again when it aligns on it next round).
    """

    def __init__(self, *, run: RunConfig, options: FedHeNNOptions) -> None:
        super().__init__(run=run, options=options)
        self.options: FedHeNNOptions = options
        self.heterogeneous = options.mode == HETEROGENEOUS
        self.target_is_factor = self.heterogeneous
        self.sends_weights = not self.heterogeneous
        self.keeps_personal_model = self.heterogeneous
        self.eta = 0.0
        self.server_round = 0
        self.align_x: torch.Tensor | None = None
        self.align_target: torch.Tensor | None = None
        self.probe_x: np.ndarray | None = None
        self.align_seconds = 0.0
        self.setup_seconds = 0.0
        self.rep_seconds = 0.0
        self.steps = 0
        self.ckas: list[float] = []

    # ------------------------------------------------------------------ round setup
    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Read eta, the alignment target and (heterogeneous) the probe RAD."""
        content, config = rnd.content, rnd.config
        self.server_round = rnd.server_round
        if self.heterogeneous and PROBE in content.array_records:
            self.probe_x = content.array_records[PROBE]["x"].numpy()
        self.eta = float(config.get(ETA_KEY, 0.0))  # type: ignore[arg-type]
        if self.eta <= 0 or ALIGN not in content.array_records:
            self.eta = 0.0
            return
        started = time.perf_counter()
        device = next(model.parameters()).device
        record = content.array_records[ALIGN]
        x = self._alignment_rows(record, config, state, device)
        expected = tuple(_as_tessera(model).input_shape)
        if tuple(x.shape[1:]) != expected or x.shape[0] < MIN_RAD_ROWS:
            raise ConfigError(
                f"the RAD has samples of shape {tuple(x.shape)} but the model takes "
                f"(N >= {MIN_RAD_ROWS}, {', '.join(map(str, expected))}); server and "
                "client disagree on the task"
            )
        self.align_x = x
        self.align_target = self.prepare_target(model, record, x, device)
        if self.align_target.shape[0] != x.shape[0]:
            raise ConfigError(
                f"the alignment target has {self.align_target.shape[0]} rows but the RAD "
                f"has {x.shape[0]}; server and client run different FedHeNN code"
            )
        self.setup_seconds += time.perf_counter() - started

    def _alignment_rows(
        self, record: ArrayRecord, config: ConfigRecord, state: NodeState, device: torch.device
    ) -> torch.Tensor:
        """Return the RAD to align on: sent with the target, or the probe kept in node state."""
        if "x" in record:
            return _tensor(record, "x", device)
        wanted = config.get(RAD_ROUND_KEY)
        meta = state.config(STATE_PROBE_META)
        kept = state.arrays(STATE_PROBE)
        held = None if meta is None else int(meta.get("round", -1))  # type: ignore[arg-type]
        if wanted is None or kept is None or held != int(wanted):  # type: ignore[arg-type]
            raise ConfigError(
                f"the server sent no RAD and expects this node to keep the probe of round "
                f"{wanted!r}, but its state holds round {held}; the node's state was lost "
                "(restart without node-config 'state-dir'?) - the server sends the RAD "
                "again next time"
            )
        return _tensor(kept, "x", device)

    def prepare_target(
        self, model: nn.Module, record: ArrayRecord, x: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """Return the target of this round on the RAD rows ``x``.

        Homogeneous: the just-loaded global model's representation of the RAD (no
        grad, eval mode). Heterogeneous: the factor of ``K_bar`` the server sent.
        """
        if not self.heterogeneous:
            return _eval_features(model, x)
        if "target" not in record:
            raise ConfigError(f"record '{ALIGN}' has no 'target' (the factor of K_bar)")
        target = _tensor(record, "target", device)
        if target.dim() != 2:
            raise ConfigError(f"K_bar's factor must be 2-d, got shape {tuple(target.shape)}")
        return target

    # ------------------------------------------------------------------- objective
    def loss_fn(self) -> LossFn:
        """Plain cross-entropy when eta is 0, else cross-entropy plus the CKA term.

        The alignment term's backward pass runs inside this function (its gradients
        accumulate in ``.grad`` before the training loop's backward adds the task
        gradients; the sum is the gradient of the full objective), so that its
        forward and backward time can be measured. The returned loss is
        ``task + alignment`` with the alignment part detached.
        """
        if self.eta <= 0 or self.align_x is None or self.align_target is None:
            return cross_entropy_loss
        x_rad, target = self.align_x, self.align_target
        eta, every, n = self.eta, self.options.align_every, int(x_rad.shape[0])
        batch = self.options.rad_batch if 0 < self.options.rad_batch < n else n
        gen = torch.Generator().manual_seed(self.run.seed * 1_000_003 + self.server_round)
        step = [0]

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            task = nn.functional.cross_entropy(model(x), y)
            step[0] += 1
            if (step[0] - 1) % every != 0:
                return task
            started = time.perf_counter()
            if batch < n:
                idx = torch.randperm(n, generator=gen)[:batch].to(x_rad.device)
                rows, goal = x_rad[idx], target[idx]
            else:
                rows, goal = x_rad, target
            tessera_model = _as_tessera(model)
            tessera_model.eval()  # target kernels were made in eval mode; keep BN stats local
            try:
                features = tessera_model.forward_features(rows)
            finally:
                tessera_model.train()
            cka = alignment_cka(
                features,
                goal,
                kernel=self.options.kernel,
                target_is_factor=self.target_is_factor,
                unbiased=self.options.unbiased,
            )
            align = eta * (1.0 - cka)
            if not torch.isfinite(align):
                raise FloatingPointError(f"the CKA alignment term became {align.item()}")
            align.backward()  # type: ignore[no-untyped-call]
            self.align_seconds += time.perf_counter() - started
            self.steps += 1
            self.ckas.append(float(cka.detach()))
            total: torch.Tensor = task + align.detach()
            return total

        return loss

    # ---------------------------------------------------------------------- replies
    def stats_record(self) -> MetricRecord:
        """Return the ``fedhenn.stats`` record."""
        values: dict[str, float | int] = {
            STAT_ALIGN_SECONDS: self.align_seconds,
            STAT_SETUP_SECONDS: self.setup_seconds,
            STAT_REP_SECONDS: self.rep_seconds,
            STAT_STEPS: self.steps,
        }
        if self.ckas:
            values[STAT_CKA] = float(np.mean(self.ckas))
        return MetricRecord(values)  # type: ignore[arg-type]

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Return the base records, the statistics and, when probed, the representation."""
        records = super().finish_round(model, rnd, outcome, state)
        if self.probe_x is not None:
            started = time.perf_counter()
            x = torch.from_numpy(np.asarray(self.probe_x, dtype=np.float32)).to(outcome.device)
            rep = _eval_features(model, x).cpu().numpy().astype(self.options.precision)
            records[REP] = wire.numpy_to_record({"rep": rep})
            self.rep_seconds += time.perf_counter() - started
        records[STATS] = self.stats_record()
        return records

    def save_state(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Keep the personal model (heterogeneous) and the probe RAD just represented."""
        super().save_state(model, rnd, state)
        if self.probe_x is not None:
            state.put(STATE_PROBE, wire.numpy_to_record({"x": self.probe_x}))
            state.put(STATE_PROBE_META, ConfigRecord({"round": rnd.server_round}))


def _as_tessera(model: nn.Module) -> TesseraModel:
    if not isinstance(model, TesseraModel):
        raise TypeError(
            f"FedHeNN needs a TesseraModel with forward_features, got {type(model).__name__}"
        )
    return model


@torch.no_grad()
def _eval_features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    tessera_model = _as_tessera(model)
    was_training = tessera_model.training
    tessera_model.eval()
    try:
        return tessera_model.forward_features(x).detach()
    finally:
        tessera_model.train(was_training)


SCHEME = register_scheme(
    Scheme(
        name="fedhenn",
        server=fedhenn_server,
        server_classes=(FedHeNNHomogeneousStrategy, FedHeNNHeterogeneousStrategy),
        client=FedHeNNClient,
        parse_options=FedHeNNOptions.parse,
        default_family="cnn",
        description=(
            "FedHeNN: CKA alignment of representations on a server-drawn RAD "
            "(fedhenn-mode heterogeneous: personal models; homogeneous: FedAvg)"
        ),
    )
)


__all__ = [
    "ALIGN",
    "PROBE",
    "REP",
    "SCHEME",
    "STATS",
    "FedHeNNClient",
    "FedHeNNHeterogeneousStrategy",
    "FedHeNNHomogeneousStrategy",
    "FedHeNNOptions",
    "RadSampler",
    "alignment_cka",
    "alignment_metrics",
    "fedhenn_server",
    "representation_problem",
]
