"""The round record: what happened in one round, as ``metrics.jsonl`` keeps it.

:func:`round_record` only records: the scheme's evaluation and the attack's success
are measured by the round loop before it is called and passed in.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from strategies.core.aggregation import mean_std
from strategies.core.context import RoundContext
from strategies.core.nodes import NodeTable
from strategies.core.validation import ClientReply
from tessera import wire
from tessera.phases import CLIENT_PHASES, RETURN, metric_key

if TYPE_CHECKING:
    from models.spec import ModelRef

__all__ = ["client_entry", "round_record", "server_memory_mb"]


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


def client_entry(
    reply: ClientReply, table: NodeTable, bytes_down: int, ref: ModelRef
) -> dict[str, Any]:
    """One accepted reply as the round record lists it (``ref``: its model, structured)."""
    info = table.nodes.get(reply.node_id)
    metrics = reply.metrics
    return {
        "node": reply.node_id,
        "partition_id": info.partition_id if info else None,
        "profile": info.profile.get("name") if info else None,
        "arch": reply.arch,
        **ref.to_record(),
        "num_examples": reply.num_examples,
        "train_loss": metrics[wire.TRAIN_LOSS],
        "test_accuracy": metrics[wire.TEST_ACCURACY],
        "test_loss": metrics[wire.TEST_LOSS],
        "num_test_examples": int(metrics[wire.NUM_TEST_EXAMPLES]),
        "bytes_up": reply.bytes_up,
        "bytes_down": bytes_down,
        "train_seconds": metrics[wire.TRAIN_SECONDS],
        **({"model_rounds": int(metrics["model-rounds"])} if "model-rounds" in metrics else {}),
        **(
            {"shared_accuracy": metrics[wire.SHARED_ACCURACY]}
            if wire.SHARED_ACCURACY in metrics
            else {}
        ),
        "phases": client_phases(reply),
    }


def client_phases(reply: ClientReply) -> dict[str, float]:
    """Return the phases of one reply (:mod:`tessera.phases`): the node's own, then the way back."""
    own = {p: reply.metrics[metric_key(p)] for p in CLIENT_PHASES if metric_key(p) in reply.metrics}
    return {**own, RETURN: round(reply.returned, 6)}


def mean_phases(clients: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds of each phase over the replies that report it, in phase order."""
    out: dict[str, float] = {}
    for phase in (*CLIENT_PHASES, RETURN):
        values = [c["phases"][phase] for c in clients if phase in c.get("phases", {})]
        if values:
            out[phase] = round(float(np.mean(values)), 4)
    return out


def round_record(
    ctx: RoundContext,
    *,
    strategy: str,
    table: NodeTable,
    model_ref: Callable[[str], ModelRef],
    attackers: list[dict[str, Any]],
    evaluation: Mapping[str, Any],
    extra: Mapping[str, Any],
    skip_reason: str | None,
    personalise: str = "none",
) -> dict[str, Any]:
    """Build the record of a finished round.

    Parameters
    ----------
    ctx : RoundContext
        The round.
    strategy : str
        The scheme's name.
    table : NodeTable
        The node table (partitions and profiles of the repliers).
    model_ref : Callable[[str], ModelRef]
        The structured model behind an architecture name (the scheme's
        :meth:`~strategies.core.hooks.SchemeHooks.model_ref`), recorded with each reply.
    attackers : list[dict]
        Selected nodes the attack plan made hostile.
    evaluation : Mapping[str, Any]
        The scheme's evaluation and the attack's success, merged into the record.
    extra : Mapping[str, Any]
        What the scheme's ``aggregate`` returned, merged last.
    skip_reason : str | None
        Why the round was skipped, or ``None``.
    personalise : str
        Run-config ``personalise``: which model the clients' ``test_accuracy``
        (``personal_accuracy_*``) measures; ``shared_accuracy_mean`` is the sent
        model's where the mode reports it.
    """
    clients = [
        client_entry(rep, table, ctx.bytes_down.get(rep.node_id, 0), model_ref(rep.arch))
        for rep in sorted(ctx.accepted, key=lambda r: r.node_id)
    ]
    tested = [c for c in clients if c["num_test_examples"] > 0]
    mean, std = mean_std([c["test_accuracy"] for c in tested])
    shared = [c["shared_accuracy"] for c in tested if "shared_accuracy" in c]
    by_arch: dict[str, list[float]] = defaultdict(list)
    for c in tested:
        by_arch[c["arch"]].append(c["test_accuracy"])
    seconds = time.monotonic() - ctx.started
    slowest = max((c["train_seconds"] for c in clients), default=0.0)
    partitions = [p for n in ctx.assignment if (p := table.partition_of(n)) is not None]
    return {
        "round": ctx.server_round,
        "strategy": strategy,
        "skipped": skip_reason is not None,
        "skip_reason": skip_reason,
        "clients": clients,
        "num_eligible": len(ctx.eligible),
        "num_sent": len(ctx.assignment),
        "num_ok": len(ctx.accepted),
        "num_rejected": len(ctx.rejected),
        "num_failed": len(ctx.failures),
        "selected": sorted(ctx.assignment),
        "selected_partitions": sorted(partitions),
        "attackers": attackers,
        "rejected": [{"node": r.node_id, "reason": r.reason} for r in ctx.rejected],
        "failed": [{"node": n, "reason": r} for n, r in sorted(ctx.failures.items())],
        "personal_accuracy_mean": mean,
        "personal_accuracy_std": std,
        "personal_accuracy_by_arch": {a: float(np.mean(v)) for a, v in sorted(by_arch.items())},
        "personalise": personalise,
        "shared_accuracy_mean": mean_std(shared)[0] if shared else None,
        **evaluation,
        "bytes_up_total": sum(c["bytes_up"] for c in clients),
        "bytes_down_total": sum(ctx.bytes_down.values()),
        "round_seconds": seconds,
        "slowest_train_seconds": slowest,
        "overhead_seconds": seconds - slowest,
        "phase_seconds": {k: round(v, 4) for k, v in ctx.phases.items()},
        "client_phase_seconds": mean_phases(clients),
        "server_memory_mb": server_memory_mb(),
        **dict(extra),
    }
