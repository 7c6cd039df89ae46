"""The Tessera ClientApp: handshake, local training, evaluation.

Message types handled:

- ``query.handshake``: probe the device (or take the emulated/forced profile), load
  this node's data, choose the largest architecture that fits, and report all of it.
- ``train``: train the architecture the server names with the scheme's local
  objective, evaluate on the node's own test split, reply with the scheme's records.
- ``evaluate``: evaluate received weights on the local test split (used by
  Flower's own FedAvg loop, the ``flwr-fedavg`` reference).

What persists across rounds lives in ``context.state`` (SuperNode memory, per run):
the device profile and choice, and the personalised model of schemes that keep one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.device import DeviceProfile, resolve_profile
from client_app.training import (
    OptimConfig,
    evaluate_model,
    label_counts,
    select_device,
    train_model,
)
from tessera import wire
from tessera.config import ConfigError, NodeConfig, RunConfig
from tessera.data import ArrayDataset, PartitionConfig, client_data, load_bundle, local_data

log = logging.getLogger("flwr.tessera")

app = ClientApp()

STATE_NODE = "tessera.node"
STATE_MODEL = "tessera.model"
STATE_MODEL_META = "tessera.model-meta"


@dataclass(frozen=True)
class NodeData:
    """Hold this node's data and where it came from."""

    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    input_shape: tuple[int, ...]
    partition_id: int


def partition_config(run: RunConfig) -> PartitionConfig:
    """Return the partitioner settings of the run."""
    return PartitionConfig(
        scheme=run.partitioner,
        alpha=run.dirichlet_alpha,
        classes_per_client=run.classes_per_client,
        seed=run.seed,
    )


def load_node_data(run: RunConfig, node: NodeConfig) -> NodeData:
    """Load this node's train and local-test data (its partition or its own file).

    The class count is the federation's (from the whole dataset), not the largest
    label this node happens to hold.
    """
    if node.data_path is not None:
        train, test, num_classes, input_shape = local_data(
            node.data_path, test_fraction=run.local_test_fraction, seed=run.seed
        )
        return NodeData(train, test, num_classes, tuple(input_shape), -1)
    assert node.partition_id is not None and node.num_partitions is not None
    bundle = load_bundle(run.dataset)
    train, test = client_data(
        bundle,
        partition_id=node.partition_id,
        num_partitions=node.num_partitions,
        partition=partition_config(run),
        pool_fraction=run.server_pool_fraction,
        test_fraction=run.local_test_fraction,
    )
    return NodeData(train, test, bundle.num_classes, bundle.input_shape, node.partition_id)


def _task_shape(config: ConfigRecord, data: NodeData) -> tuple[int, tuple[int, ...]]:
    """Return the federation's class count and input shape, checked against the data."""
    if "num-classes" not in config:
        return data.num_classes, data.input_shape
    num_classes = int(config["num-classes"])  # type: ignore[arg-type]
    input_shape = tuple(int(v) for v in config["input-shape"])  # type: ignore[union-attr]
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


def _profile(run: RunConfig, node: NodeConfig, context: Context) -> DeviceProfile:
    if STATE_NODE in context.state.config_records:
        rec = context.state.config_records[STATE_NODE]
        return DeviceProfile.from_dict(
            {k[len("device-") :]: v for k, v in rec.items() if k.startswith("device-")}
        )
    # No handshake state (e.g. the SuperNode restarted): probe, never emulate.
    return resolve_profile(node.device_profile, None, node.partition_id, benchmark=True)


@app.query("handshake")
def handshake(msg: Message, context: Context) -> Message:
    """Report device profile, data and the chosen architecture."""
    from client_app.selection import Budget, Workload, candidate_costs, choose_architecture
    from models import model_entry
    from strategies import get_scheme

    run = RunConfig.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    scheme = get_scheme(run.strategy)
    data = load_node_data(run, node)
    config = msg.content.config_records.get(wire.CONFIG, ConfigRecord())
    simulated = bool(config.get("simulation", False))
    profile = resolve_profile(
        node.device_profile,
        run.sim_device_profiles if simulated else None,
        node.partition_id,
        benchmark=True,
    )
    family = run.model_family or scheme.default_family
    workload = Workload(
        samples_per_round=len(data.train) * run.local_epochs,
        batch_size=run.batch_size,
        input_shape=data.input_shape,
        num_classes=data.num_classes,
    )
    if node.arch is not None:
        entry = model_entry(node.arch)
        arch, fits, reason = node.arch, True, "forced by node-config 'arch'"
        size_rank, family = entry.size_rank, entry.family
        est_mem, est_sec = 0, 0.0
    else:
        candidates = candidate_costs(family, data.input_shape, data.num_classes, norm=run.norm)
        choice = choose_architecture(
            profile,
            candidates,
            workload,
            Budget(max_round_seconds=run.train_time_budget, memory_fraction=run.memory_fraction),
        )
        arch, fits, reason = choice.name, choice.fits, choice.reason
        size_rank = model_entry(arch).size_rank
        est_mem, est_sec = choice.estimated_memory_bytes, choice.estimated_round_seconds
    log.info("node %s: profile %s -> %s (%s)", context.node_id, profile.name, arch, reason)
    record: dict[str, Any] = {
        "arch": arch,
        "family": family,
        "size-rank": size_rank,
        "arch-fits": fits,
        "arch-reason": reason,
        "estimated-memory-bytes": int(est_mem),
        "estimated-round-seconds": float(est_sec),
        "num-train": len(data.train),
        "num-test": len(data.test),
        "partition-id": data.partition_id,
        "label-counts": label_counts(data.train.y, data.num_classes),
    }
    record.update({f"device-{k}": v for k, v in profile.to_dict().items()})
    context.state[STATE_NODE] = ConfigRecord(
        {f"device-{k}": v for k, v in profile.to_dict().items()}
    )
    return Message(RecordDict({wire.PROFILE: ConfigRecord(record)}), reply_to=msg)


def _load_weights(model: torch.nn.Module, record: ArrayRecord) -> None:
    state = record.to_torch_state_dict()
    own = model.state_dict()
    missing = [k for k in own if k not in state and wire.is_exchanged(k)]
    unexpected = [k for k in state if k not in own]
    wrong = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or wrong:
        raise ConfigError(
            f"received weights do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}; server and client "
            "disagree on the architecture or the task (classes, input shape)"
        )
    model.load_state_dict(state, strict=False)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the named architecture with the scheme's objective and report."""
    from strategies import get_scheme

    run = RunConfig.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    scheme = get_scheme(run.strategy)
    algo = scheme.client(run=run, options=scheme.parse_options(context.run_config))
    content = msg.content
    config = content.config_records.get(wire.CONFIG, ConfigRecord())
    server_round = int(config.get("server-round", 0))  # type: ignore[arg-type]
    data = load_node_data(run, node)
    num_classes, input_shape = _task_shape(config, data)
    arch = algo.arch_for(config)
    profile = _profile(run, node, context)
    device = select_device(profile.accelerator)

    torch.manual_seed(run.seed + 1000 * (data.partition_id + 1))
    model = algo.build_model(arch, input_shape=input_shape, num_classes=num_classes)
    if wire.ARRAYS in content.array_records:
        _load_weights(model, content.array_records[wire.ARRAYS])
    elif algo.keeps_personal_model and STATE_MODEL in context.state.array_records:
        meta = context.state.config_records[STATE_MODEL_META]
        if meta["arch"] == arch:
            _load_weights(model, context.state.array_records[STATE_MODEL])
        else:
            log.warning(
                "stored personal model is %s but the server asks for %s; starting %s from scratch",
                meta["arch"],
                arch,
                arch,
            )
    model.to(device)
    algo.begin_round(model, content)
    stats = train_model(
        model,
        data.train,
        optim=OptimConfig(
            run.local_epochs, run.batch_size, run.learning_rate, run.momentum, run.weight_decay
        ),
        device=device,
        seed=run.seed + 7919 * server_round + data.partition_id,
        loss_fn=algo.loss_fn(),
    )
    test_loss, test_acc = evaluate_model(model, data.test, batch_size=256, device=device)
    weights = wire.state_to_record(model.state_dict())
    if algo.keeps_personal_model:
        context.state[STATE_MODEL] = weights
        context.state[STATE_MODEL_META] = ConfigRecord({"arch": arch})
    reply = RecordDict(
        {
            wire.METRICS: MetricRecord(
                {
                    wire.NUM_EXAMPLES: stats.num_examples,
                    wire.TRAIN_LOSS: stats.loss,
                    wire.TEST_ACCURACY: 0.0 if len(data.test) == 0 else test_acc,
                    wire.TEST_LOSS: 0.0 if len(data.test) == 0 else test_loss,
                    wire.NUM_TEST_EXAMPLES: len(data.test),
                    wire.TRAIN_SECONDS: stats.seconds,
                }
            )
        }
    )
    if algo.sends_weights:
        reply[wire.ARRAYS] = weights
    for name, record in algo.extra_records(model, data.train, device).items():
        reply[name] = record
    return Message(reply, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received weights on the local test split."""
    from strategies import get_scheme

    run = RunConfig.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)
    scheme = get_scheme(run.strategy)
    algo = scheme.client(run=run, options=scheme.parse_options(context.run_config))
    content = msg.content
    config = content.config_records.get(wire.CONFIG, ConfigRecord())
    data = load_node_data(run, node)
    num_classes, input_shape = _task_shape(config, data)
    model = algo.build_model(
        algo.arch_for(config), input_shape=input_shape, num_classes=num_classes
    )
    _load_weights(model, content.array_records[wire.ARRAYS])
    loss, acc = evaluate_model(model, data.test, batch_size=256, device=torch.device("cpu"))
    return Message(
        RecordDict(
            {
                wire.METRICS: MetricRecord(
                    {
                        wire.NUM_EXAMPLES: max(len(data.test), 1),
                        wire.TEST_LOSS: 0.0 if len(data.test) == 0 else loss,
                        wire.TEST_ACCURACY: 0.0 if len(data.test) == 0 else acc,
                    }
                )
            }
        ),
        reply_to=msg,
    )
