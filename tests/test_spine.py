"""The spine's seams: aggregator maths, checkpoints, node state, retries, module layering."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from strategies.core.aggregation import AggregationError
from strategies.core.aggregators import get_aggregator, list_aggregators
from strategies.core.exchange import (
    SuperLinkUnavailableError,
    call_with_retries,
    is_transient,
)
from strategies.core.groups import GroupModels, GroupRound
from strategies.core.mean import MeanAccumulator
from tessera import wire
from tessera.checkpoint import CheckpointError, load_state, save_state
from tessera.config import ConfigError
from tessera.node_state import NodeState, check_federation_id

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------- layering
def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("package", ["strategies", "models", "tessera"])
def test_lower_layers_never_import_the_apps(package: str) -> None:
    # Prepare
    files = sorted((ROOT / package).rglob("*.py"))

    # Execute
    offenders = {
        str(f.relative_to(ROOT)): sorted(
            m for m in _imported_modules(f) if m.split(".")[0] in {"client_app", "server_app"}
        )
        for f in files
    }

    # Assert
    assert files
    assert {f: m for f, m in offenders.items() if m} == {}


def test_importing_the_schemes_loads_no_app_module() -> None:
    # Execute
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import strategies, sys; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('client_app', 'server_app')))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    # Assert
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ------------------------------------------------------------------ mean accumulator
def test_mean_accumulator_weighted_mean_by_hand() -> None:
    # Prepare: (2 * [1, 2] + 6 * [5, 10]) / 8 = [4, 8]; int entry rounds
    ref = {"w": np.zeros(2, np.float32), "n": np.zeros((), np.int64)}
    acc = MeanAccumulator(ref)

    # Execute
    acc.add({"w": np.array([1.0, 2.0], np.float32), "n": np.array(1)}, 2.0)
    acc.add({"w": np.array([5.0, 10.0], np.float32), "n": np.array(2)}, 6.0)
    out = acc.result()

    # Assert: n = (2 * 1 + 6 * 2) / 8 = 1.75 -> 2
    np.testing.assert_array_equal(out["w"], np.array([4.0, 8.0], np.float32))
    assert out["w"].dtype == np.float32
    assert int(out["n"]) == 2 and out["n"].dtype == np.int64
    assert acc.count == 2


def test_mean_accumulator_coverage_averages_each_entry_over_its_covering_updates() -> None:
    # Prepare: global 2x3 entry; A covers all (weight 1), B covers [:1, :2] (weight 3)
    ref = {"w": np.full((2, 3), 9.0, np.float32), "b": np.full(3, 7.0, np.float32)}
    acc = MeanAccumulator(ref)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)  # [[0,1,2],[3,4,5]]
    b = np.array([[10.0, 20.0]], np.float32)

    # Execute: B leaves 'b' out entirely
    acc.add({"w": a, "b": np.zeros(3, np.float32)}, 1.0)
    acc.add({"w": b}, 3.0, index={"w": (slice(0, 1), slice(0, 2))})
    out = acc.result()

    # Assert: covered by both: (1*0 + 3*10)/4 = 7.5, (1*1 + 3*20)/4 = 15.25; else A alone
    expected = np.array([[7.5, 15.25, 2.0], [3.0, 4.0, 5.0]], np.float32)
    np.testing.assert_allclose(out["w"], expected)
    np.testing.assert_array_equal(out["b"], np.zeros(3, np.float32))


def test_mean_accumulator_uncovered_entries_keep_the_reference() -> None:
    # Prepare
    ref = {"w": np.full((2, 2), 3.0, np.float32), "v": np.ones(2, np.float32)}
    acc = MeanAccumulator(ref)

    # Execute: only the top-left element of w is covered
    acc.add({"w": np.array([[5.0]], np.float32)}, 2.0, index={"w": (slice(0, 1), slice(0, 1))})
    out = acc.result()

    # Assert
    np.testing.assert_array_equal(out["w"], np.array([[5.0, 3.0], [3.0, 3.0]], np.float32))
    np.testing.assert_array_equal(out["v"], ref["v"])


@pytest.mark.parametrize(
    ("update", "weight", "index", "match"),
    [
        ({"w": np.zeros(2, np.float32)}, 0.0, None, "weight"),
        ({"w": np.zeros(2, np.float32)}, float("nan"), None, "weight"),
        ({"w": np.zeros(3, np.float32)}, 1.0, None, "shape"),
        ({"w": np.zeros(2, np.float64)}, 1.0, None, "float64"),
        ({"x": np.zeros(2, np.float32)}, 1.0, None, "lacks"),
        ({"w": np.zeros(1, np.float32)}, 1.0, {"w": (slice(0, 2),)}, "spans"),
    ],
)
def test_mean_accumulator_rejects_bad_updates_without_changing_anything(
    update: dict[str, np.ndarray], weight: float, index: Any, match: str
) -> None:
    # Prepare
    acc = MeanAccumulator({"w": np.zeros(2, np.float32)})
    acc.add({"w": np.array([2.0, 4.0], np.float32)}, 1.0)

    # Execute / Assert
    with pytest.raises(AggregationError, match=match):
        acc.add(update, weight, index=index)
    assert acc.count == 1
    np.testing.assert_array_equal(acc.result()["w"], np.array([2.0, 4.0], np.float32))


def test_mean_accumulator_without_updates_raises() -> None:
    with pytest.raises(AggregationError, match="nothing to aggregate"):
        MeanAccumulator({"w": np.zeros(1, np.float32)}).result()


def test_aggregator_registry_is_loud() -> None:
    assert "mean" in list_aggregators()
    assert get_aggregator("mean").name == "mean"
    with pytest.raises(ConfigError, match=r"aggregator.*'nope'.*mean"):
        get_aggregator("nope")


def test_group_models_commit_a_round_and_a_dropped_round_leaves_them_unchanged() -> None:
    # Prepare
    models = GroupModels(get_aggregator("mean"), lambda arch: {"w": np.zeros(2, np.float32)})
    first, second = GroupRound(), GroupRound()

    # Execute: a committed round, then one whose round state is dropped
    models.fold(first, "a", {"w": np.array([2.0, 2.0], np.float32)}, 1.0)
    models.fold(first, "a", {"w": np.array([4.0, 8.0], np.float32)}, 1.0)
    sizes = models.commit(first).sizes
    models.fold(second, "a", {"w": np.array([100.0, 100.0], np.float32)}, 1.0)
    del second

    # Assert
    assert sizes == {"a": 2}
    np.testing.assert_array_equal(models.get("a")["w"], np.array([3.0, 5.0], np.float32))
    assert models.commit(GroupRound()).sizes == {}


# ----------------------------------------------------------------------- checkpoints
def test_state_file_round_trips_nested_values(tmp_path: Path) -> None:
    # Prepare
    state = {
        "round": 3,
        "name": "fedavg",
        "none": None,
        "ratio": 0.25,
        "models": {"cnn-1": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}},
        "bank": [np.array([1, 2], np.int64), {"x": np.zeros((0, 4), np.float16)}],
    }
    path = tmp_path / "c" / "checkpoint.npz"

    # Execute
    size = save_state(path, state)
    back = load_state(path)

    # Assert
    assert size == path.stat().st_size
    assert back["round"] == 3 and back["name"] == "fedavg" and back["none"] is None
    np.testing.assert_array_equal(back["models"]["cnn-1"]["w"], state["models"]["cnn-1"]["w"])
    assert back["models"]["cnn-1"]["w"].dtype == np.float32
    np.testing.assert_array_equal(back["bank"][0], np.array([1, 2]))
    assert back["bank"][1]["x"].shape == (0, 4) and back["bank"][1]["x"].dtype == np.float16
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.npz"]  # no temp file left


def test_state_file_refuses_garbage_and_pickles(tmp_path: Path) -> None:
    # Prepare
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a checkpoint")

    # Execute / Assert
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_state(bad)
    with pytest.raises(CheckpointError, match="no state file"):
        load_state(tmp_path / "missing.npz")
    with pytest.raises(TypeError, match="object"):
        save_state(tmp_path / "o.npz", {"x": np.array([object()])})


# ------------------------------------------------------------------------ node state
def test_node_state_survives_a_restart_through_state_dir(tmp_path: Path) -> None:
    # Prepare: a node saves a model and a config after round 4
    records = RecordDict()
    state = NodeState.open(records, state_dir=str(tmp_path), federation="fed-1", owner="p0")
    state.put("model", wire.numpy_to_record({"w": np.array([1.0, 2.0], np.float32)}))
    state.put("meta", ConfigRecord({"arch": "cnn-2"}))
    state.save(4)

    # Execute: the SuperNode restarts (context.state comes up empty)
    fresh = RecordDict()
    again = NodeState.open(fresh, state_dir=str(tmp_path), federation="fed-1", owner="p0")

    # Assert
    assert again.restored_from_disk and again.saved_round == 4
    model = again.arrays("model")
    assert model is not None
    np.testing.assert_array_equal(model["w"].numpy(), np.array([1.0, 2.0], np.float32))
    meta = again.config("meta")
    assert meta is not None and meta["arch"] == "cnn-2"
    assert (tmp_path / "fed-1" / "node-state.pb").is_file()


def test_node_state_of_another_node_or_federation_is_not_loaded(tmp_path: Path) -> None:
    # Prepare
    state = NodeState.open(RecordDict(), state_dir=str(tmp_path), federation="fed-1", owner="p0")
    state.put("meta", ConfigRecord({"arch": "cnn-2"}))
    state.save(1)

    # Execute
    other_node = NodeState.open(
        RecordDict(), state_dir=str(tmp_path), federation="fed-1", owner="p1"
    )
    other_run = NodeState.open(
        RecordDict(), state_dir=str(tmp_path), federation="fed-2", owner="p0"
    )

    # Assert
    assert not other_node.restored_from_disk and other_node.config("meta") is None
    assert not other_run.restored_from_disk and other_run.config("meta") is None


@pytest.mark.parametrize("value", ["../escape", "a/b", "", ".hidden", "x" * 200])
def test_federation_id_must_be_a_safe_folder_name(value: str) -> None:
    with pytest.raises(ConfigError, match="federation id"):
        check_federation_id(value)


# ---------------------------------------------------------------------------- retries
class _Status:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeRpcError(Exception):
    """Stands in for grpc.RpcError: ``code()`` returns a status with a ``name``."""

    def __init__(self, code: str) -> None:
        super().__init__(f"status {code}")
        self._code = code

    def code(self) -> _Status:
        return _Status(self._code)


def test_real_grpc_errors_are_classified() -> None:
    import grpc

    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

    class Denied(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.PERMISSION_DENIED

    assert is_transient(Unavailable())
    assert not is_transient(Denied())
    assert not is_transient(ValueError("x"))


def test_call_with_retries_backs_off_then_succeeds() -> None:
    # Prepare: two transient failures, then success
    outcomes: list[Exception | str] = [
        FakeRpcError("UNAVAILABLE"),
        FakeRpcError("DEADLINE_EXCEEDED"),
        "ok",
    ]
    waits: list[float] = []

    def call() -> str:
        item = outcomes.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    # Execute
    got = call_with_retries(call, what="pulling", retry_timeout=60.0, sleep=waits.append)

    # Assert
    assert got == "ok"
    assert waits == [0.5, 1.0]


def test_call_with_retries_does_not_retry_other_errors() -> None:
    calls = []

    def call() -> None:
        calls.append(1)
        raise FakeRpcError("PERMISSION_DENIED")

    with pytest.raises(FakeRpcError):
        call_with_retries(call, what="pushing", retry_timeout=60.0, sleep=lambda _: None)
    assert len(calls) == 1


def test_call_with_retries_gives_up_naming_the_cause() -> None:
    def call() -> None:
        raise FakeRpcError("UNAVAILABLE")

    with pytest.raises(SuperLinkUnavailableError, match=r"pushing.*superlink-retry-timeout"):
        call_with_retries(call, what="pushing", retry_timeout=0.0, sleep=lambda _: None)
