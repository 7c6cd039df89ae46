"""A node's own config records and data-cache entries, malformed, are discarded and rebuilt.

The rule: a node never fails every round because of what it stored. Its node state's
config records (the device profile, the personal model's metadata) are checked by
their readers, and a data-cache entry is bounded (class count, sample shape) before
anything is sized by it, also at the handshake, where the server has not yet
announced the task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from client_app.app import (
    STATE_MODEL,
    STATE_MODEL_META,
    STATE_NODE,
    handshake,
    node_record_problem,
    stored_profile,
    train,
)
from client_app.device import PREDEFINED_PROFILES
from strategies.core.client import MODEL_ROUNDS, model_meta_problem, personal_rounds
from tessera import wire
from tessera.config import NodeConfig
from tessera.data import load_bundle
from tessera.data.cache_entry import MAX_CLASSES, read_entry
from tessera.data.cache_memory import clear_memory_cache
from tessera.data.spec import KnownTask, known_task
from tessera.node_state import NodeState
from tests.test_client_app import handshake_message, profile_of
from tests.test_state_files import (
    FEDERATION_ID,
    _flattened,
    _more_classes,
    node_context,
    rewrite,
    round_message,
)

RunConfigFactory = Callable[..., dict[str, Any]]
Change = Callable[[dict[str, np.ndarray]], None]


@pytest.fixture
def fresh_memory() -> Iterator[None]:
    clear_memory_cache()
    yield
    clear_memory_cache()


def profile_record(name: str = "cpu-medium") -> ConfigRecord:
    """A device profile as the handshake keeps it in the node state."""
    profile = PREDEFINED_PROFILES[name]
    return ConfigRecord({f"device-{k}": v for k, v in profile.to_dict().items()})


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ============================================================ NodeState.checked_config
def test_checked_config_returns_a_record_its_check_accepts() -> None:
    # Prepare
    state = NodeState(RecordDict())
    state.put("meta", ConfigRecord({"arch": "cnn-1"}))

    # Execute
    record = state.checked_config("meta", lambda r: None)

    # Assert
    assert record is not None and record["arch"] == "cnn-1"
    assert state.checked_config("absent", lambda r: "never called") is None


def test_checked_config_forgets_a_bad_record_and_what_it_describes_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare
    state = NodeState(RecordDict())
    state.put("meta", ConfigRecord({"rounds": "many"}))
    state.put("model", ArrayRecord([np.ones(3, np.float32)]))
    state.put("other", ConfigRecord({"x": 1}))

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        record = state.checked_config("meta", lambda r: "its rounds are text", forget=("model",))

    # Assert: both gone, the unrelated record kept, and said why
    assert record is None
    assert state.config("meta") is None and state.arrays("model") is None
    assert state.config("other") is not None
    assert any("stored 'meta' is malformed (its rounds are text)" in m for m in warnings_of(caplog))


# ============================================================ personal-model metadata
@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        ({"arch": "cnn-1", "rounds": 3}, None),
        ({"arch": "cnn-1", "rounds": 0}, None),
        ({"arch": "cnn-1", "rounds": 2.0}, None),  # a whole float, as int_value reads it
        ({"arch": "cnn-1", "rounds": "many"}, "'rounds' is 'many', not a whole number"),
        ({"arch": "cnn-1", "rounds": 2.5}, "'rounds' is 2.5, not a whole number"),
        ({"arch": "cnn-1", "rounds": True}, "'rounds' is True, not a whole number"),
        ({"arch": "cnn-1", "rounds": -1}, "its 'rounds' is -1, below 0"),
        ({"arch": "cnn-1"}, None),  # no count: 0 rounds
        ({"arch": 7, "rounds": 3}, "its 'arch' is 7, not a model name"),
        ({"rounds": 3}, "its 'arch' is None, not a model name"),
    ],
)
def test_model_meta_problem(meta: dict[str, Any], problem: str | None) -> None:
    assert model_meta_problem(ConfigRecord(meta)) == problem


def test_personal_rounds_of_malformed_metadata_start_at_zero_and_forget_the_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare
    good = NodeState(RecordDict())
    good.put(STATE_MODEL_META, ConfigRecord({"arch": "cnn-1", "rounds": 4}))
    bad = NodeState(RecordDict())
    bad.put(STATE_MODEL, ArrayRecord([np.ones(3, np.float32)]))
    bad.put(STATE_MODEL_META, ConfigRecord({"arch": "cnn-1", "rounds": "many"}))

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        rounds = personal_rounds(bad, "cnn-1")

    # Assert
    assert personal_rounds(good, "cnn-1") == 4 and personal_rounds(good, "cnn-2") == 0
    assert rounds == 0
    assert bad.config(STATE_MODEL_META) is None and bad.arrays(STATE_MODEL) is None
    assert any("'tessera.model-meta' is malformed" in m for m in warnings_of(caplog))


# ============================================================ the stored device profile
def test_a_stored_device_profile_is_read_back_as_written() -> None:
    state = NodeState(RecordDict())
    state.put(STATE_NODE, profile_record("cpu-large"))
    assert node_record_problem(profile_record("cpu-large")) is None
    assert stored_profile(state) == PREDEFINED_PROFILES["cpu-large"]


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"device-name": "cpu-small", "device-cpu-cores": "four"}, "lacks key"),
        ({**profile_record(), "device-cpu-cores": "four"}, "'cpu-cores' has 'four'"),
        ({**profile_record(), "device-memory-bytes": -1}, "memory_bytes=-1 is invalid"),
        ({**profile_record(), "device-accelerator": "tpu"}, "accelerator 'tpu' is invalid"),
    ],
)
def test_a_malformed_device_profile_is_forgotten_with_a_warning(
    caplog: pytest.LogCaptureFixture, record: dict[str, Any], problem: str
) -> None:
    # Prepare
    state = NodeState(RecordDict())
    state.put(STATE_NODE, ConfigRecord(record))

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        profile = stored_profile(state)

    # Assert
    assert problem in str(node_record_problem(ConfigRecord(record)))
    assert profile is None and state.config(STATE_NODE) is None
    assert any("'tessera.node' is malformed" in m and problem in m for m in warnings_of(caplog))


# ============================================================ through the ClientApp
def damage_on_disk(
    run_config: RunConfigFactory, state_dir: Path, name: str, record: ConfigRecord
) -> None:
    """Train round 1 with a ``state-dir``, then replace one record of the file on disk."""
    first = node_context(run_config, state_dir)
    train(round_message(1), first)
    owner = NodeConfig.from_flower(first.node_config).owner
    disk = NodeState.open(
        RecordDict(), state_dir=str(state_dir), federation=FEDERATION_ID, owner=owner
    )
    assert disk.restored_from_disk
    disk.put(name, record)
    disk.save(1)


def test_a_node_restarted_with_malformed_model_metadata_trains_and_counts_afresh(
    run_config: RunConfigFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fast_clients: None,
    fresh_memory: None,
) -> None:
    # Prepare: the kept metadata's round count became text; the node restarts
    damage_on_disk(
        run_config, tmp_path, STATE_MODEL_META, ConfigRecord({"arch": "cnn-1", "rounds": "many"})
    )

    # Execute: two more rounds, each after a restart
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        replies = [train(round_message(r), node_context(run_config, tmp_path)) for r in (2, 3)]

    # Assert: no round failed, the personal model's count started again (1, then 2)
    assert [reply.has_error() for reply in replies] == [False, False]
    counts = [reply.content.metric_records[wire.METRICS][MODEL_ROUNDS] for reply in replies]
    assert counts == [1, 2]
    assert any(
        "'tessera.model-meta' is malformed ('rounds' is 'many'" in m for m in warnings_of(caplog)
    )


def test_a_node_restarted_with_a_malformed_device_profile_measures_it_again(
    run_config: RunConfigFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fast_clients: None,
    fresh_memory: None,
) -> None:
    # Prepare: the kept profile lost most of its keys; the node restarts
    broken = ConfigRecord({"device-name": "cpu-small", "device-cpu-cores": "four"})
    damage_on_disk(run_config, tmp_path, STATE_NODE, broken)

    # Execute: a train round, then a handshake, each after a restart
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        trained = train(round_message(2), node_context(run_config, tmp_path))
        damage_on_disk(run_config, tmp_path / "again", STATE_NODE, broken)
        restarted = node_context(run_config, tmp_path / "again")
        msg = handshake_message(7)
        msg.content.config_records[wire.CONFIG]["federation"] = FEDERATION_ID
        shaken = handshake(msg, restarted)

    # Assert: both answered; the handshake measured the device again and kept it
    assert not trained.has_error() and not shaken.has_error()
    kept = restarted.state.config_records[STATE_NODE]
    assert node_record_problem(kept) is None
    assert profile_of(shaken)["device-name"] == kept["device-name"]
    logged = [m for m in warnings_of(caplog) if "'tessera.node' is malformed" in m]
    assert len(logged) == 2 and all("lacks key" in m for m in logged)


# ============================================================ the data cache's bounds
KEY = "K"
X = np.random.default_rng(0).random((6, 1, 8, 8), dtype=np.float32)
Y = np.arange(6, dtype=np.int64) % 3  # labels 0, 1, 2


def write_raw_entry(path: Path, **change: np.ndarray) -> None:
    """An entry as write_entry stores it (6 samples, 3 classes), with arrays replaced."""
    arrays = {
        "key": np.asarray(KEY),
        "x_train": X,
        "y_train": Y,
        "x_test": X[:2],
        "y_test": Y[:2],
        "num_classes": np.asarray(3, np.int64),
        "input_shape": np.array([1, 8, 8], np.int64),
    }
    entry: dict[str, np.ndarray] = {**arrays, **change}
    with path.open("wb") as handle:
        np.savez(handle, allow_pickle=False, **entry)


@pytest.mark.parametrize(
    ("change", "logged"),
    [
        ({"num_classes": np.asarray(2**40, np.int64)}, "declares 1099511627776 classes"),
        ({"num_classes": np.asarray(MAX_CLASSES + 1, np.int64)}, "outside [1, 100000]"),
        ({"num_classes": np.asarray(0, np.int64)}, "declares 0 classes"),
        ({"num_classes": np.asarray(2, np.int64)}, "label 2 at index 2 is out of range"),
        (
            {
                "x_train": np.zeros((6, 1, 0, 8), np.float32),
                "x_test": np.zeros((2, 1, 0, 8), np.float32),
                "input_shape": np.array([1, 0, 8], np.int64),
            },
            "input shape (1, 0, 8) has a dimension below 1",
        ),
    ],
)
def test_a_cache_entry_out_of_bounds_is_discarded_without_expectations(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict[str, np.ndarray], logged: str
) -> None:
    # Prepare
    path = tmp_path / "node-data-x.npz"
    write_raw_entry(path, **change)

    # Execute: read as a caller that knows nothing of the task
    with caplog.at_level(logging.WARNING, logger="tessera.data.cache"):
        entry = read_entry(path, KEY)

    # Assert
    assert entry is None and not path.exists()
    assert any(logged in m for m in warnings_of(caplog)), warnings_of(caplog)


def test_a_cache_entry_at_the_bounds_is_accepted(tmp_path: Path) -> None:
    # Prepare: labels 0..2 allow 3 to MAX_CLASSES classes
    fewest, most = tmp_path / "node-data-a.npz", tmp_path / "node-data-b.npz"
    write_raw_entry(fewest)
    write_raw_entry(most, num_classes=np.asarray(MAX_CLASSES, np.int64))

    # Execute
    low, high = read_entry(fewest, KEY), read_entry(most, KEY)

    # Assert
    assert low is not None and low.num_classes == 3 and low.input_shape == (1, 8, 8)
    assert high is not None and high.num_classes == MAX_CLASSES


def test_the_known_tasks_are_what_the_loaders_return() -> None:
    digits = load_bundle("digits")
    assert known_task("digits") == KnownTask(digits.input_shape, digits.num_classes)
    assert known_task("digits") == KnownTask((1, 8, 8), 10)
    assert known_task("cifar10") == KnownTask((3, 32, 32), 10)
    assert known_task("hf:uoft-cs/cifar100") == KnownTask((3, 32, 32), 100)
    assert known_task("npz:/data/own.npz") is None
    assert known_task("someone/else") is None


def _huge_classes(arrays: dict[str, np.ndarray]) -> None:
    """Self-consistent (labels stay below 10), but 2**40 classes: 7 bytes changed."""
    arrays["num_classes"] = np.asarray(2**40, np.int64)


def _zero_width(arrays: dict[str, np.ndarray]) -> None:
    """Self-consistent: every sample of shape (1, 0, 8)."""
    arrays["x_train"] = np.zeros((len(arrays["y_train"]), 1, 0, 8), np.float32)
    arrays["x_test"] = np.zeros((len(arrays["y_test"]), 1, 0, 8), np.float32)
    arrays["input_shape"] = np.array([1, 0, 8], np.int64)


@pytest.mark.parametrize(
    ("change", "logged"),
    [
        (_flattened, "shape (1, 64) but the federation trains on (1, 8, 8)"),
        (_more_classes, "it has 20 classes but the federation has 10"),
        (_huge_classes, "declares 1099511627776 classes"),
        (_zero_width, "input shape (1, 0, 8) has a dimension below 1"),
    ],
)
def test_the_handshake_rebuilds_a_cache_entry_that_does_not_fit_the_dataset(
    run_config: RunConfigFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fast_clients: None,
    fresh_memory: None,
    change: Change,
    logged: str,
) -> None:
    # Prepare: round 1 caches the node's digits; the entry is then rewritten and
    # the node restarts (a new process: nothing in memory)
    strategy = "fedavg-groups"
    train(round_message(1, scheme=strategy), node_context(run_config, tmp_path, strategy=strategy))
    (entry,) = (tmp_path / ".data-cache").glob("node-data-*.npz")
    rewrite(entry, change)
    clear_memory_cache()

    # Execute: the handshake, which the server sends without the task
    with caplog.at_level(logging.WARNING, logger="tessera.data.cache"):
        reply = handshake(
            handshake_message(7), node_context(run_config, tmp_path, strategy=strategy)
        )

    # Assert: answered with the digits' 10 classes, said why, and cached them again
    assert not reply.has_error()
    counts = profile_of(reply)["label-counts"]
    assert isinstance(counts, list) and len(counts) == 10
    assert any("is unusable" in m and logged in m for m in warnings_of(caplog)), warnings_of(caplog)
    with np.load(entry) as npz:
        key = str(npz["key"])
    again = read_entry(entry, key, expect_shape=(1, 8, 8), expect_classes=10)
    assert again is not None and again.num_classes == 10 and again.input_shape == (1, 8, 8)


def test_a_node_with_its_own_data_file_is_not_held_to_the_run_s_dataset(
    run_config: RunConfigFactory,
) -> None:
    # Prepare: the run config names digits (a known task); one node reads a partition
    # of it, another its own file, whose samples need not be digits'
    from client_app.app import _handshake_task
    from tessera.config import RunConfig

    run = RunConfig.from_flower(run_config({"dataset": "digits"}))
    partition = NodeConfig.from_flower({"partition-id": 0, "num-partitions": 3})
    own = NodeConfig.from_flower({"data-path": "/data/mine.npz", "arch": "cnn-2"})

    # Execute / Assert: the partition node's cache is checked against digits' task,
    # the other's is not (its entry would be discarded at every handshake)
    assert _handshake_task(run, ConfigRecord(), partition) == (10, (1, 8, 8))
    assert _handshake_task(run, ConfigRecord(), own) == (None, None)
