"""The base of every heterogeneous scheme: one message per node, replies by architecture.

:class:`HeteroStrategy` subclasses Flower's message-API
:class:`flwr.serverapp.strategy.Strategy`. It owns the round loop, because the loop
it needs differs from Flower's in what it does, not only in side effects:

- a ``query.handshake`` before round 1 (and for nodes that join later) through which
  each node reports its device profile, its data and the architecture it chose;
- one training exchange per round (clients evaluate their personalised model on their
  own test split inside the same exchange, so there is no second round trip);
- every exchange bounded by ``round-timeout``, polling every 0.2 s; a node that fails,
  errs or times out is counted and the round goes on with the rest;
- every reply validated before any arithmetic (:mod:`strategies.validation`);
- results written to disk at the end of every round (:mod:`tessera.results`).

Subclasses override hooks only: :meth:`assign_architectures`, :meth:`node_content`,
:meth:`reply_schema`, :meth:`aggregate` and :meth:`global_models`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from strategies.aggregation import mean_std
from strategies.validation import (
    ArraySpec,
    ClientReply,
    Rejection,
    ReplySchema,
    short_reason,
    validate_reply,
)
from tessera import wire
from tessera.config import RunConfig
from tessera.data import ArrayDataset
from tessera.results import TABLE_HEADER, ResultsWriter, format_round_row

log = logging.getLogger("flwr.tessera")

POLL_INTERVAL = 0.2
"""Seconds between two pulls of replies (Flower's gRPC grid sleeps 3 s)."""


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
        """JSON-safe description for ``config.json``."""
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


@dataclass
class ExchangeResult:
    """Replies with content, and the nodes that failed (error reply or no reply)."""

    replies: list[Message]
    missing: dict[int, str]
    bytes_down: dict[int, int] = field(default_factory=dict)


def exchange(
    grid: Grid, messages: Sequence[Message], *, timeout: float, poll: float = POLL_INTERVAL
) -> ExchangeResult:
    """Push messages and pull their replies until all arrived or ``timeout`` passed.

    Parameters
    ----------
    grid : Grid
        Flower's grid.
    messages : Sequence[Message]
        One message per destination node.
    timeout : float
        Seconds to wait for replies; nodes without a reply are reported missing.
    poll : float
        Seconds between pulls.

    Returns
    -------
    ExchangeResult
        The replies and the missing nodes with a reason.
    """
    bytes_down = {int(m.metadata.dst_node_id): wire.payload_bytes(m.content) for m in messages}
    if not messages:
        return ExchangeResult([], {}, bytes_down)
    accepted = {mid for mid in grid.push_messages(messages) if mid}
    pending: dict[str, int] = {}
    missing: dict[int, str] = {}
    for msg in messages:
        node = int(msg.metadata.dst_node_id)
        mid = msg.metadata.message_id
        if mid in accepted:
            pending[mid] = node
        else:
            missing[node] = "the SuperLink did not accept the message"
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    while pending:
        for reply in grid.pull_messages(list(pending)):
            mid = reply.metadata.reply_to_message_id
            if mid not in pending:
                continue
            node = pending.pop(mid)
            if reply.has_error():
                # Error replies come from the SuperLink on the node's behalf (node
                # unavailable, ClientApp crashed or raised): the node failed.
                err = reply.error
                missing[node] = f"error {err.code}: {short_reason(err.reason or '')}"
            else:
                replies.append(reply)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    for node in pending.values():
        missing[node] = f"no reply within round-timeout={timeout:g}s"
    return ExchangeResult(replies, missing, bytes_down)


def is_simulation(grid: Grid) -> bool:
    """Whether the grid is Flower's in-memory simulation grid.

    Only then do clients emulate the fleet of run-config ``sim-device-profiles``; a
    deployed node always probes its device (or takes node-config ``device-profile``).
    """
    from flwr.server.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


def wait_for_nodes(grid: Grid, *, min_nodes: int, timeout: float) -> list[int]:
    """Wait until at least ``min_nodes`` nodes are connected.

    Raises
    ------
    TimeoutError
        If fewer nodes connected within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) >= min_nodes:
            return nodes
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"only {len(nodes)} node(s) connected within node-wait-timeout="
                f"{timeout:g}s but min-nodes={min_nodes}; start more SuperNodes or "
                "lower run-config 'min-nodes'"
            )
        time.sleep(0.5)


def parse_handshake(reply: Message, known_archs: Iterable[str]) -> NodeInfo | Rejection:
    """Validate a handshake reply into a :class:`NodeInfo`."""
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
    if info.num_train <= 0:
        return Rejection(node_id, f"handshake reports num-train={info.num_train}")
    return info


class HeteroStrategy(Strategy):
    """Base class of Tessera's schemes (see the module docstring).

    Parameters
    ----------
    env : ServerEnv
        Task description and server-side data.
    options : Any
        The scheme's own typed options (its ``Options.parse`` result).
    results : ResultsWriter | None
        Where round records go; ``None`` keeps them in memory only.
    """

    name: ClassVar[str] = "hetero"
    sends_weights: ClassVar[bool] = True
    """Whether clients return their weights in the ``arrays`` record."""

    def __init__(self, *, env: ServerEnv, options: Any, results: ResultsWriter | None) -> None:
        self.env = env
        self.options = options
        self.results = results
        self.nodes: dict[int, NodeInfo] = {}
        self.assignment: dict[int, str] = {}
        self.excluded: dict[int, str] = {}
        self.rounds: list[dict[str, Any]] = []
        self._templates: dict[str, dict[str, np.ndarray]] = {}
        self._round_missing: dict[int, str] = {}
        self._round_bytes_down: dict[int, int] = {}
        self._round_started = 0.0
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
        )

    def initial_arrays(self, arch: str) -> dict[str, np.ndarray]:
        """Seeded initial weights of ``arch`` (the same in every process)."""
        if arch not in self._templates:
            model = self.build_model(arch)
            self._templates[arch] = {
                k: v.numpy().copy() for k, v in wire.exchanged_state(model.state_dict()).items()
            }
        return {k: v.copy() for k, v in self._templates[arch].items()}

    def array_spec(self, arch: str) -> ArraySpec:
        """Return the expected names, shapes and dtypes of ``arch``'s arrays."""
        return {k: (tuple(v.shape), str(v.dtype)) for k, v in self.initial_arrays(arch).items()}

    # ------------------------------------------------------------------- hooks
    def assign_architectures(self, nodes: Mapping[int, NodeInfo]) -> dict[int, str | None]:
        """Map each node to the architecture it trains (``None`` leaves it out).

        Default: the architecture each device chose for itself.
        """
        return {node_id: info.arch for node_id, info in nodes.items()}

    def node_content(self, server_round: int, node_id: int, arch: str) -> RecordDict:
        """Build the records sent to one node this round (the base: only the config)."""
        return RecordDict({wire.CONFIG: self.train_config(server_round, node_id, arch)})

    def train_config(self, server_round: int, node_id: int, arch: str) -> ConfigRecord:
        """Build the ``config`` record: round, scheme, architecture and task shape."""
        return ConfigRecord(
            {
                "server-round": server_round,
                "scheme": self.name,
                "arch": arch,
                "num-classes": self.env.num_classes,
                "input-shape": list(self.env.input_shape),
            }
        )

    def reply_schema(self, node_id: int, arch: str) -> ReplySchema:
        """Return what this node's reply must contain."""
        return ReplySchema(arrays=self.array_spec(arch) if self.sends_weights else None)

    def aggregate(self, server_round: int, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Combine this round's valid replies; return extra round-level metrics."""
        return {}

    def global_models(self) -> Mapping[str, dict[str, np.ndarray]]:
        """Global model(s) to evaluate on the server test set, by architecture."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Scheme-specific settings for ``config.json``."""
        return {}

    # -------------------------------------------- Flower Strategy interface
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per participating node, built by :meth:`node_content`."""
        messages = []
        ttl = max(self.env.run.round_timeout * 2.0, 60.0)
        for node_id, arch in sorted(self.assignment.items()):
            content = self.node_content(server_round, node_id, arch)
            messages.append(
                Message(content=content, dst_node_id=node_id, message_type="train", ttl=ttl)
            )
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, aggregate the valid ones, record the round."""
        schemas = {n: self.reply_schema(n, a) for n, a in self.assignment.items()}
        accepted: list[ClientReply] = []
        rejected: list[Rejection] = []
        for reply in replies:
            checked = validate_reply(
                reply,
                expected_nodes=self.assignment,
                schemas=schemas,
                bytes_down=self._round_bytes_down,
            )
            if isinstance(checked, Rejection):
                log.warning(
                    "round %d: rejected reply from node %d: %s",
                    server_round,
                    checked.node_id,
                    checked.reason,
                )
                rejected.append(checked)
            else:
                accepted.append(checked)
        extra = self.aggregate(server_round, accepted) if accepted else {}
        record = self._round_record(server_round, accepted, rejected, extra)
        self.rounds.append(record)
        if self.results is not None:
            self.results.append_round(record)
        metrics = MetricRecord(
            {
                "num-ok": len(accepted),
                "num-rejected": len(rejected),
                "personal-accuracy": float(record["personal_accuracy_mean"] or 0.0),
            }
        )
        return None, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No separate evaluation exchange: clients evaluate inside the train reply."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None

    def summary(self) -> None:
        """Log the scheme's configuration."""
        log.info(
            "scheme %s on family %s, %d round(s), round-timeout %gs",
            self.name,
            self.env.family,
            self.env.run.num_server_rounds,
            self.env.run.round_timeout,
        )

    # ------------------------------------------------------------ round loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Any = None,
    ) -> Result:
        """Run the handshake and ``num_rounds`` rounds; see the module docstring.

        Parameters
        ----------
        grid : Grid
            Flower's grid.
        num_rounds : int
            Number of rounds.
        timeout : float
            Seconds each exchange may take.

        Returns
        -------
        Result
            Flower's result object (per-round train metrics).
        """
        self.summary()
        wait_for_nodes(
            grid, min_nodes=self.env.run.min_nodes, timeout=self.env.run.node_wait_timeout
        )
        result = Result()
        log.info(TABLE_HEADER)
        for server_round in range(1, num_rounds + 1):
            self._round_started = time.monotonic()
            self._refresh_nodes(grid, timeout)
            if server_round == 1 and len(self.assignment) < self.env.run.min_nodes:
                reasons = "; ".join(
                    f"node {r.node_id}: {r.reason}" for r in self._handshake_rejections
                )
                raise RuntimeError(
                    f"only {len(self.assignment)} node(s) can take part but min-nodes="
                    f"{self.env.run.min_nodes}; handshake problems: {reasons or 'none'}"
                )
            messages = list(self.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
            outcome = exchange(grid, messages, timeout=timeout)
            self._round_missing = outcome.missing
            self._round_bytes_down = outcome.bytes_down
            for node, reason in outcome.missing.items():
                log.warning("round %d: node %d failed: %s", server_round, node, reason)
            _, metrics = self.aggregate_train(server_round, outcome.replies)
            if metrics is not None:
                result.train_metrics_clientapp[server_round] = metrics
            log.info(format_round_row(self.rounds[-1], num_rounds))
        return result

    def _refresh_nodes(self, grid: Grid, timeout: float) -> None:
        """Handshake with nodes not seen yet; forget nodes that disconnected."""
        from models import list_models

        connected = {int(n) for n in grid.get_node_ids()}
        new = sorted(connected - set(self.nodes) - set(self.excluded))
        if new:
            content = RecordDict(
                {wire.CONFIG: ConfigRecord({"server-round": 0, "simulation": is_simulation(grid)})}
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
            outcome = exchange(grid, msgs, timeout=timeout)
            for node, reason in outcome.missing.items():
                log.warning("handshake: node %d failed: %s", node, reason)
                self._handshake_rejections.append(Rejection(node, reason))
            known = list_models()
            for reply in outcome.replies:
                info = parse_handshake(reply, known)
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
        }

    # ------------------------------------------------------------ evaluation
    def evaluate_global(self) -> dict[str, float]:
        """Accuracy of every global model on the server's test set."""
        from client_app.training import evaluate_model

        out: dict[str, float] = {}
        for arch, arrays in self.global_models().items():
            model = self.build_model(arch)
            model.load_state_dict(
                {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, strict=False
            )
            _, acc = evaluate_model(
                model, self.env.global_test, batch_size=256, device=torch.device("cpu")
            )
            out[arch] = acc
        return out

    def _round_record(
        self,
        server_round: int,
        accepted: Sequence[ClientReply],
        rejected: Sequence[Rejection],
        extra: Mapping[str, Any],
    ) -> dict[str, Any]:
        clients: list[dict[str, Any]] = []
        for rep in sorted(accepted, key=lambda r: r.node_id):
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
                    "bytes_down": rep.bytes_down,
                    "train_seconds": rep.metrics[wire.TRAIN_SECONDS],
                }
            )
        accs = [c["test_accuracy"] for c in clients if c["num_test_examples"] > 0]
        mean, std = mean_std(accs)
        by_arch: dict[str, list[float]] = defaultdict(list)
        for c in clients:
            if c["num_test_examples"] > 0:
                by_arch[c["arch"]].append(c["test_accuracy"])
        global_by_arch = self.evaluate_global()
        global_acc = float(np.mean(list(global_by_arch.values()))) if global_by_arch else None
        seconds = time.monotonic() - self._round_started
        slowest = max((c["train_seconds"] for c in clients), default=0.0)
        return {
            "round": server_round,
            "strategy": self.name,
            "clients": clients,
            "num_sent": len(self.assignment),
            "num_ok": len(accepted),
            "num_rejected": len(rejected),
            "num_failed": len(self._round_missing),
            "rejected": [{"node": r.node_id, "reason": r.reason} for r in rejected],
            "failed": [{"node": n, "reason": r} for n, r in sorted(self._round_missing.items())],
            "personal_accuracy_mean": mean,
            "personal_accuracy_std": std,
            "personal_accuracy_by_arch": {a: float(np.mean(v)) for a, v in sorted(by_arch.items())},
            "global_accuracy": global_acc,
            "global_accuracy_by_arch": global_by_arch,
            "bytes_up_total": sum(c["bytes_up"] for c in clients),
            "bytes_down_total": sum(self._round_bytes_down.values()),
            "round_seconds": seconds,
            "slowest_train_seconds": slowest,
            "overhead_seconds": seconds - slowest,
            **dict(extra),
        }
