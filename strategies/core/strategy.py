"""The base of every heterogeneous scheme: the round loop and the hooks schemes override.

:class:`HeteroStrategy` owns the round loop (template method); it does not reuse
Flower's ``Strategy.start`` because what it does differs, not only its side
effects. Each round runs these phases, each a method of its own:

1. **refresh** (:meth:`~HeteroStrategy.refresh`): a ``query.handshake`` with nodes
   not seen yet, through which each node reports its device profile, its data and
   the architecture it chose (the :class:`~strategies.core.nodes.NodeTable`);
   ``min-nodes`` is checked every round;
2. **select** (:meth:`~HeteroStrategy.select`): client sampling (run-config
   ``fraction-train``, ``min-train-nodes``, seeded), each trainer's reply schema and
   the limits on what it may claim;
3. **send** (:meth:`~HeteroStrategy.build_messages`): one training message per
   trainer (clients evaluate their personalised model on their own test split inside
   the same exchange, so there is no second round trip);
4. **fold** (:meth:`~HeteroStrategy.receive`): every reply validated before any
   arithmetic (:mod:`strategies.core.validation`) and folded into the scheme's state
   *as it is pulled* (weights through the injected
   :class:`~strategies.core.aggregators.Aggregator`), so server memory does not grow
   with the number of clients; the exchange is bounded by ``round-timeout`` and
   transient SuperLink errors are retried;
5. **aggregate** (:meth:`~HeteroStrategy.conclude`): a round with fewer than
   ``min-replies`` accepted replies keeps the previous global state and is recorded
   as skipped; ``max-failed-rounds`` skipped rounds in a row stop the run with an
   error naming the cause;
6. **evaluate**: the scheme's :meth:`~HeteroStrategy.evaluate` hook, then the
   attack harness's :class:`~strategies.core.observers.AttackObserver`;
7. **record**: the round record (:func:`strategies.core.record.round_record`) written
   at the end of every round (:mod:`tessera.results`) and the server's state
   checkpointed (``checkpoint-every``), so that run-config ``resume=<results dir>``
   continues a run with no round lost or counted twice.

Per-round state travels in a :class:`~strategies.core.context.RoundContext` handed
to every hook. Subclasses override hooks only (their defaults are in
:class:`~strategies.core.hooks.SchemeHooks`): :meth:`~HeteroStrategy.assign_architectures`,
:meth:`~HeteroStrategy.select_nodes`, :meth:`~HeteroStrategy.node_content`,
:meth:`~HeteroStrategy.train_config`, :meth:`~HeteroStrategy.reply_schema`,
:meth:`~HeteroStrategy.fold`, :meth:`~HeteroStrategy.aggregate`,
:meth:`~HeteroStrategy.discard`, :meth:`~HeteroStrategy.evaluate` (and
:meth:`~HeteroStrategy.accuracy_of`), :meth:`~HeteroStrategy.end_of_run`,
:meth:`~HeteroStrategy.global_models`, :meth:`~HeteroStrategy.describe`, and
:meth:`~HeteroStrategy.state_dict` / :meth:`~HeteroStrategy.load_state_dict` for
what their server keeps.

Randomness: the generator of round ``t`` is ``numpy.random.default_rng([seed, t])``,
so a resumed run draws exactly what an uninterrupted one would; there is no hidden
RNG state to checkpoint.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from strategies.core.aggregators import Aggregator, AggregatorSettings, get_aggregator
from strategies.core.context import RoundContext, ServerEnv
from strategies.core.exchange import exchange, wait_for_nodes
from strategies.core.groups import NonFiniteStateError
from strategies.core.hooks import OptionsT, SchemeHooks
from strategies.core.nodes import NodeTable
from strategies.core.observers import AttackObserver
from strategies.core.record import round_record
from strategies.core.resume import check_identity
from strategies.core.validation import (
    Rejection,
    ReplyLimits,
    typical_weight,
    validate_reply,
    weight_caps,
)
from tessera import wire
from tessera.results import TABLE_HEADER, ResultsWriter, format_round_row

log = logging.getLogger("flwr.tessera")

__all__ = ["HeteroStrategy", "RunStoppedError"]


class RunStoppedError(RuntimeError):
    """The run cannot go on (too many skipped rounds, too few nodes)."""


class HeteroStrategy(SchemeHooks[OptionsT]):
    """Base class of Tessera's schemes (see the module docstring).

    Generic over the scheme's options type: ``class FedProxStrategy(
    FedAvgStrategy[FedProxOptions])`` reads ``self.options.proximal_mu`` typed.

    Parameters
    ----------
    env : ServerEnv
        Task description and server-side data.
    options : OptionsT
        The scheme's own typed options (its ``Options.parse`` result).
    results : ResultsWriter | None
        Where round records and checkpoints go; ``None`` keeps them in memory only.
    aggregator : Aggregator | None
        Folds weight updates; by default the one named by run-config ``aggregator``.
    """

    def __init__(
        self,
        *,
        env: ServerEnv,
        options: OptionsT,
        results: ResultsWriter | None,
        aggregator: Aggregator | None = None,
    ) -> None:
        self.env = env
        self.options = options
        self.results = results
        self.aggregator = (
            aggregator
            if aggregator is not None
            else get_aggregator(
                env.run.aggregation.aggregator, AggregatorSettings.from_run(env.run)
            )
        )
        self.server_trust = env.run.aggregation.server_trust
        """Run-config ``server-trust`` (see :meth:`pool_direction`)."""
        self.weight_cap = env.run.aggregation.weight_cap
        """Run-config ``weight-cap`` (see :func:`strategies.core.validation.weight_caps`)."""
        self.federation = f"{self.name}-{uuid.uuid4().hex[:12]}"
        self.table = NodeTable()
        """Nodes that passed the handshake and the architecture each trains."""
        self.attacks = AttackObserver(env.run, env.global_test, env.num_classes)
        """The attack harness's plan and success (outside the scheme)."""
        self.rounds: list[dict[str, Any]] = list(results.rounds) if results is not None else []
        """Round records, those of before a resume included."""
        self.completed_round = 0
        self.failed_streak = 0
        self.final_metrics: dict[str, Any] = {}
        self._templates: dict[str, dict[str, np.ndarray]] = {}

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
            **self.table.state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the base part); subclasses restore theirs.

        Every field is checked before anything is restored: the checkpoint must be
        this scheme's and record the ``run_config`` it was written under, with every
        key of :data:`~strategies.core.resume.RESUME_IDENTITY_KEYS` equal to this
        run's (:func:`~strategies.core.resume.check_identity`), and each field must
        have its type (the round and counters non-negative integers, the federation
        id a safe name, every node entry complete).

        Raises
        ------
        ConfigError
            If the checkpoint is of another scheme or another experiment.
        CheckpointError
            If a field is missing or malformed; the message names the file, the
            field and the fix.
        """
        from tessera.checkpoint import refusal
        from tessera.state_checks import SAFE_ID, StateFileError, get_int, get_str

        try:
            check_identity(state, self.env.run, self.name)
            completed = get_int(state, "round")
            federation = get_str(state, "federation")
            if not SAFE_ID.match(federation):
                raise StateFileError(
                    "federation", f"is {federation!r}; expected a safe folder name"
                )
            streak = get_int(state, "failed_streak", default=0)
            table = NodeTable.from_state(state)
        except StateFileError as err:
            raise refusal(state, err) from err
        self.completed_round = completed
        self.federation = federation
        self.failed_streak = streak
        self.table = table

    # ------------------------------------------------------------ round loop
    def summary(self) -> None:
        """Log the scheme's configuration."""
        run = self.env.run
        log.info(
            "scheme %s on family %s, %d round(s), round-timeout %gs, aggregator %s, "
            "fraction-train %g, min-replies %d",
            self.name,
            self.env.family,
            run.scheme.num_server_rounds,
            run.deployment.round_timeout,
            self.aggregator.name,
            run.deployment.fraction_train,
            run.deployment.min_replies,
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
            min_nodes=run.deployment.min_nodes,
            timeout=run.deployment.node_wait_timeout,
            retry_timeout=run.deployment.superlink_retry_timeout,
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
        """Run one round's phases (see the module docstring); return its record."""
        skip_reason = self.refresh(grid, ctx, timeout, first_of_process=first_of_process)
        ctx.eligible = dict(self.assignment)
        if skip_reason is None:
            tick = time.monotonic()
            self.select(ctx)
            messages = self.build_messages(ctx)
            ctx.timed("build", tick)
            skip_reason = self.send_and_fold(grid, ctx, messages, timeout)
            del messages  # their payloads are not needed any longer
        extra, skip_reason = self.conclude(ctx, skip_reason)
        tick = time.monotonic()
        evaluation = self.evaluate(ctx)
        evaluation |= self.attacks.evaluate(self.evaluate_global)
        ctx.timed("evaluate", tick)
        record = round_record(
            ctx,
            strategy=self.name,
            table=self.table,
            model_ref=self.model_ref,
            attackers=self.attacks.attackers(self.table, ctx.assignment),
            evaluation=evaluation,
            extra=extra,
            skip_reason=skip_reason,
            personalise=self.env.run.personalise.mode,
        )
        self.commit_record(ctx, record)
        if self.failed_streak >= self.env.run.deployment.max_failed_rounds:
            raise RunStoppedError(
                f"{self.failed_streak} rounds in a row were skipped (max-failed-rounds="
                f"{self.env.run.deployment.max_failed_rounds}); the last: {skip_reason}. "
                "Check the nodes' logs and the 'failed'/'rejected' entries in metrics.jsonl"
            )
        return record

    def refresh(
        self, grid: Grid, ctx: RoundContext, timeout: float, *, first_of_process: bool
    ) -> str | None:
        """Phase 1: refresh the node table; return why the round is skipped, or ``None``.

        Raises
        ------
        RunStoppedError
            If fewer than ``min-nodes`` nodes can take part in the first round of
            this process.
        """
        run = self.env.run
        tick = time.monotonic()
        self._refresh_nodes(grid, timeout)
        ctx.timed("handshake", tick)
        if len(self.assignment) >= run.deployment.min_nodes:
            return None
        if first_of_process:
            reasons = "; ".join(f"node {r.node_id}: {r.reason}" for r in self.table.rejections)
            raise RunStoppedError(
                f"only {len(self.assignment)} node(s) can take part but min-nodes="
                f"{run.deployment.min_nodes}; handshake problems: {reasons or 'none'}"
            )
        self._wait_for_eligible(grid, timeout)
        if len(self.assignment) >= run.deployment.min_nodes:
            return None
        return (
            f"only {len(self.assignment)} node(s) can take part after waiting "
            f"node-wait-timeout={run.deployment.node_wait_timeout:g}s, "
            f"min-nodes={run.deployment.min_nodes}"
        )

    def select(self, ctx: RoundContext) -> None:
        """Phase 2: choose the trainers; set their reply schemas and claim limits."""
        run = self.env.run
        selected = self.select_nodes(ctx)
        ctx.assignment = {n: ctx.eligible[n] for n in selected}
        ctx.schemas = {n: self.reply_schema(ctx, n, a) for n, a in ctx.assignment.items()}
        caps = weight_caps(
            {n: self.nodes[n].num_train for n in ctx.assignment if n in self.nodes},
            self.weight_cap,
            run.aggregation.weight_trim,
        )
        typical = typical_weight(list(caps.values()))
        ctx.limits = {
            n: ReplyLimits(
                max_examples=self.nodes[n].num_train * run.training.local_epochs,
                max_test_examples=self.nodes[n].num_test,
                max_weight=caps[n],
                typical_weight=typical,
                stretch_cap=run.aggregation.bound_stretch,
            )
            for n in ctx.assignment
            if n in self.nodes
        }

    def build_messages(self, ctx: RoundContext) -> list[Message]:
        """Phase 3: one training message per trainer; their sizes go to ``ctx.bytes_down``."""
        ttl = max(self.env.run.deployment.round_timeout * 2.0, 60.0)
        messages = [
            Message(
                content=self.node_content(ctx, node_id, arch),
                dst_node_id=node_id,
                message_type="train",
                ttl=ttl,
            )
            for node_id, arch in sorted(ctx.assignment.items())
        ]
        sizes = wire.payload_sizes([m.content for m in messages])
        ctx.bytes_down = {
            int(m.metadata.dst_node_id): size for m, size in zip(messages, sizes, strict=True)
        }
        return messages

    def send_and_fold(
        self, grid: Grid, ctx: RoundContext, messages: list[Message], timeout: float
    ) -> str | None:
        """Phase 4: send, and fold each reply as it is pulled; return why the round is skipped."""
        run = self.env.run
        tick = time.monotonic()
        pool_train = self.pool_train_cpu
        outcome = exchange(
            grid,
            messages,
            timeout=timeout,
            on_reply=lambda reply: self.receive(ctx, reply),
            retry_timeout=run.deployment.superlink_retry_timeout,
            bytes_down=ctx.bytes_down,
        )
        ctx.timed("exchange", tick)
        ctx.phases["pull"] = outcome.pull_seconds
        ctx.phases["fold"] = outcome.fold_seconds
        # the server's own work (this thread's CPU time) apart from waiting: for
        # the engine and the nodes, and in simulation for the interpreter lock
        ctx.phases["pull_cpu"] = outcome.pull_cpu_seconds
        ctx.phases["fold_cpu"] = outcome.fold_cpu_seconds
        # of which the server's own training on its pool (the bounded mean's
        # direction check): bounded per round, not per reply
        ctx.phases["pool_train_cpu"] = self.pool_train_cpu - pool_train
        ctx.failures = outcome.missing
        for node, reason in outcome.missing.items():
            log.warning("round %d: node %d failed: %s", ctx.server_round, node, reason)
        if len(ctx.accepted) >= run.deployment.min_replies:
            return None
        n = len(ctx.accepted)
        return (
            f"{n} accepted repl{'y' if n == 1 else 'ies'} of {len(ctx.assignment)} sent, "
            f"min-replies={run.deployment.min_replies}"
        )

    def receive(self, ctx: RoundContext, reply: Message) -> None:
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

    def conclude(
        self, ctx: RoundContext, skip_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """Phase 5: aggregate a round that reached its quorum, or discard it.

        Returns the scheme's round-level metrics and why the round was skipped
        (``None`` when it was not); a state that cannot be aggregated, or is not
        finite, skips the round too.
        """
        extra: dict[str, Any] = {}
        if skip_reason is None:
            tick = time.monotonic()
            try:
                extra = self.aggregate(ctx, ctx.accepted)
            except NonFiniteStateError as err:
                skip_reason = f"refusing to ship a non-finite state: {err}"
            except (ValueError, ArithmeticError) as err:
                skip_reason = f"the accepted replies cannot be aggregated: {err}"
            ctx.timed("aggregate", tick)
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
        return extra, skip_reason

    def commit_record(self, ctx: RoundContext, record: dict[str, Any]) -> None:
        """Phase 7: keep the record, write it and (every ``checkpoint-every``) the state."""
        self.rounds.append(record)
        self.completed_round = ctx.server_round
        if self.results is not None:
            self.results.append_round(record)
            every = self.env.run.deployment.checkpoint_every
            if every > 0 and (ctx.server_round % every == 0 or ctx.server_round == ctx.num_rounds):
                self.results.write_checkpoint(self.state_dict())
        log.info(format_round_row(record, ctx.num_rounds))

    def _wait_for_eligible(self, grid: Grid, timeout: float) -> None:
        run = self.env.run
        deadline = time.monotonic() + run.deployment.node_wait_timeout
        log.warning(
            "only %d node(s) can take part, min-nodes=%d; waiting up to %gs for more",
            len(self.assignment),
            run.deployment.min_nodes,
            run.deployment.node_wait_timeout,
        )
        while len(self.assignment) < run.deployment.min_nodes and time.monotonic() < deadline:
            time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))
            self._refresh_nodes(grid, timeout)

    def _refresh_nodes(self, grid: Grid, timeout: float) -> None:
        """Handshake with nodes not seen yet; leave out nodes that disconnected."""
        changed = self.table.refresh(
            grid,
            self,
            federation=self.federation,
            num_classes=self.env.num_classes,
            timeout=timeout,
            retry_timeout=self.env.run.deployment.superlink_retry_timeout,
        )
        if changed and self.results is not None:
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
            **self.table.document(),
            "attack": self.attacks.document(self.table),
        }
