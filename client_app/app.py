"""The Tessera ClientApp: handshake, local training, evaluation.

Message types handled:

- ``query.handshake``: probe the device (or take the emulated/forced profile), load
  this node's data (a cached entry that does not fit the run's dataset is rebuilt),
  choose the largest architecture that fits, and report all of it.
- ``train``: train the architecture the server names with the scheme's local
  objective, evaluate on the node's own test split, reply with the scheme's records.
- ``evaluate``: evaluate received weights on the local test split (used by
  Flower's own FedAvg loop, the ``flwr-fedavg`` reference).

What persists across rounds lives in ``context.state`` (SuperNode memory, per run),
wrapped by :class:`~tessera.node_state.NodeState`: the device profile, the
personalised model of schemes that keep one, and scheme state (FedHeNN's probe RAD).
With node-config ``state-dir`` it is also written to disk after every round and
reloaded after the SuperNode or its device restarts. A stored record its reader
cannot use (a device profile lacking a key, :func:`node_record_problem`) is
forgotten with a warning and rebuilt: the node never fails every round because of
what it stored.

The per-round flow is the scheme's client lifecycle
(:class:`~strategies.core.client.ClientAlgorithm`); :func:`train_round` drives it for
any algorithm, so a wrapper (:class:`~strategies.core.client.ClientWrapper`) composes
around any scheme's client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.attacks import with_attack
from client_app.device import DeviceProfile, DeviceProfileError, resolve_profile
from client_app.personalise import with_personalisation
from strategies.core.client import (
    STATE_MODEL,
    STATE_MODEL_META,
    ClientAlgorithm,
    Record,
    RoundInput,
    RoundOutcome,
    load_state_record,
)
from tessera import wire
from tessera.config import ConfigError, NodeConfig, RunConfig
from tessera.data import (
    ArrayDataset,
    PartitionConfig,
    load_bundle,
    node_cache_dir,
    node_local_data,
    node_partition_data,
)
from tessera.data.spec import known_task
from tessera.node_state import NodeState
from tessera.phases import (
    CLIENT_PHASES,
    PhaseClock,
    arrival_phases,
    metric_key,
    process_start_time,
)
from tessera.training import (
    OptimConfig,
    evaluate_model,
    label_counts,
    select_device,
    train_model,
)

log = logging.getLogger("flwr.tessera")

app = ClientApp()

STATE_NODE = "tessera.node"
"""Node state: the device profile (``device-*`` keys) chosen at the handshake."""
FEDERATION = "federation"
"""Config key of the federation id the server sends with every message."""

__all__ = [
    "STATE_MODEL",
    "STATE_MODEL_META",
    "STATE_NODE",
    "app",
    "evaluate",
    "handshake",
    "open_node_state",
    "resolve",
    "train",
    "train_round",
]


@dataclass(frozen=True)
class NodeData:
    """Hold this node's data and where it came from."""

    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    input_shape: tuple[int, ...]
    partition_id: int
    data_key: int = -1
    """Stable identity of the data: the partition, or for a node's own file a digest
    of its content (:func:`data_key`); it seeds training and orders nodes on the server."""


EMPTY_TEST_SPLIT = 4001
"""Error code of an evaluate reply from a node without a local test split."""


def data_key(train: ArrayDataset) -> int:
    """Return a stable 31-bit identity of a node's own training data.

    Nodes with their own data file report partition -1; without this they would
    share seeds, and the server's node order would hang on node ids, which change
    across restarts. The digest covers the labels, the shape and an evenly strided
    sample of the inputs (a few thousand values), so it costs little per message.
    """
    import hashlib

    flat = np.ascontiguousarray(train.x).reshape(-1)
    step = max(1, flat.size // 4096)
    digest = hashlib.sha256()
    digest.update(repr((tuple(train.x.shape), str(train.x.dtype))).encode())
    digest.update(np.ascontiguousarray(train.y).tobytes())
    digest.update(np.ascontiguousarray(flat[::step]).tobytes())
    return int.from_bytes(digest.digest()[:4], "big") & 0x7FFFFFFF


def partition_config(run: RunConfig) -> PartitionConfig:
    """Return the partitioner settings of the run."""
    return PartitionConfig(
        scheme=run.data.partitioner,
        alpha=run.data.dirichlet_alpha,
        classes_per_client=run.data.classes_per_client,
        seed=run.seed,
    )


def load_node_data(
    run: RunConfig,
    node: NodeConfig,
    *,
    expect_shape: tuple[int, ...] | None = None,
    expect_classes: int | None = None,
) -> NodeData:
    """Load this node's train and local-test data (its partition or its own file).

    The class count is the federation's (from the whole dataset), not the largest
    label this node happens to hold. The data is loaded and split once and then
    reused: in memory within this process, and across processes (a deployed
    ClientApp is a fresh process per message) in ``<state-dir>/.data-cache`` when
    node-config ``state-dir`` is set (:mod:`tessera.data.cache`). The arrays are
    shared with later messages: copy them before changing them in place.

    A node never fails every round because of what it cached: an entry that is
    unreadable, holds NaN, or (given what the server announced) has samples of
    another shape or more classes than the federation is discarded with a warning
    and rebuilt. Data built afresh is returned as it is, so a real mismatch is
    still reported (:func:`_task_shape`).

    Parameters
    ----------
    run : RunConfig
        The run configuration (dataset, partitioning, splits).
    node : NodeConfig
        This node's configuration (partition or ``data-path``, ``state-dir``).
    expect_shape : tuple of int, optional
        The per-sample input shape the server announced (``None``: not checked).
    expect_classes : int, optional
        The federation's class count the server announced (``None``: not checked).

    Returns
    -------
    NodeData
        Train and local-test data, class count, input shape and partition id.
    """
    cache_dir = node_cache_dir(node.state_dir)
    if node.data_path is not None:
        own = node_local_data(
            node.data_path,
            test_fraction=run.data.local_test_fraction,
            seed=run.seed,
            cache_dir=cache_dir,
            expect_shape=expect_shape,
            expect_classes=expect_classes,
        )
        return NodeData(
            own.train, own.test, own.num_classes, own.input_shape, -1, data_key(own.train)
        )
    assert node.partition_id is not None and node.num_partitions is not None
    part = node_partition_data(
        run.data.dataset,
        partition_id=node.partition_id,
        num_partitions=node.num_partitions,
        partition=partition_config(run),
        pool_fraction=run.data.server_pool_fraction,
        test_fraction=run.data.local_test_fraction,
        cache_dir=cache_dir,
        load=load_bundle,  # looked up per call: tests and benchmarks replace it
        expect_shape=expect_shape,
        expect_classes=expect_classes,
    )
    return NodeData(
        part.train,
        part.test,
        part.num_classes,
        part.input_shape,
        node.partition_id,
        node.partition_id,
    )


def _announced_task(config: ConfigRecord) -> tuple[int | None, tuple[int, ...] | None]:
    """Return the class count and input shape the server announced (``None``: none).

    The server sends both (``num-classes``, ``input-shape``) in every train
    message's config; Flower's own FedAvg loop (the ``flwr-fedavg`` reference)
    sends neither.

    Raises
    ------
    ConfigError
        If it announced a class count without an input shape.
    """
    if "num-classes" not in config:
        return None, None
    if "input-shape" not in config:
        raise ConfigError(
            "the server's config names 'num-classes' but no 'input-shape'; the server "
            "and this client run different Tessera versions (check both use the same FAB)"
        )
    num_classes = wire.int_value(config, "num-classes")
    input_shape = wire.int_list_value(config, "input-shape")
    return num_classes, input_shape


def _handshake_task(
    run: RunConfig, config: ConfigRecord, node: NodeConfig
) -> tuple[int | None, tuple[int, ...] | None]:
    """Return the class count and input shape a node's cached data must fit at the handshake.

    The server's announcement (:func:`_announced_task`) when the handshake carries
    one; else the task of the run config's dataset when it is known without loading
    it (:func:`~tessera.data.spec.known_task`: the digits, the hub datasets of the
    short names) for a node of a partition (a node with its own ``data-path`` reads
    another file); else ``None`` (not checked: the cache entry's own bounds still
    hold, :mod:`tessera.data.cache_entry`). A cached entry of another shape or more
    classes is discarded and rebuilt with a warning, as in a train round.
    """
    num_classes, input_shape = _announced_task(config)
    if num_classes is not None:
        return num_classes, input_shape
    if node.data_path is not None:  # its own file, not the run config's dataset
        return None, None
    task = known_task(run.data.dataset)
    return (None, None) if task is None else (task.num_classes, task.input_shape)


def _task_shape(config: ConfigRecord, data: NodeData) -> tuple[int, tuple[int, ...]]:
    """Return the federation's class count and input shape, checked against the data."""
    num_classes, input_shape = _announced_task(config)
    if num_classes is None or input_shape is None:
        return data.num_classes, data.input_shape
    if input_shape != data.input_shape:
        raise ConfigError(
            f"this node's data has samples of shape {data.input_shape} but the "
            f"federation trains on {input_shape}; give the node data of that shape "
            "(node-config 'data-path') or change run-config 'dataset'"
        )
    if data.num_classes > num_classes:
        raise ConfigError(
            f"this node's data has labels up to {data.num_classes - 1} but the "
            f"federation has {num_classes} classes; relabel the local data to "
            f"0..{num_classes - 1}"
        )
    return num_classes, input_shape


def open_node_state(context: Context, node: NodeConfig, config: ConfigRecord) -> NodeState:
    """Wrap ``context.state``; reload it from node-config ``state-dir`` after a restart."""
    federation = config.get(FEDERATION)
    return NodeState.open(
        context.state,
        state_dir=node.state_dir,
        federation=None if federation is None else str(federation),
        owner=node.owner,
    )


def _stored_profile(record: ConfigRecord) -> DeviceProfile:
    """Read the device profile kept in a :data:`STATE_NODE` record (its ``device-*`` keys).

    Raises
    ------
    DeviceProfileError
        If a key is missing or a value has the wrong type or range.
    """
    prefix = "device-"
    return DeviceProfile.from_dict(
        {k[len(prefix) :]: v for k, v in record.items() if k.startswith(prefix)}
    )


def node_record_problem(record: ConfigRecord) -> str | None:
    """Say why a stored :data:`STATE_NODE` record is malformed (``None``: it is not)."""
    try:
        _stored_profile(record)
    except DeviceProfileError as err:
        return str(err)
    return None


def stored_profile(state: NodeState) -> DeviceProfile | None:
    """Return the device profile the handshake kept in the node state (``None``: none).

    A malformed record (a damaged file, one an older version wrote) is forgotten
    with a warning (:meth:`~tessera.node_state.NodeState.checked_config`), so the
    node measures its device again instead of failing every round.
    """
    record = state.checked_config(STATE_NODE, node_record_problem)
    return None if record is None else _stored_profile(record)


def _profile(node: NodeConfig, state: NodeState) -> DeviceProfile:
    stored = stored_profile(state)
    if stored is not None:
        return stored
    # No (usable) handshake state, e.g. the SuperNode restarted without state-dir: probe.
    return resolve_profile(node.device_profile, None, node.partition_id, benchmark=True)


def resolve(run_config: Any) -> tuple[RunConfig, ClientAlgorithm[Any]]:
    """Read the run config as the scheme does (:func:`~strategies.core.registry.resolve_run`).

    Returns the resolved run config and the scheme's client algorithm.
    """
    from strategies import resolve_run

    resolved = resolve_run(run_config)
    return resolved.run, resolved.scheme.client(run=resolved.run, options=resolved.options)


@app.query("handshake")
def handshake(msg: Message, context: Context) -> Message:
    """Report device profile, data and the chosen architecture."""
    from client_app.selection import Budget, Workload, candidate_costs, choose_architecture
    from models import model_entry
    from models.spec import ModelRef
    from strategies import get_scheme

    run, client = resolve(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    algorithm = with_attack(client, run, node)
    config = msg.content.config_records.get(wire.CONFIG, ConfigRecord())
    expect_classes, expect_shape = _handshake_task(run, config, node)
    data = load_node_data(run, node, expect_shape=expect_shape, expect_classes=expect_classes)
    simulated = bool(config.get("simulation", False))
    state = open_node_state(context, node, config)
    stored = stored_profile(state) if state.restored_from_disk else None
    if stored is not None:
        profile = stored
        log.info("node %s: profile %s restored from node state", context.node_id, profile.name)
    else:
        profile = resolve_profile(
            node.device_profile,
            run.deployment.sim_device_profiles if simulated else None,
            node.partition_id,
            benchmark=True,
        )
    family = run.scheme.model_family or get_scheme(run.scheme.strategy).family(algorithm.options)
    workload = Workload(
        samples_per_round=len(data.train) * run.training.local_epochs,
        batch_size=run.training.batch_size,
        input_shape=data.input_shape,
        num_classes=data.num_classes,
    )
    if node.arch is not None:
        ref = ModelRef.parse(node.arch)  # a name a person typed
        entry = model_entry(ref.model)
        fits, reason = True, "forced by node-config 'arch'"
        size_rank, family = entry.size_rank, entry.family
        est_mem, est_sec = 0, 0.0
    else:
        refs = {ref.name: ref for ref in algorithm.candidate_archs(family)}
        candidates = candidate_costs(
            family,
            data.input_shape,
            data.num_classes,
            norm=run.scheme.norm,
            flat_input=run.scheme.flat_input,
            names=list(refs.values()),
        )
        choice = choose_architecture(
            profile,
            candidates,
            workload,
            Budget(
                max_round_seconds=run.training.train_time_budget,
                memory_fraction=run.training.memory_fraction,
            ),
        )
        ref, fits, reason = refs[choice.name], choice.fits, choice.reason
        size_rank = next(c.size_rank for c in candidates if c.name == ref.name)
        family = model_entry(ref.model).family  # "mixed" is a set of models, not their family
        if ref.spec is None:
            size_rank = model_entry(ref.model).size_rank  # the registry's, as the server checks
        est_mem, est_sec = choice.estimated_memory_bytes, choice.estimated_round_seconds
    log.info("node %s: profile %s -> %s (%s)", context.node_id, profile.name, ref, reason)
    record: dict[str, Any] = {
        **ref.to_config(),
        "arch": ref.name,
        "family": family,
        "size-rank": size_rank,
        "arch-fits": fits,
        "arch-reason": reason,
        "estimated-memory-bytes": int(est_mem),
        "estimated-round-seconds": float(est_sec),
        "num-train": len(data.train),
        "num-test": len(data.test),
        "partition-id": data.partition_id,
        "data-key": data.data_key,
        "label-counts": label_counts(data.train.y, data.num_classes),
        "state-restored": state.restored_from_disk,
        "state-round": state.saved_round,
    }
    record.update({f"device-{k}": v for k, v in profile.to_dict().items()})
    record = algorithm.handshake_profile(record)
    state.put(STATE_NODE, ConfigRecord({f"device-{k}": v for k, v in profile.to_dict().items()}))
    state.save(state.saved_round)
    return Message(RecordDict({wire.PROFILE: ConfigRecord(record)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the named architecture with the scheme's objective and report.

    A node the attack harness makes hostile (node-config ``attack``, or run-config
    ``attack`` and ``attack-fraction`` in simulation) runs the scheme's client inside
    :class:`client_app.attacks.AttackClient`.
    """
    run, client = resolve(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    algorithm = with_attack(with_personalisation(client, run), run, node)
    return train_round(msg, context, algorithm)


def train_round(msg: Message, context: Context, algorithm: ClientAlgorithm[Any]) -> Message:
    """Run one round of ``algorithm``'s lifecycle on this node and build the reply.

    Parameters
    ----------
    msg : Message
        The server's train message.
    context : Context
        The node's context (run and node config, ``context.state``).
    algorithm : ClientAlgorithm
        The scheme's client, possibly wrapped.

    Returns
    -------
    Message
        The reply with the records of :meth:`ClientAlgorithm.finish_round`.
    """
    from strategies import resolve_run

    entered = time.time()
    clock = PhaseClock()
    run = resolve_run(context.run_config).run
    node = NodeConfig.from_flower(context.node_config)
    content = msg.content
    config = content.config_records.get(wire.CONFIG, ConfigRecord())
    server_round = wire.int_value(config, "server-round") if "server-round" in config else 0
    state = open_node_state(context, node, config)
    expect_classes, expect_shape = _announced_task(config)
    data = load_node_data(run, node, expect_shape=expect_shape, expect_classes=expect_classes)
    train_set, test_set = algorithm.prepare_data(data.train, data.test)
    clock.lap("data")
    num_classes, input_shape = _task_shape(config, data)
    rnd = RoundInput(
        server_round=server_round,
        ref=algorithm.arch_for(config),
        num_classes=num_classes,
        input_shape=input_shape,
        content=content,
        config=config,
    )
    profile = _profile(node, state)
    device = select_device(profile.accelerator)

    torch.manual_seed(run.seed + 1000 * (data.data_key + 1))
    model = algorithm.build_model(rnd.ref, input_shape=input_shape, num_classes=num_classes)
    algorithm.load_weights(model, rnd, state)
    model.to(device)
    algorithm.begin_round(model, rnd, state)
    clock.lap("model")
    stats = train_model(
        model,
        train_set,
        optim=OptimConfig(
            run.training.local_epochs,
            run.training.batch_size,
            run.training.learning_rate,
            run.training.momentum,
            run.training.weight_decay,
        ),
        device=device,
        seed=run.seed + 7919 * server_round + data.data_key,
        loss_fn=algorithm.loss_fn(),
    )
    clock.lap("train")
    test_loss, test_acc = evaluate_model(model, test_set, batch_size=256, device=device)
    clock.lap("evaluate")
    outcome = RoundOutcome(
        stats=stats,
        test_loss=test_loss,
        test_accuracy=test_acc,
        num_test=len(test_set),
        train=train_set,
        device=device,
    )
    records = algorithm.finish_round(model, rnd, outcome, state)
    algorithm.save_state(model, rnd, state)
    state.save(server_round)
    clock.lap("reply")
    return Message(RecordDict(with_phases(records, msg, entered, clock)), reply_to=msg)


def with_phases(
    records: Mapping[str, Record], msg: Message, entered: float, clock: PhaseClock
) -> dict[str, Record]:
    """Add this round's phases (:mod:`tessera.phases`) to the reply's metrics record.

    ``queued`` and ``start`` come from the instruction's creation, this process's
    start and the handler's entry (``entered``, UNIX time); the others from
    ``clock``. A reply without a metrics record is returned as it is.
    """
    out = dict(records)
    metrics = out.get(wire.METRICS)
    if not isinstance(metrics, MetricRecord):
        return out
    seconds = arrival_phases(float(msg.metadata.created_at), entered, process_start_time())
    seconds.update(clock.seconds)
    timed = MetricRecord(dict(metrics))
    for phase in CLIENT_PHASES:
        timed[metric_key(phase)] = round(float(seconds.get(phase, 0.0)), 6)
    out[wire.METRICS] = timed
    return out


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received weights on the local test split."""
    run, algo = resolve(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    content = msg.content
    config = content.config_records.get(wire.CONFIG, ConfigRecord())
    expect_classes, expect_shape = _announced_task(config)
    data = load_node_data(run, node, expect_shape=expect_shape, expect_classes=expect_classes)
    num_classes, input_shape = _task_shape(config, data)
    model = algo.build_model(
        algo.arch_for(config), input_shape=input_shape, num_classes=num_classes
    )
    if len(data.test) == 0:
        # an accuracy of 0 on one made-up example would be averaged in as real; say why
        # there is nothing to report instead (Flower's strategies drop error replies)
        reason = (
            "this node has no local test split to evaluate on (run-config "
            f"local-test-fraction={run.data.local_test_fraction:g}); raise it above 0"
        )
        log.warning(reason)
        return Message(error=Error(code=EMPTY_TEST_SPLIT, reason=reason), reply_to=msg)
    load_state_record(model, content.array_records[wire.ARRAYS])
    loss, acc = evaluate_model(model, data.test, batch_size=256, device=torch.device("cpu"))
    return Message(
        RecordDict(
            {
                wire.METRICS: MetricRecord(
                    {
                        wire.NUM_EXAMPLES: len(data.test),
                        wire.TEST_LOSS: loss,
                        wire.TEST_ACCURACY: acc,
                    }
                )
            }
        ),
        reply_to=msg,
    )
