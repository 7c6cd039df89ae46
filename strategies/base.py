"""The base of every heterogeneous scheme: the round loop and the hooks schemes override.

:class:`HeteroStrategy` owns the round loop (template method); it does not reuse
Flower's ``Strategy.start`` because what it does differs, not only its side
effects:

- a ``query.handshake`` before round 1 (and for nodes that join later) through which
  each node reports its device profile, its data and the architecture it chose;
- client sampling per round (run-config ``fraction-train``, ``min-train-nodes``,
  seeded), and ``min-nodes`` checked every round;
- one training exchange per round (clients evaluate their personalised model on their
  own test split inside the same exchange, so there is no second round trip), bounded
  by ``round-timeout``; transient SuperLink errors are retried;
- every reply validated before any arithmetic (:mod:`strategies.validation`) and
  folded into the scheme's state *as it is pulled* (weights through the injected
  :class:`~strategies.aggregators.Aggregator`), so server memory does not grow with
  the number of clients;
- a quorum: a round with fewer than ``min-replies`` accepted replies keeps the
  previous global state and is recorded as skipped; ``max-failed-rounds`` skipped
  rounds in a row stop the run with an error naming the cause;
- results written at the end of every round (:mod:`tessera.results`) and the
  server's state checkpointed (``checkpoint-every``), so that run-config
  ``resume=<results dir>`` continues a run with no round lost or counted twice.

Per-round state travels in a :class:`RoundContext` handed to every hook. Subclasses
override hooks only: :meth:`~HeteroStrategy.assign_architectures`,
:meth:`~HeteroStrategy.select_nodes`, :meth:`~HeteroStrategy.node_content`,
:meth:`~HeteroStrategy.train_config`, :meth:`~HeteroStrategy.reply_schema`,
:meth:`~HeteroStrategy.fold`, :meth:`~HeteroStrategy.aggregate`,
:meth:`~HeteroStrategy.discard`, :meth:`~HeteroStrategy.evaluate`,
:meth:`~HeteroStrategy.end_of_run`, :meth:`~HeteroStrategy.global_models`,
:meth:`~HeteroStrategy.describe`, and :meth:`~HeteroStrategy.state_dict` /
:meth:`~HeteroStrategy.load_state_dict` for what their server keeps.

Randomness: the generator of round ``t`` is ``numpy.random.default_rng([seed, t])``,
so a resumed run draws exactly what an uninterrupted one would; there is no hidden
RNG state to checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from strategies.aggregation import mean_std
from strategies.aggregators import Aggregator, AggregatorSettings, get_aggregator
from strategies.exchange import (
    POLL_INTERVAL,
    ExchangeResult,
    connected_nodes,
    exchange,
    is_simulation,
    wait_for_nodes,
)
from strategies.groups import NonFiniteStateError
from strategies.validation import (
    ArraySpec,
    ClientReply,
    Rejection,
    ReplyLimits,
    ReplySchema,
    short_reason,
    validate_reply,
    weight_caps,
)
from tessera import wire
from tessera.attacks import attack_assignment
from tessera.config import ConfigError, RunConfig
from tessera.data import ArrayDataset
from tessera.results import TABLE_HEADER, ResultsWriter, format_round_row

log = logging.getLogger("flwr.tessera")
_T = TypeVar("_T")

FEDERATION = "federation"
"""Config key of the federation id sent with every message (keys node state)."""

__all__ = [
    "POLL_INTERVAL",
    "ExchangeResult",
    "HeteroStrategy",
    "NodeInfo",
    "RoundContext",
    "ServerEnv",
    "exchange",
    "is_simulation",
    "parse_handshake",
    "wait_for_nodes",
]


@dataclass(frozen=True)
class ServerEnv:
    """What the server knows about the task, resolved once by the ServerApp.

    Attributes
    ----------
    run : RunConfig
        The common run configuration.
    num_classes : int
        Number of classes of the dataset.
    input_shape : tuple[int, ...]
        Per-sample input shape.
    global_test : ArrayDataset
        The held-out test set the server evaluates global models on.
    server_pool : ArrayDataset
        Server-side data that never overlaps client data (alignment data, tuning
        sets); labels are there but schemes that need unlabelled data must not use
        them.
    family : str
        The architecture family in use.
    """

    run: RunConfig
    num_classes: int
    input_shape: tuple[int, ...]
    global_test: ArrayDataset
    server_pool: ArrayDataset
    family: str


@dataclass(frozen=True)
class NodeInfo:
    """A node as it described itself in the handshake."""

    node_id: int
    arch: str
    family: str
    size_rank: int
    arch_fits: bool
    num_train: int
    num_test: int
    partition_id: int
    label_counts: tuple[int, ...]
    profile: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe description for ``config.json`` and checkpoints."""
        return {
            "node": self.node_id,
            "partition_id": self.partition_id,
            "arch": self.arch,
            "family": self.family,
            "size_rank": self.size_rank,
            "arch_fits": self.arch_fits,
            "num_train": self.num_train,
            "num_test": self.num_test,
            "label_counts": list(self.label_counts),
            "profile": self.profile,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeInfo:
        """Inverse of :meth:`to_dict`."""
        return cls(
            node_id=int(data["node"]),
            arch=str(data["arch"]),
            family=str(data["family"]),
            size_rank=int(data["size_rank"]),
            arch_fits=bool(data["arch_fits"]),
            num_train=int(data["num_train"]),
            num_test=int(data["num_test"]),
            partition_id=int(data["partition_id"]),
            label_counts=tuple(int(c) for c in data["label_counts"]),
            profile=dict(data["profile"]),
        )


@dataclass
class RoundContext:
    """Everything about one round that the hooks need, passed to each of them.

    Attributes
    ----------
    server_round : int
        The round number (1-based).
    num_rounds : int
        Rounds of the whole run.
    rng : np.random.Generator
        This round's generator, ``default_rng([seed, server_round])``.
    eligible : dict[int, str]
        Nodes that could train this round and their architectures.
    assignment : dict[int, str]
        Nodes selected to train this round (a subset of ``eligible``).
    bytes_down : dict[int, int]
        Payload bytes sent to each node.
    failures : dict[int, str]
        Nodes that failed (error reply, no reply) and why.
    accepted : list[ClientReply]
        Replies that passed validation and were folded.
    rejected : list[Rejection]
        Replies that did not, with the reason.
    started : float
        ``time.monotonic()`` at the start of the round.
    schemas : dict[int, ReplySchema]
        What each selected node's reply must contain.
    limits : dict[int, ReplyLimits]
        What each selected node's reply may claim (from its handshake).
    phases : dict[str, float]
        Seconds the server spent in each phase of the round (``handshake``, ``build``,
        ``exchange``, and within it ``pull`` and ``fold``, ``aggregate``,
        ``evaluate``), for the round record.
    shared : dict
        Records built once this round and put into several messages (:meth:`share`).
    """

    server_round: int
    num_rounds: int
    rng: np.random.Generator
    eligible: dict[int, str] = field(default_factory=dict)
    assignment: dict[int, str] = field(default_factory=dict)
    bytes_down: dict[int, int] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    accepted: list[ClientReply] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    phases: dict[str, float] = field(default_factory=dict)
    shared: dict[Hashable, Any] = field(default_factory=dict)

    def share(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """Return ``build()``, built once per round per ``key`` and shared afterwards.

        Records every node of a group receives (a global model as an
        :class:`~flwr.app.ArrayRecord`) are built once and put into each message,
        as Flower's own strategies do: the round then holds one copy per
        architecture instead of one per node, and measuring the payloads
        (:func:`tessera.wire.payload_sizes`) serialises each once.
        """
        if key not in self.shared:
            self.shared[key] = build()
        return cast("_T", self.shared[key])

    schemas: dict[int, ReplySchema] = field(default_factory=dict)
    limits: dict[int, ReplyLimits] = field(default_factory=dict)


class RunStoppedError(RuntimeError):
    """The run cannot go on (too many skipped rounds, too few nodes)."""


def server_memory_mb() -> dict[str, float]:
    """Return this process's resident memory now and at its peak, in MiB (Linux).

    ``rss`` is read from ``/proc/self/statm`` (0 where there is no ``/proc``), ``peak``
    is ``ru_maxrss``, the high-water mark since the process started.
    """
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        rss = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        rss = 0.0
    return {"rss": round(rss, 1), "peak": round(peak, 1)}


def parse_handshake(
    reply: Message, known_archs: Sequence[str], *, num_classes: int | None = None
) -> NodeInfo | Rejection:
    """Validate a handshake reply into a :class:`NodeInfo`.

    Nothing a node declares is taken on trust where the server can check it: the
    architecture must be registered, its family and size rank must be the registry's
    (a node cannot claim a rank that moves everyone onto its architecture), the label
    counts must be non-negative, one per class of the task, and sum to ``num-train``.
    """
    node_id = int(reply.metadata.src_node_id)
    if reply.has_error():
        return Rejection(
            node_id,
            f"handshake failed (code {reply.error.code}): {short_reason(reply.error.reason or '')}",
        )
    if wire.PROFILE not in reply.content.config_records:
        return Rejection(node_id, "handshake reply has no 'profile' record")
    rec = reply.content.config_records[wire.PROFILE]
    try:
        arch = str(rec["arch"])
        counts = tuple(int(c) for c in rec["label-counts"])  # type: ignore[union-attr]
        info = NodeInfo(
            node_id=node_id,
            arch=arch,
            family=str(rec["family"]),
            size_rank=int(rec["size-rank"]),  # type: ignore[arg-type]
            arch_fits=bool(rec["arch-fits"]),
            num_train=int(rec["num-train"]),  # type: ignore[arg-type]
            num_test=int(rec["num-test"]),  # type: ignore[arg-type]
            partition_id=int(rec["partition-id"]),  # type: ignore[arg-type]
            label_counts=counts,
            profile={k[len("device-") :]: v for k, v in rec.items() if k.startswith("device-")},
        )
    except (KeyError, TypeError, ValueError) as err:
        return Rejection(node_id, f"handshake profile is malformed: {err}")
    if info.arch not in set(known_archs):
        return Rejection(node_id, f"handshake names unknown architecture '{info.arch}'")
    problem = _handshake_problem(info, num_classes)
    if problem is not None:
        return Rejection(node_id, problem)
    return info


def _handshake_problem(info: NodeInfo, num_classes: int | None) -> str | None:
    from models import model_entry

    if info.num_train <= 0:
        return f"handshake reports num-train={info.num_train}"
    if info.num_test < 0:
        return f"handshake reports num-test={info.num_test}"
    from models.spec import split_name

    model, spec = split_name(info.arch)
    entry = model_entry(model)
    if spec is not None:
        # a slice's size rank is derived from its measured cost on the device, not
        # declared; the server never orders nodes by it
        if info.family != entry.family:
            return (
                f"handshake claims family '{info.family}' for '{info.arch}', a slice of "
                f"'{model}' of family '{entry.family}'"
            )
    elif info.family != entry.family or info.size_rank != entry.size_rank:
        return (
            f"handshake claims family '{info.family}' and size-rank {info.size_rank} for "
            f"'{info.arch}', which the registry has as family '{entry.family}', size-rank "
            f"{entry.size_rank}"
        )
    if num_classes is not None and len(info.label_counts) != num_classes:
        return (
            f"handshake has {len(info.label_counts)} label counts but the task has "
            f"{num_classes} classes"
        )
    if any(c < 0 for c in info.label_counts):
        return f"handshake has negative label counts {list(info.label_counts)[:10]}"
    if sum(info.label_counts) != info.num_train:
        return (
            f"handshake label counts sum to {sum(info.label_counts)} but num-train is "
            f"{info.num_train}"
        )
    return None


RESUME_IDENTITY_KEYS = (
    "strategy",
    "dataset",
    "partitioner",
    "dirichlet-alpha",
    "classes-per-client",
    "server-pool-fraction",
    "local-test-fraction",
    "seed",
    "model-family",
    "norm",
)
"""Run-config keys a resumed run must share with the checkpoint (they define the
experiment); the others (rounds, timeouts, quorum) may change on resume."""


class HeteroStrategy:
    """Base class of Tessera's schemes (see the module docstring).

    Parameters
    ----------
    env : ServerEnv
        Task description and server-side data.
    options : Any
        The scheme's own typed options (its ``Options.parse`` result).
    results : ResultsWriter | None
        Where round records and checkpoints go; ``None`` keeps them in memory only.
    aggregator : Aggregator | None
        Folds weight updates; by default the one named by run-config ``aggregator``.
    """

    name: ClassVar[str] = "hetero"

    def __init__(
        self,
        *,
        env: ServerEnv,
        options: Any,
        results: ResultsWriter | None,
        aggregator: Aggregator | None = None,
    ) -> None:
        self.env = env
        self.options = options
        self.results = results
        self.aggregator = (
            aggregator
            if aggregator is not None
            else get_aggregator(env.run.aggregator, AggregatorSettings.from_run(env.run))
        )
        self.server_trust = env.run.server_trust
        """Run-config ``server-trust`` (see :meth:`pool_direction`)."""
        self.weight_cap = env.run.weight_cap
        """Run-config ``weight-cap`` (see :func:`strategies.validation.weight_caps`)."""
        self.federation = f"{self.name}-{uuid.uuid4().hex[:12]}"
        self.nodes: dict[int, NodeInfo] = {}
        self.assignment: dict[int, str] = {}
        self.excluded: dict[int, str] = {}
        self.rounds: list[dict[str, Any]] = list(results.rounds) if results is not None else []
        """Round records, those of before a resume included."""
        self.completed_round = 0
        self.failed_streak = 0
        self.final_metrics: dict[str, Any] = {}
        self._templates: dict[str, dict[str, np.ndarray]] = {}
        self._handshake_rejections: list[Rejection] = []

    # ------------------------------------------------------------------ models
    def build_model(self, arch: str) -> torch.nn.Module:
        """Build a fresh model of ``arch`` for this task (seeded by run-config seed)."""
        from models import get_model

        torch.manual_seed(self.env.run.seed)
        return get_model(
            arch,
            input_shape=self.env.input_shape,
            num_classes=self.env.num_classes,
            norm=self.env.run.norm,
            flat_input=self.env.run.flat_input,
        )

    def initial_arrays(self, arch: str) -> dict[str, np.ndarray]:
        """Seeded initial weights of ``arch`` (the same in every process)."""
        if arch not in self._templates:
            model = self.build_model(arch)
            self._templates[arch] = {
                k: v.numpy().copy() for k, v in wire.exchanged_state(model.state_dict()).items()
            }
        return {k: v.copy() for k, v in self._templates[arch].items()}

    def pool_direction(
        self, arch: str, weights: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray] | None:
        """Return the server's own update of ``arch``'s ``weights`` on its pool, or ``None``.

        The server trains a copy of the global model on its server pool (data no
        client holds) with the clients' schedule (``local-epochs``, ``batch-size``,
        the SGD settings), seeded by the run and the round, and returns trained
        minus ``weights`` per floating entry: the direction the bounded ``mean``
        compares each update with (FLTrust's trusted root update, Cao et al. NDSS
        2021; run-config ``trust-threshold``). ``None`` when run-config
        ``server-trust`` is off, the pool is empty, or the update is not finite.
        """
        from tessera.training import OptimConfig, cross_entropy_loss, train_model

        run = self.env.run
        pool = self.env.server_pool
        if (
            not self.server_trust
            or len(pool) == 0
            or self.aggregator.name != "mean"
            or run.clip_factor <= 0
        ):
            return None  # only the bounded mean checks directions
        model = self.build_model(arch)
        model.load_state_dict(
            {k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False
        )
        optim = OptimConfig(
            run.local_epochs, run.batch_size, run.learning_rate, run.momentum, run.weight_decay
        )
        round_seed = run.seed * 7919 + self.completed_round + 1
        train_model(
            model,
            pool,
            optim=optim,
            device=torch.device("cpu"),
            seed=round_seed,
            loss_fn=cross_entropy_loss,
        )
        trained = wire.exchanged_state(model.state_dict())
        out: dict[str, np.ndarray] = {}
        for key, value in weights.items():
            if key in trained and np.issubdtype(value.dtype, np.floating):
                out[key] = (trained[key].detach().numpy() - value).astype(value.dtype)
        if not all(np.all(np.isfinite(v)) for v in out.values()):
            log.warning("the server's own update of '%s' on its pool is not finite; unused", arch)
            return None
        return out

    def array_spec(self, arch: str) -> ArraySpec:
        """Return the expected names, shapes and dtypes of ``arch``'s arrays."""
        if arch not in self._templates:
            self.initial_arrays(arch)
        return {k: (tuple(v.shape), str(v.dtype)) for k, v in self._templates[arch].items()}

    # ------------------------------------------------------------------- hooks
    def known_archs(self) -> list[str]:
        """Architectures a node may name in the handshake (default: every registered model)."""
        from models import list_models

        return list_models()

    def refuse_node(self, info: NodeInfo) -> str | None:
        """Return why a node that passed the handshake checks may not join, or None.

        Called once per node, after :func:`parse_handshake` has checked its profile
        against the registry; a reason rejects the node (logged, in ``config.json``).
        Default: every node may join.
        """
        return None

    def assign_architectures(self, nodes: Mapping[int, NodeInfo]) -> dict[int, str | None]:
        """Map each node to the architecture it trains (``None`` leaves it out).

        Default: the architecture each device chose for itself.
        """
        return {node_id: info.arch for node_id, info in nodes.items()}

    def select_nodes(self, ctx: RoundContext) -> list[int]:
        """Choose this round's trainers among ``ctx.eligible``.

        ``max(min-train-nodes, ceil(fraction-train * eligible))`` nodes (all when
        that is at least the number eligible), drawn without replacement with the
        round's generator from the eligible nodes ordered by partition, then node id
        (partitions are stable across restarts, node ids are not).
        """
        order = sorted(
            ctx.eligible, key=lambda n: (self.nodes[n].partition_id if n in self.nodes else -1, n)
        )
        run = self.env.run
        want = max(run.min_train_nodes, math.ceil(run.fraction_train * len(order)))
        if want >= len(order):
            return order
        picked = ctx.rng.choice(len(order), size=want, replace=False)
        return [order[i] for i in sorted(int(i) for i in picked)]

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Build the records sent to one node this round (the base: only the config)."""
        return RecordDict({wire.CONFIG: self.train_config(ctx, node_id, arch)})

    def train_config(self, ctx: RoundContext, node_id: int, arch: str) -> ConfigRecord:
        """Build the ``config`` record: round, architecture and task shape."""
        return ConfigRecord(
            {
                "server-round": ctx.server_round,
                "arch": arch,
                "num-classes": self.env.num_classes,
                "input-shape": list(self.env.input_shape),
                FEDERATION: self.federation,
            }
        )

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """Return what this node's reply must contain (default: metrics only)."""
        return ReplySchema(arrays=None)

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Fold one accepted reply into this round's state, as soon as it is pulled.

        Returns the reply to keep for the round's record and :meth:`aggregate`;
        schemes that fold weights return it without them, so the arrays can be
        freed. Raising rejects the reply (logged, counted) and leaves the state as
        it was before.
        """
        return reply

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Finish the round (it reached its quorum); return extra round-level metrics."""
        return {}

    def discard(self, ctx: RoundContext) -> None:
        """Drop what :meth:`fold` gathered: the round is skipped."""

    def evaluate(self, ctx: RoundContext) -> dict[str, Any]:
        """Server-side evaluation after the round; merged into the round record.

        Default: accuracy of every global model on the server's test set
        (``global_accuracy`` is their mean, ``None`` when the scheme has none).
        """
        by_arch = self.evaluate_global()
        out: dict[str, Any] = {
            "global_accuracy": float(np.mean(list(by_arch.values()))) if by_arch else None,
            "global_accuracy_by_arch": by_arch,
        }
        if "label-flip" in self.env.run.attack and by_arch:
            success = self.evaluate_global(flipped=True)
            out["attack_success_by_arch"] = success
            out["attack_success"] = float(np.mean(list(success.values())))
        return out

    def end_of_run(self, ctx: RoundContext) -> dict[str, Any]:
        """Finish the run after its last round; the result goes to ``summary.json``."""
        return {}

    def global_models(self) -> Mapping[str, dict[str, np.ndarray]]:
        """Global model(s) to evaluate on the server test set, by architecture."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Scheme-specific settings for ``config.json``."""
        return {}

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run: node table, counters, scheme state.

        Subclasses add their own entries (``super().state_dict() | {...}``).
        """
        return {
            "scheme": self.name,
            "round": self.completed_round,
            "federation": self.federation,
            "failed_streak": self.failed_streak,
            "run_config": self.env.run.to_dict(),
            "nodes": [info.to_dict() for _, info in sorted(self.nodes.items())],
            "excluded": {str(n): r for n, r in sorted(self.excluded.items())},
            "handshake_rejections": [
                {"node": r.node_id, "reason": r.reason} for r in self._handshake_rejections
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the base part); subclasses restore theirs.

        Every field is checked before anything is restored: the checkpoint must
        record the ``run_config`` it was written under, with every key of
        :data:`RESUME_IDENTITY_KEYS` equal to this run's, and each field must have
        its type (the round and counters non-negative integers, the federation id a
        safe name, every node entry complete).

        Raises
        ------
        ConfigError
            If the checkpoint is of another scheme or another experiment.
        CheckpointError
            If a field is missing or malformed; the message names the file, the
            field and the fix.
        """
        from tessera.checkpoint import refusal
        from tessera.state_checks import (
            SAFE_ID,
            StateFileError,
            get_int,
            get_list,
            get_mapping,
            get_str,
            int_list,
        )

        if state.get("scheme") != self.name:
            raise ConfigError(
                f"the checkpoint is of scheme '{state.get('scheme')}' but run-config "
                f"'strategy' is '{self.name}'; resume with the same strategy"
            )
        try:
            saved = get_mapping(state, "run_config")
            missing = [k for k in RESUME_IDENTITY_KEYS if k not in saved]
            if missing:
                raise StateFileError(
                    "run_config",
                    f"lacks the keys that define the experiment {missing}, so it cannot "
                    "be told apart from another experiment's",
                )
        except StateFileError as err:
            raise refusal(state, err) from err
        current = self.env.run.to_dict()
        changed = [
            f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
            for k in RESUME_IDENTITY_KEYS
            if saved.get(k) != current.get(k)
        ]
        if changed:
            raise ConfigError(
                "cannot resume: run-config keys that define the experiment differ from the "
                f"checkpoint's ({'; '.join(changed)}); use the original values"
            )
        try:
            completed = get_int(state, "round")
            federation = get_str(state, "federation")
            if not SAFE_ID.match(federation):
                raise StateFileError(
                    "federation", f"is {federation!r}; expected a safe folder name"
                )
            streak = get_int(state, "failed_streak", default=0)
            nodes: dict[int, NodeInfo] = {}
            for i, entry in enumerate(get_list(state, "nodes", default=[])):
                where = f"nodes[{i}]"
                if not isinstance(entry, Mapping):
                    raise StateFileError(where, f"is {type(entry).__name__}; expected a mapping")
                any_int = -(2**63)
                counts = int_list(
                    get_list(entry, "label_counts", where=where), where=f"{where}.label_counts"
                )
                if not isinstance(entry.get("arch_fits"), bool):
                    raise StateFileError(f"{where}.arch_fits", "is not a boolean")
                info = NodeInfo(
                    node_id=get_int(entry, "node", where=where),
                    arch=get_str(entry, "arch", where=where),
                    family=get_str(entry, "family", where=where),
                    size_rank=get_int(entry, "size_rank", where=where, minimum=any_int),
                    arch_fits=bool(entry["arch_fits"]),
                    num_train=get_int(entry, "num_train", where=where),
                    num_test=get_int(entry, "num_test", where=where),
                    partition_id=get_int(entry, "partition_id", where=where, minimum=any_int),
                    label_counts=tuple(counts),
                    profile=dict(get_mapping(entry, "profile", where=where)),
                )
                nodes[info.node_id] = info
            excluded: dict[int, str] = {}
            for node, reason in get_mapping(state, "excluded", default={}).items():
                if not node.isdigit():
                    raise StateFileError(f"excluded.{node}", "is not keyed by a node id")
                excluded[int(node)] = get_str({node: reason}, node, where="excluded")
            rejections = []
            for i, entry in enumerate(get_list(state, "handshake_rejections", default=[])):
                where = f"handshake_rejections[{i}]"
                if not isinstance(entry, Mapping):
                    raise StateFileError(where, f"is {type(entry).__name__}; expected a mapping")
                rejections.append(
                    Rejection(
                        get_int(entry, "node", where=where), get_str(entry, "reason", where=where)
                    )
                )
        except StateFileError as err:
            raise refusal(state, err) from err
        self.completed_round = completed
        self.federation = federation
        self.failed_streak = streak
        self.nodes = nodes
        self.excluded = excluded
        self._handshake_rejections = rejections

    # ------------------------------------------------------------ round loop
    def summary(self) -> None:
        """Log the scheme's configuration."""
        run = self.env.run
        log.info(
            "scheme %s on family %s, %d round(s), round-timeout %gs, aggregator %s, "
            "fraction-train %g, min-replies %d",
            self.name,
            self.env.family,
            run.num_server_rounds,
            run.round_timeout,
            self.aggregator.name,
            run.fraction_train,
            run.min_replies,
        )

    def start(self, grid: Grid, *, num_rounds: int, timeout: float) -> Result:
        """Run the handshake and rounds ``completed_round + 1 .. num_rounds``.

        Parameters
        ----------
        grid : Grid
            Flower's grid.
        num_rounds : int
            The last round to run.
        timeout : float
            Seconds each exchange may take.

        Returns
        -------
        Result
            Flower's result object (per-round train metrics).

        Raises
        ------
        RunStoppedError
            If ``max-failed-rounds`` rounds in a row were skipped, or fewer than
            ``min-nodes`` nodes can take part in the first round.
        """
        run = self.env.run
        self.summary()
        if self.completed_round:
            log.info("resuming federation %s after round %d", self.federation, self.completed_round)
        wait_for_nodes(
            grid,
            min_nodes=run.min_nodes,
            timeout=run.node_wait_timeout,
            retry_timeout=run.superlink_retry_timeout,
        )
        result = Result()
        log.info(TABLE_HEADER)
        first = self.completed_round + 1
        ctx: RoundContext | None = None
        for server_round in range(first, num_rounds + 1):
            ctx = RoundContext(
                server_round=server_round,
                num_rounds=num_rounds,
                rng=np.random.default_rng([run.seed, server_round]),
            )
            record = self._run_round(grid, ctx, timeout, first_of_process=server_round == first)
            result.train_metrics_clientapp[server_round] = MetricRecord(
                {
                    "num-ok": int(record["num_ok"]),
                    "num-rejected": int(record["num_rejected"]),
                    "personal-accuracy": float(record["personal_accuracy_mean"] or 0.0),
                }
            )
        if ctx is not None:
            self.final_metrics = dict(self.end_of_run(ctx))
        return result

    def _run_round(
        self, grid: Grid, ctx: RoundContext, timeout: float, *, first_of_process: bool
    ) -> dict[str, Any]:
        run = self.env.run
        tick = time.monotonic()
        self._refresh_nodes(grid, timeout)
        ctx.phases["handshake"] = time.monotonic() - tick
        skip_reason: str | None = None
        if len(self.assignment) < run.min_nodes:
            if first_of_process:
                reasons = "; ".join(
                    f"node {r.node_id}: {r.reason}" for r in self._handshake_rejections
                )
                raise RunStoppedError(
                    f"only {len(self.assignment)} node(s) can take part but min-nodes="
                    f"{run.min_nodes}; handshake problems: {reasons or 'none'}"
                )
            self._wait_for_eligible(grid, timeout)
            if len(self.assignment) < run.min_nodes:
                skip_reason = (
                    f"only {len(self.assignment)} node(s) can take part after waiting "
                    f"node-wait-timeout={run.node_wait_timeout:g}s, min-nodes={run.min_nodes}"
                )
        ctx.eligible = dict(self.assignment)
        if skip_reason is None:
            tick = time.monotonic()
            selected = self.select_nodes(ctx)
            ctx.assignment = {n: ctx.eligible[n] for n in selected}
            ctx.schemas = {n: self.reply_schema(ctx, n, a) for n, a in ctx.assignment.items()}
            caps = weight_caps(
                {n: self.nodes[n].num_train for n in ctx.assignment if n in self.nodes},
                self.weight_cap,
            )
            ctx.limits = {
                n: ReplyLimits(
                    max_examples=self.nodes[n].num_train * run.local_epochs,
                    max_test_examples=self.nodes[n].num_test,
                    max_weight=caps[n],
                )
                for n in ctx.assignment
                if n in self.nodes
            }
            messages = self._messages(ctx)
            sizes = wire.payload_sizes([m.content for m in messages])
            ctx.bytes_down = {
                int(m.metadata.dst_node_id): size for m, size in zip(messages, sizes, strict=True)
            }
            ctx.phases["build"] = time.monotonic() - tick
            tick = time.monotonic()
            outcome = exchange(
                grid,
                messages,
                timeout=timeout,
                on_reply=lambda reply: self._receive(ctx, reply),
                retry_timeout=run.superlink_retry_timeout,
                bytes_down=ctx.bytes_down,
            )
            ctx.phases["exchange"] = time.monotonic() - tick
            ctx.phases["pull"] = outcome.pull_seconds
            ctx.phases["fold"] = outcome.fold_seconds
            del messages  # their payloads are not needed any longer
            ctx.failures = outcome.missing
            for node, reason in outcome.missing.items():
                log.warning("round %d: node %d failed: %s", ctx.server_round, node, reason)
            if len(ctx.accepted) < run.min_replies:
                skip_reason = (
                    f"{len(ctx.accepted)} accepted repl{'y' if len(ctx.accepted) == 1 else 'ies'}"
                    f" of {len(ctx.assignment)} sent, min-replies={run.min_replies}"
                )
        extra: dict[str, Any] = {}
        if skip_reason is None:
            tick = time.monotonic()
            try:
                extra = self.aggregate(ctx, ctx.accepted)
            except NonFiniteStateError as err:
                skip_reason = f"refusing to ship a non-finite state: {err}"
            except (ValueError, ArithmeticError) as err:
                skip_reason = f"the accepted replies cannot be aggregated: {err}"
            ctx.phases["aggregate"] = time.monotonic() - tick
        if skip_reason is None:
            self.failed_streak = 0
        else:
            self.discard(ctx)
            self.failed_streak += 1
            log.warning(
                "round %d skipped (%d in a row): %s; the global state is unchanged",
                ctx.server_round,
                self.failed_streak,
                skip_reason,
            )
        record = self._round_record(ctx, extra, skip_reason)
        self.rounds.append(record)
        self.completed_round = ctx.server_round
        if self.results is not None:
            self.results.append_round(record)
            every = run.checkpoint_every
            if every > 0 and (ctx.server_round % every == 0 or ctx.server_round == ctx.num_rounds):
                self.results.write_checkpoint(self.state_dict())
        log.info(format_round_row(record, ctx.num_rounds))
        if self.failed_streak >= run.max_failed_rounds:
            raise RunStoppedError(
                f"{self.failed_streak} rounds in a row were skipped (max-failed-rounds="
                f"{run.max_failed_rounds}); the last: {skip_reason}. Check the nodes' logs "
                "and the 'failed'/'rejected' entries in metrics.jsonl"
            )
        return record

    def _messages(self, ctx: RoundContext) -> list[Message]:
        ttl = max(self.env.run.round_timeout * 2.0, 60.0)
        return [
            Message(
                content=self.node_content(ctx, node_id, arch),
                dst_node_id=node_id,
                message_type="train",
                ttl=ttl,
            )
            for node_id, arch in sorted(ctx.assignment.items())
        ]

    def _receive(self, ctx: RoundContext, reply: Message) -> None:
        """Validate one pulled reply and fold it (or record why it was rejected)."""
        checked = validate_reply(
            reply,
            expected_nodes=ctx.assignment,
            schemas=ctx.schemas,
            bytes_down=ctx.bytes_down,
            limits=ctx.limits,
        )
        if not isinstance(checked, Rejection):
            try:
                checked = self.fold(ctx, checked)
            except (ValueError, ArithmeticError) as err:
                checked = Rejection(checked.node_id, f"cannot be aggregated: {err}")
        if isinstance(checked, Rejection):
            log.warning(
                "round %d: rejected reply from node %d: %s",
                ctx.server_round,
                checked.node_id,
                checked.reason,
            )
            ctx.rejected.append(checked)
        else:
            ctx.accepted.append(checked)

    def _wait_for_eligible(self, grid: Grid, timeout: float) -> None:
        run = self.env.run
        deadline = time.monotonic() + run.node_wait_timeout
        log.warning(
            "only %d node(s) can take part, min-nodes=%d; waiting up to %gs for more",
            len(self.assignment),
            run.min_nodes,
            run.node_wait_timeout,
        )
        while len(self.assignment) < run.min_nodes and time.monotonic() < deadline:
            time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))
            self._refresh_nodes(grid, timeout)

    def _refresh_nodes(self, grid: Grid, timeout: float) -> None:
        """Handshake with nodes not seen yet; leave out nodes that disconnected."""
        retry = self.env.run.superlink_retry_timeout
        connected = connected_nodes(grid, retry_timeout=retry)
        new = sorted(connected - set(self.nodes) - set(self.excluded))
        if new:
            content = RecordDict(
                {
                    wire.CONFIG: ConfigRecord(
                        {
                            "server-round": 0,
                            # an in-process stand-in (tessera.local_grid) says so
                            "simulation": is_simulation(grid)
                            or getattr(grid, "simulation", False) is True,
                            FEDERATION: self.federation,
                        }
                    )
                }
            )
            msgs = [
                Message(
                    content=content,
                    dst_node_id=n,
                    message_type=wire.HANDSHAKE,
                    ttl=max(timeout, 60.0),
                )
                for n in new
            ]
            outcome = exchange(grid, msgs, timeout=timeout, retry_timeout=retry)
            for node, reason in outcome.missing.items():
                log.warning("handshake: node %d failed: %s", node, reason)
                self._handshake_rejections.append(Rejection(node, reason))
            known = self.known_archs()
            for reply in outcome.replies:
                info = parse_handshake(reply, known, num_classes=self.env.num_classes)
                if not isinstance(info, Rejection):
                    refusal = self.refuse_node(info)
                    info = info if refusal is None else Rejection(info.node_id, refusal)
                if isinstance(info, Rejection):
                    log.warning("handshake: node %d rejected: %s", info.node_id, info.reason)
                    self._handshake_rejections.append(info)
                    continue
                log.info(
                    "node %d (partition %d): profile '%s', %g cores, %.0f MiB, %s -> %s%s",
                    info.node_id,
                    info.partition_id,
                    info.profile.get("name"),
                    float(info.profile.get("cpu-cores", 0)),
                    float(info.profile.get("memory-bytes", 0)) / 2**20,
                    info.profile.get("accelerator"),
                    info.arch,
                    "" if info.arch_fits else " (nothing fits: smallest)",
                )
                self.nodes[info.node_id] = info
        for gone in set(self.nodes) - connected:
            if gone in self.assignment:
                log.warning("node %d disconnected; it is left out until it returns", gone)
        present = {n: i for n, i in self.nodes.items() if n in connected}
        assignment = self.assign_architectures(present)
        self.assignment = {n: a for n, a in assignment.items() if a is not None}
        for n, a in assignment.items():
            if a is None and n not in self.excluded:
                self.excluded[n] = "cannot train the shared architecture"
                log.warning(
                    "node %d is left out: its device cannot train the shared architecture", n
                )
        if new and self.results is not None:
            self.results.write_config(self.config_document())

    def config_document(self) -> dict[str, Any]:
        """Return the content of ``config.json``."""
        return {
            "run_config": self.env.run.to_dict(),
            "scheme": self.name,
            "scheme_options": self.describe(),
            "federation": self.federation,
            "aggregator": self.aggregator.name,
            "family": self.env.family,
            "num_classes": self.env.num_classes,
            "input_shape": list(self.env.input_shape),
            "global_test_size": len(self.env.global_test),
            "server_pool_size": len(self.env.server_pool),
            "nodes": [info.to_dict() for _, info in sorted(self.nodes.items())],
            "assignment": {str(n): a for n, a in sorted(self.assignment.items())},
            "excluded": {str(n): r for n, r in sorted(self.excluded.items())},
            "handshake_rejections": [
                {"node": r.node_id, "reason": r.reason} for r in self._handshake_rejections
            ],
            "attack": self._attack_document(),
        }

    def attack_plan(self) -> dict[int, str]:
        """Hostile partitions and their attacks as the run config draws them (simulation).

        Empty without run-config ``attack``; nodes made hostile by their node-config
        alone are not known to the server.
        """
        if not self.env.run.attack or not self.nodes:
            return {}
        count = max([len(self.nodes)] + [i.partition_id + 1 for i in self.nodes.values()])
        return attack_assignment(self.env.run, count)

    def _attack_document(self) -> dict[str, Any] | None:
        run = self.env.run
        if not run.attack:
            return None
        return {
            "attacks": list(run.attack),
            "fraction": run.attack_fraction,
            "partitions": {str(p): a for p, a in sorted(self.attack_plan().items())},
            "lambda": run.attack_lambda,
            "scale": run.attack_scale,
            "noise": run.attack_noise,
        }

    # ------------------------------------------------------------ evaluation
    def flipped_test_set(self) -> ArrayDataset:
        """Return the server test samples the label-flip attack relabels, relabelled.

        A model's accuracy on it is the attack's success: the share predicted as
        ``C - 1 - y``.
        """
        test = self.env.global_test
        target = self.env.num_classes - 1 - test.y
        changed = target != test.y
        return ArrayDataset(test.x[changed], target[changed].astype(np.int64))

    def evaluate_global(self, *, flipped: bool = False) -> dict[str, float]:
        """Accuracy of every global model on the server's test set.

        With ``flipped``: the label-flip attack's success instead, the share of test
        samples (those whose label the flip changes) predicted as ``C - 1 - y``.
        """
        from tessera.training import evaluate_model

        test = self.flipped_test_set() if flipped else self.env.global_test
        out: dict[str, float] = {}
        for arch, arrays in self.global_models().items():
            model = self.build_model(arch)
            model.load_state_dict(
                {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, strict=False
            )
            _, acc = evaluate_model(model, test, batch_size=256, device=torch.device("cpu"))
            out[arch] = acc
        return out

    def _round_record(
        self, ctx: RoundContext, extra: Mapping[str, Any], skip_reason: str | None
    ) -> dict[str, Any]:
        clients: list[dict[str, Any]] = []
        for rep in sorted(ctx.accepted, key=lambda r: r.node_id):
            info = self.nodes.get(rep.node_id)
            clients.append(
                {
                    "node": rep.node_id,
                    "partition_id": info.partition_id if info else None,
                    "profile": info.profile.get("name") if info else None,
                    "arch": rep.arch,
                    "num_examples": rep.num_examples,
                    "train_loss": rep.metrics[wire.TRAIN_LOSS],
                    "test_accuracy": rep.metrics[wire.TEST_ACCURACY],
                    "test_loss": rep.metrics[wire.TEST_LOSS],
                    "num_test_examples": int(rep.metrics[wire.NUM_TEST_EXAMPLES]),
                    "bytes_up": rep.bytes_up,
                    "bytes_down": ctx.bytes_down.get(rep.node_id, 0),
                    "train_seconds": rep.metrics[wire.TRAIN_SECONDS],
                    **(
                        {"model_rounds": int(rep.metrics["model-rounds"])}
                        if "model-rounds" in rep.metrics
                        else {}
                    ),
                }
            )
        accs = [c["test_accuracy"] for c in clients if c["num_test_examples"] > 0]
        mean, std = mean_std(accs)
        by_arch: dict[str, list[float]] = defaultdict(list)
        for c in clients:
            if c["num_test_examples"] > 0:
                by_arch[c["arch"]].append(c["test_accuracy"])
        tick = time.monotonic()
        evaluation = self.evaluate(ctx)
        ctx.phases["evaluate"] = time.monotonic() - tick
        seconds = time.monotonic() - ctx.started
        slowest = max((c["train_seconds"] for c in clients), default=0.0)
        partitions = {n: self.nodes[n].partition_id for n in ctx.assignment if n in self.nodes}
        plan = self.attack_plan()
        return {
            "round": ctx.server_round,
            "strategy": self.name,
            "skipped": skip_reason is not None,
            "skip_reason": skip_reason,
            "clients": clients,
            "num_eligible": len(ctx.eligible),
            "num_sent": len(ctx.assignment),
            "num_ok": len(ctx.accepted),
            "num_rejected": len(ctx.rejected),
            "num_failed": len(ctx.failures),
            "selected": sorted(ctx.assignment),
            "selected_partitions": sorted(partitions.values()),
            "attackers": [
                {"node": n, "partition_id": p, "attack": plan[p]}
                for n, p in sorted(partitions.items())
                if p in plan
            ],
            "rejected": [{"node": r.node_id, "reason": r.reason} for r in ctx.rejected],
            "failed": [{"node": n, "reason": r} for n, r in sorted(ctx.failures.items())],
            "personal_accuracy_mean": mean,
            "personal_accuracy_std": std,
            "personal_accuracy_by_arch": {a: float(np.mean(v)) for a, v in sorted(by_arch.items())},
            **evaluation,
            "bytes_up_total": sum(c["bytes_up"] for c in clients),
            "bytes_down_total": sum(ctx.bytes_down.values()),
            "round_seconds": seconds,
            "slowest_train_seconds": slowest,
            "overhead_seconds": seconds - slowest,
            "phase_seconds": {k: round(v, 4) for k, v in ctx.phases.items()},
            "server_memory_mb": server_memory_mb(),
            **dict(extra),
        }
