"""ClientApp handlers called directly with real Flower messages and contexts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

import client_app.app
from client_app.app import (
    STATE_MODEL,
    STATE_MODEL_META,
    STATE_NODE,
    evaluate,
    handshake,
    load_node_data,
    train,
)
from client_app.device import DeviceProfileError
from models import get_model, model_entry
from models.spec import ModelRef
from tessera import wire
from tessera.config import ConfigError, NodeConfig, RunConfig
from tessera.data.cache_memory import clear_memory_cache
from tests.conftest import instruction, make_context

RunConfigFactory = Callable[..., dict[str, Any]]
NODE = 5
DIGITS_SHAPE = [1, 8, 8]


@pytest.fixture(autouse=True)
def _fast(fast_clients: None) -> None:
    """Every test here runs the handlers with the cached data and one torch thread."""


def handshake_message(node_id: int = NODE, *, simulation: bool = True) -> Message:
    content = RecordDict({wire.CONFIG: ConfigRecord({"server-round": 0, "simulation": simulation})})
    return instruction(content, dst_node_id=node_id, message_type=wire.HANDSHAKE)


def train_message(
    arch: str,
    *,
    scheme: str,
    server_round: int = 1,
    input_shape: list[int] | None = None,
    num_classes: int = 10,
    arrays: ArrayRecord | None = None,
) -> Message:
    config = ConfigRecord(
        {
            "server-round": server_round,
            "scheme": scheme,
            **ModelRef.parse(arch).to_config(),
            "arch": arch,
            "num-classes": num_classes,
            "input-shape": input_shape or DIGITS_SHAPE,
        }
    )
    content = RecordDict({wire.CONFIG: config})
    if arrays is not None:
        content[wire.ARRAYS] = arrays
    return instruction(content, dst_node_id=NODE, message_type="train")


def context_for(
    run_config: RunConfigFactory,
    overrides: dict[str, Any] | None = None,
    **node_config: Any,
) -> Context:
    node = {"partition-id": 1, "num-partitions": 3, **node_config}
    config = run_config({"local-epochs": 1, "model-family": "cnn", **(overrides or {})})
    return make_context(NODE, config, node)


def profile_of(reply: Message) -> ConfigRecord:
    return reply.content.config_records[wire.PROFILE]


# ---------------------------------------------------------------------------- handshake
def test_handshake_reply_is_addressed_back_to_the_server(run_config: RunConfigFactory) -> None:
    # Prepare
    msg = handshake_message()

    # Execute
    reply = handshake(msg, context_for(run_config))

    # Assert
    assert reply.metadata.src_node_id == NODE
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id
    assert reply.metadata.message_type == wire.HANDSHAKE


def test_handshake_reports_profile_data_and_choice(run_config: RunConfigFactory) -> None:
    # Prepare: partition 1 -> the second of the sim profiles, cpu-large
    context = context_for(run_config)

    # Execute
    record = profile_of(handshake(handshake_message(), context))

    # Assert
    assert record["device-name"] == "cpu-large"
    assert record["family"] == "cnn"
    assert record["size-rank"] == model_entry(str(record["arch"])).size_rank
    assert record["arch-fits"] is True
    assert record["partition-id"] == 1
    assert record["num-train"] > 0
    assert record["num-test"] > 0
    assert len(record["label-counts"]) == 10
    assert sum(record["label-counts"]) == record["num-train"]
    assert context.state.config_records[STATE_NODE]["device-name"] == "cpu-large"


def test_handshake_node_config_arch_forces_that_arch(run_config: RunConfigFactory) -> None:
    # Prepare
    context = context_for(run_config, arch="cnn-2")

    # Execute
    record = profile_of(handshake(handshake_message(), context))

    # Assert
    assert record["arch"] == "cnn-2"
    assert record["size-rank"] == 1
    assert record["family"] == "cnn"
    assert record["arch-fits"] is True
    assert "forced by node-config 'arch'" in str(record["arch-reason"])


def test_handshake_node_config_device_profile_wins(run_config: RunConfigFactory) -> None:
    # Prepare: partition 1 would be cpu-large by round-robin
    context = context_for(run_config, **{"device-profile": "cpu-small"})

    # Execute
    record = profile_of(handshake(handshake_message(), context))

    # Assert
    assert record["device-name"] == "cpu-small"
    assert record["device-cpu-cores"] == 1.0
    assert record["device-memory-bytes"] == 512 * 1024 * 1024
    assert context.state.config_records[STATE_NODE]["device-name"] == "cpu-small"


def test_handshake_weak_profile_chooses_smaller_arch(run_config: RunConfigFactory) -> None:
    # Prepare: the same partition on two profiles
    weak = context_for(run_config, **{"device-profile": "cpu-small"})
    strong = context_for(run_config, **{"device-profile": "gpu-server"})

    # Execute
    weak_rank = profile_of(handshake(handshake_message(), weak))["size-rank"]
    strong_rank = profile_of(handshake(handshake_message(), strong))["size-rank"]

    # Assert
    assert weak_rank < strong_rank


def test_handshake_with_unknown_device_profile_raises(run_config: RunConfigFactory) -> None:
    # Prepare
    context = context_for(run_config, **{"device-profile": "toaster"})

    # Execute / Assert
    with pytest.raises(DeviceProfileError, match="toaster"):
        handshake(handshake_message(), context)


def write_npz(path: Path, num: int = 60) -> Path:
    rng = np.random.default_rng(0)
    x = rng.random((num, 1, 8, 8), dtype=np.float32)
    y = np.arange(num, dtype=np.int64) % 10
    np.savez(path, x_train=x, y_train=y)
    return path


def test_handshake_with_data_path_and_device_profile(
    run_config: RunConfigFactory, tmp_path: Path
) -> None:
    # Prepare: 60 samples, local-test-fraction 0.2 -> 48 train, 12 test
    data = write_npz(tmp_path / "mine.npz")
    context = make_context(
        NODE,
        run_config({"local-epochs": 1, "model-family": "cnn"}),
        {"data-path": str(data), "device-profile": "cpu-small"},
    )

    # Execute
    record = profile_of(handshake(handshake_message(), context))

    # Assert
    assert record["num-train"] == 48
    assert record["num-test"] == 12
    assert record["partition-id"] == -1
    assert record["device-name"] == "cpu-small"


def test_handshake_with_data_path_and_default_run_config(
    run_config: RunConfigFactory, tmp_path: Path
) -> None:
    # Prepare: a real device with its own data and the default run config
    data = write_npz(tmp_path / "mine.npz")
    context = make_context(
        NODE, run_config({"local-epochs": 1, "model-family": "cnn"}), {"data-path": str(data)}
    )

    # Execute: a deployment handshake (not simulation), so the device is probed
    record = profile_of(handshake(handshake_message(simulation=False), context))

    # Assert
    assert record["num-train"] == 48
    assert record["device-source"] == "probed"


# -------------------------------------------------------------------------------- train
@pytest.fixture
def initial_states(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """The model's weights as local training starts, one entry per train call."""
    seen: list[dict[str, torch.Tensor]] = []
    real = client_app.app.train_model

    def recording_train_model(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(client_app.app, "train_model", recording_train_model)
    return seen


def test_local_train_second_call_starts_from_the_stored_personal_model(
    run_config: RunConfigFactory, initial_states: list[dict[str, torch.Tensor]]
) -> None:
    # Prepare
    context = context_for(run_config, {"strategy": "local"})

    # Execute
    first = train(train_message("cnn-1", scheme="local", server_round=1), context)
    stored = {k: v.numpy().copy() for k, v in context.state.array_records[STATE_MODEL].items()}
    second = train(train_message("cnn-1", scheme="local", server_round=2), context)

    # Assert
    assert context.state.config_records[STATE_MODEL_META]["arch"] == "cnn-1"
    assert len(initial_states) == 2
    start_1, start_2 = initial_states
    assert any(not np.array_equal(start_1[k].numpy(), stored[k]) for k in stored), (
        "training did not change the model"
    )
    for key, value in stored.items():
        np.testing.assert_array_equal(start_2[key].numpy(), value)
    # the local scheme never sends weights back
    for reply in (first, second):
        assert len(reply.content.array_records) == 0
        assert wire.METRICS in reply.content.metric_records


def test_local_train_other_arch_starts_from_scratch(
    run_config: RunConfigFactory,
    initial_states: list[dict[str, torch.Tensor]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare
    context = context_for(run_config, {"strategy": "local"})
    train(train_message("cnn-1", scheme="local"), context)

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        train(train_message("cnn-2", scheme="local", server_round=2), context)

    # Assert
    assert "stored personal model is cnn-1 but the server asks for cnn-2" in caplog.text
    assert set(initial_states[1]) == set(
        get_model("cnn-2", input_shape=(1, 8, 8), num_classes=10).state_dict()
    )
    assert context.state.config_records[STATE_MODEL_META]["arch"] == "cnn-2"


def test_fedavg_train_loads_the_received_weights_and_returns_new_ones(
    run_config: RunConfigFactory, initial_states: list[dict[str, torch.Tensor]]
) -> None:
    # Prepare: weights the client could not have produced itself
    model = get_model("cnn-1", input_shape=(1, 8, 8), num_classes=10)
    sent = {
        k: torch.full_like(v, 0.01) if v.is_floating_point() else v
        for k, v in wire.exchanged_state(model.state_dict()).items()
    }
    context = context_for(run_config, {"strategy": "fedavg"})
    msg = train_message("cnn-1", scheme="fedavg", arrays=wire.state_to_record(sent))

    # Execute
    reply = train(msg, context)

    # Assert
    (start,) = initial_states
    assert not any(k.endswith("num_batches_tracked") for k in sent)  # never on the wire
    for key, value in sent.items():
        torch.testing.assert_close(start[key], value)
    returned = wire.record_to_numpy(reply.content.array_records[wire.ARRAYS])
    assert set(returned) == set(sent)
    assert {k: v.shape for k, v in returned.items()} == {k: tuple(v.shape) for k, v in sent.items()}
    metrics = reply.content.metric_records[wire.METRICS]
    assert set(wire.REQUIRED_TRAIN_METRICS) <= set(metrics)
    assert STATE_MODEL not in context.state.array_records


def test_train_with_mismatched_input_shape_raises_naming_both_shapes(
    run_config: RunConfigFactory,
) -> None:
    # Prepare
    context = context_for(run_config, {"strategy": "fedavg-groups"})
    msg = train_message("cnn-1", scheme="fedavg-groups", input_shape=[3, 32, 32])

    # Execute / Assert
    with pytest.raises(ConfigError) as info:
        train(msg, context)
    assert "(1, 8, 8)" in str(info.value)
    assert "(3, 32, 32)" in str(info.value)


def test_train_with_fewer_federation_classes_than_local_labels_raises(
    run_config: RunConfigFactory,
) -> None:
    # Prepare: digits has labels 0..9, the server claims 5 classes
    context = context_for(run_config, {"strategy": "fedavg-groups"})
    msg = train_message("cnn-1", scheme="fedavg-groups", num_classes=5)

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"labels up to 9 but the federation has 5 classes"):
        train(msg, context)


def test_train_without_arch_raises(run_config: RunConfigFactory) -> None:
    # Prepare
    context = context_for(run_config, {"strategy": "fedavg-groups"})
    content = RecordDict({wire.CONFIG: ConfigRecord({"server-round": 1})})
    msg = instruction(content, dst_node_id=NODE, message_type="train")

    # Execute / Assert
    with pytest.raises(ConfigError, match="names no 'model' or 'arch'"):
        train(msg, context)


def test_train_with_missing_weights_raises_naming_them(run_config: RunConfigFactory) -> None:
    # Prepare: cnn-1 weights without the head bias
    state = get_model("cnn-1", input_shape=(1, 8, 8), num_classes=10).state_dict()
    del state["head.bias"]
    context = context_for(run_config, {"strategy": "fedavg"})
    msg = train_message("cnn-1", scheme="fedavg", arrays=wire.state_to_record(state))

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"missing \['head.bias'\].*disagree on the architecture"):
        train(msg, context)


def test_train_with_weights_of_another_arch_raises_config_error(
    run_config: RunConfigFactory,
) -> None:
    # Prepare: cnn-1 weights (same names, other shapes) for a cnn-3 model
    model = get_model("cnn-1", input_shape=(1, 8, 8), num_classes=10)
    context = context_for(run_config, {"strategy": "fedavg"})
    msg = train_message("cnn-3", scheme="fedavg", arrays=wire.state_to_record(model.state_dict()))

    # Execute / Assert
    with pytest.raises(ConfigError, match="disagree on the architecture"):
        train(msg, context)


# ----------------------------------------------------------------------------- evaluate
def test_evaluate_reports_local_test_metrics(run_config: RunConfigFactory) -> None:
    # Prepare
    model = get_model("cnn-1", input_shape=(1, 8, 8), num_classes=10)
    context = context_for(run_config, {"strategy": "fedavg"})
    content = RecordDict(
        {
            wire.CONFIG: ConfigRecord({"model": "cnn-1", "arch": "cnn-1", "server-round": 1}),
            wire.ARRAYS: wire.state_to_record(model.state_dict()),
        }
    )
    msg = instruction(content, dst_node_id=NODE, message_type="evaluate")
    handshake_record = profile_of(handshake(handshake_message(), context))

    # Execute
    reply = evaluate(msg, context)

    # Assert
    metrics = reply.content.metric_records[wire.METRICS]
    assert metrics[wire.NUM_EXAMPLES] == handshake_record["num-test"]
    assert 0.0 <= metrics[wire.TEST_ACCURACY] <= 1.0
    assert metrics[wire.TEST_LOSS] > 0.0
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id


# ---------------------------------------------------------------------------- node data
def test_node_data_is_built_once_and_kept_in_the_state_dir(
    run_config: RunConfigFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: count the dataset loads; the process starts with nothing in memory
    loads: list[str] = []
    real_load = client_app.app.load_bundle

    def counting_load(spec: Any) -> Any:
        loads.append(str(spec))
        return real_load(spec)

    monkeypatch.setattr(client_app.app, "load_bundle", counting_load)
    clear_memory_cache()
    context = context_for(run_config, {"strategy": "fedavg"}, **{"state-dir": str(tmp_path)})
    run = RunConfig.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)

    # Execute: the handshake, then a message in a fresh process (memory forgotten)
    record = profile_of(handshake(handshake_message(), context))
    clear_memory_cache()
    data = load_node_data(run, node)

    # Assert
    assert loads == ["digits"]
    assert (len(data.train), len(data.test)) == (record["num-train"], record["num-test"])
    assert len(list((tmp_path / ".data-cache").glob("node-data-*.npz"))) == 1
    clear_memory_cache()


def test_node_data_without_state_dir_stays_in_memory(
    run_config: RunConfigFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    loads: list[str] = []
    real_load = client_app.app.load_bundle

    def counting_load(spec: Any) -> Any:
        loads.append(str(spec))
        return real_load(spec)

    monkeypatch.setattr(client_app.app, "load_bundle", counting_load)
    monkeypatch.chdir(tmp_path)
    clear_memory_cache()
    context = context_for(run_config, {"strategy": "fedavg"})
    run = RunConfig.from_flower(context.run_config)
    node = NodeConfig.from_flower(context.node_config)

    # Execute
    first = load_node_data(run, node)
    second = load_node_data(run, node)
    clear_memory_cache()
    load_node_data(run, node)

    # Assert: reused within the process, rebuilt in a new one, nothing written
    assert second.train is first.train
    assert loads == ["digits", "digits"]
    assert list(tmp_path.iterdir()) == []
