"""The hooks a scheme overrides, with their defaults: models, nodes, messages, fold, evaluation.

:class:`SchemeHooks` is the part of :class:`~strategies.core.strategy.HeteroStrategy`
a scheme writes: what it builds, whom it admits and selects, what it sends, what
it demands back, how it folds and aggregates, how it is evaluated. The round loop
(:mod:`strategies.core.strategy`) calls them in its phases; nothing here runs a
round.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict

from models.spec import SLICE_SEPARATOR, ModelRef
from strategies.core.aggregators import Aggregator
from strategies.core.context import FEDERATION, RoundContext, ServerEnv
from strategies.core.direction import PoolMix, reference_mix
from strategies.core.nodes import NodeInfo, NodeTable
from strategies.core.validation import ArraySpec, ClientReply, ReplySchema
from tessera import wire
from tessera.data import ArrayDataset

log = logging.getLogger("flwr.tessera")

__all__ = ["SchemeHooks"]


OptionsT = TypeVar("OptionsT")
"""A scheme's options type (what its ``parse_options`` returns)."""


class SchemeHooks(Generic[OptionsT]):
    """Default hooks of a scheme (see the module docstring).

    Generic over the scheme's options type, so a scheme reads its options typed. The
    attributes are set by :class:`~strategies.core.strategy.HeteroStrategy`.
    """

    name: ClassVar[str] = "hetero"
    """The scheme's name: :func:`~strategies.core.registry.register_scheme` sets it from
    the one place it is written, the scheme's registration."""
    env: ServerEnv
    options: OptionsT
    aggregator: Aggregator
    server_trust: bool
    federation: str
    table: NodeTable
    completed_round: int
    _templates: dict[str, dict[str, np.ndarray]]
    _pool_counts: tuple[int, ...] | None = None
    pool_train_cpu: float = 0.0
    """CPU seconds (the calling thread's) this strategy has spent in :meth:`pool_direction`.

    The server's own training on its pool: at most one whole-pool update per model and
    :data:`~strategies.core.direction.MAX_CLASS_DIRECTIONS` mix updates a round, so a
    cost per round, not per reply. A round records the part it spent while folding
    (``phase_seconds['pool_train_cpu']``, inside ``fold_cpu``)."""

    @property
    def nodes(self) -> dict[int, NodeInfo]:
        """Every node that passed the handshake (:attr:`NodeTable.nodes`)."""
        return self.table.nodes

    def declared_labels(self, node_id: int) -> tuple[int, ...] | None:
        """Return the label counts ``node_id`` declared at its handshake (``None``: none)."""
        info = self.nodes.get(node_id)
        return None if info is None else info.label_counts

    @property
    def assignment(self) -> dict[int, str]:
        """Nodes that can take part and their architectures (:attr:`NodeTable.assignment`)."""
        return self.table.assignment

    @property
    def excluded(self) -> dict[int, str]:
        """Nodes left out of the federation and why (:attr:`NodeTable.excluded`)."""
        return self.table.excluded

    # ------------------------------------------------------------------ models
    def build_model(self, arch: str) -> torch.nn.Module:
        """Build a fresh model of ``arch`` for this task (seeded by run-config seed)."""
        from models import get_model

        torch.manual_seed(self.env.run.seed)
        return get_model(
            arch,
            input_shape=self.env.input_shape,
            num_classes=self.env.num_classes,
            norm=self.env.run.scheme.norm,
            flat_input=self.env.run.scheme.flat_input,
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
        self,
        arch: str,
        weights: Mapping[str, np.ndarray],
        mix: PoolMix | None = None,
    ) -> dict[str, np.ndarray] | None:
        """Return the server's own update of ``arch``'s ``weights`` on its pool, or ``None``.

        The server trains a copy of the global model on its server pool (data no
        client holds) with the clients' schedule (``local-epochs``, ``batch-size``,
        the SGD settings), seeded by the run and the round, and returns trained
        minus ``weights`` per floating entry: the direction the bounded ``mean``
        compares each update with (FLTrust's trusted root update, Cao et al. NDSS
        2021; run-config ``trust-threshold``). With ``mix``, on that mix of the pool
        (a label-skewed node's, :meth:`reference_mix`), drawn with the run's seed and
        the round.
        ``None`` when run-config ``server-trust`` is off, the pool (or its part) is
        empty, or the update is not finite.
        """
        cpu = time.thread_time()
        try:
            return self._pool_direction(arch, weights, mix)
        finally:
            self.pool_train_cpu += time.thread_time() - cpu

    def _pool_direction(
        self, arch: str, weights: Mapping[str, np.ndarray], mix: PoolMix | None
    ) -> dict[str, np.ndarray] | None:
        from tessera.training import OptimConfig, cross_entropy_loss, torch_threads, train_model

        run = self.env.run
        pool = self.env.server_pool
        if mix is not None and len(pool) > 0:
            pool = mix.select(pool, seed=(run.seed, self.completed_round))
        if (
            not self.server_trust
            or len(pool) == 0
            or self.aggregator.name != "mean"
            or run.aggregation.clip_factor <= 0
        ):
            return None  # only the bounded mean checks directions
        model = self.build_model(arch)
        model.load_state_dict(
            {k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False
        )
        optim = OptimConfig(
            run.training.local_epochs,
            run.training.batch_size,
            run.training.learning_rate,
            run.training.momentum,
            run.training.weight_decay,
        )
        round_seed = run.seed * 7919 + self.completed_round + 1
        with torch_threads(1):  # small batches; a second thread only fights the clients
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

    def reference_mix(self, node_id: int | None) -> PoolMix | None:
        """Return the pool mix ``node_id``'s update is compared on (``None``: the whole pool).

        From the label counts the node claims in its handshake
        (:func:`~strategies.core.direction.reference_mix`): under label skew an honest
        update points away from training on every class in the pool's proportions. A
        node that lies about its labels is compared with honest training on the mix it
        names (the handshake's counts are checked against ``num-train``).
        """
        info = None if node_id is None else self.nodes.get(node_id)
        if info is None or not self.server_trust:
            return None
        if self._pool_counts is None:
            labels = np.asarray(self.env.server_pool.y, dtype=np.int64)
            counts = np.bincount(labels[labels >= 0]) if len(labels) else np.zeros(0)
            self._pool_counts = tuple(int(n) for n in counts)
        return reference_mix(info.label_counts, self._pool_counts)

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
        round's generator from the eligible nodes ordered by partition, then data key
        (a digest of a node's own data file), then node id: the first two are stable
        across restarts, node ids are not.
        """
        order = sorted(ctx.eligible, key=self._stable_order)
        run = self.env.run
        want = max(
            run.deployment.min_train_nodes, math.ceil(run.deployment.fraction_train * len(order))
        )
        if want >= len(order):
            return order
        picked = ctx.rng.choice(len(order), size=want, replace=False)
        return [order[i] for i in sorted(int(i) for i in picked)]

    def _stable_order(self, node_id: int) -> tuple[int, int, int]:
        info = self.nodes.get(node_id)
        return (-1, -1, node_id) if info is None else (info.partition_id, info.data_key, node_id)

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Build the records sent to one node this round (the base: only the config)."""
        return RecordDict({wire.CONFIG: self.train_config(ctx, node_id, arch)})

    def model_ref(self, arch: str) -> ModelRef:
        """Return the structured reference behind architecture name ``arch``.

        Default: the registered model ``arch`` (constant time: it is called for every
        message); a slice's name, which no registered model has, is looked up among
        the references the nodes reported in their handshakes. A scheme that makes
        its own slices (the sub-model schemes) returns those.

        Raises
        ------
        ValueError
            If ``arch`` is neither a registered model's name nor a node's model.
        """
        if SLICE_SEPARATOR not in arch:
            return ModelRef(arch)
        for info in self.nodes.values():
            if info.arch == arch:
                return info.ref
        raise ValueError(f"no node reported the slice '{arch}' and this scheme makes none")

    def train_config(self, ctx: RoundContext, node_id: int, arch: str) -> ConfigRecord:
        """Build the ``config`` record: round, model (structure and name), task shape."""
        return ConfigRecord(
            {
                "server-round": ctx.server_round,
                **self.model_ref(arch).to_config(),
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
        (``global_accuracy`` is their mean, ``None`` when the scheme has none). The
        attack's success is measured outside the scheme
        (:class:`~strategies.core.observers.AttackObserver`).
        """
        by_arch = self.evaluate_global()
        return {
            "global_accuracy": float(np.mean(list(by_arch.values()))) if by_arch else None,
            "global_accuracy_by_arch": by_arch,
        }

    def end_of_run(self, ctx: RoundContext) -> dict[str, Any]:
        """Finish the run after its last round; the result goes to ``summary.json``."""
        return {}

    def global_models(self) -> Mapping[str, dict[str, np.ndarray]]:
        """Global model(s) to evaluate on the server test set, by architecture."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Scheme-specific settings for ``config.json``."""
        return {}

    # ------------------------------------------------------------ evaluation
    def accuracy_of(self, arch: str, arrays: Mapping[str, np.ndarray], data: ArrayDataset) -> float:
        """Accuracy of ``arch`` with ``arrays`` on ``data`` (the evaluation hook's scorer)."""
        from tessera.training import evaluate_model

        model = self.build_model(arch)
        model.load_state_dict(
            {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, strict=False
        )
        _, acc = evaluate_model(model, data, batch_size=256, device=torch.device("cpu"))
        return acc

    def evaluate_global(self, data: ArrayDataset | None = None) -> dict[str, float]:
        """Accuracy of every global model (:meth:`global_models`) on ``data``.

        ``data`` defaults to the server's test set.
        """
        test = self.env.global_test if data is None else data
        return {
            arch: self.accuracy_of(arch, arrays, test)
            for arch, arrays in self.global_models().items()
        }
