"""State files read back are checked before use (issue 23, "files trusted once decoded").

A server checkpoint that fails a check is refused with an error naming the file, the
field and the fix; a node's own state or data-cache entry that fails is discarded and
rebuilt with a warning; ``predict`` refuses a bad ensemble artifact with a clear error
and no traceback. Sizes are bounded before anything is read or allocated.
"""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from strategies.core.aggregators import get_aggregator
from strategies.core.groups import GroupModels
from strategies.core.strategy import HeteroStrategy
from tessera import wire
from tessera.checkpoint import (
    CheckpointError,
    StateTree,
    checked_array,
    checked_arrays,
    load_state,
    save_state,
    state_to_bytes,
)
from tessera.config import ConfigError
from tessera.data import DatasetSpec, NodeSplits, load_bundle, node_partition_data
from tessera.data.cache_entry import cache_file, entry_problem, read_entry
from tessera.data.cache_keys import partition_key
from tessera.data.cache_memory import MemoryCache, clear_memory_cache
from tessera.data.spec import PartitionConfig
from tessera.node_state import FILE_NAME, NodeState, model_problem, record_problem
from tessera.state_checks import (
    StateFileError,
    arrays_problem,
    npy_bytes_problem,
    positive_float,
    read_npz,
)
from tests.conftest import TINY_DIGITS, make_grid

RunConfigFactory = Callable[..., dict[str, Any]]


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def lying_npy(shape: tuple[int, ...], data: bytes) -> bytes:
    """An ``.npy`` whose header declares float32 ``shape`` but holds only ``data``."""
    buffer = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + data


def zip_of(members: Mapping[str, bytes], *, compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


# =========================================================================== npz
def test_read_npz_reads_what_np_savez_wrote() -> None:
    # Prepare
    buffer = io.BytesIO()
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "k": np.asarray("key")}
    np.savez(buffer, **arrays)  # type: ignore[arg-type]

    # Execute
    back = read_npz(buffer.getvalue())

    # Assert
    assert sorted(back) == ["k", "w"]
    np.testing.assert_array_equal(back["w"], arrays["w"])
    assert back["w"].flags.writeable and str(back["k"]) == "key"


def test_a_small_file_declaring_a_huge_compressed_entry_is_refused_before_reading() -> None:
    # Prepare: 40 MB of zeros deflate to about 40 KB
    big = npy_bytes(np.zeros(10_000_000, np.float32))
    data = zip_of({"a0.npy": big}, compression=zipfile.ZIP_DEFLATED)
    assert len(data) < 100_000

    # Execute / Assert: 40 000 128 declared bytes > the file's own size
    with pytest.raises(StateFileError, match=rf"declare {len(big)} bytes once read.*{len(data)}"):
        read_npz(data)


def test_an_npy_header_declaring_more_than_its_member_holds_is_refused() -> None:
    # Prepare: a header claiming 10**9 float32 (4 GB) followed by 8 bytes
    data = zip_of({"a0.npy": lying_npy((10**9,), b"\0" * 8)})

    # Execute / Assert
    with pytest.raises(StateFileError, match=r"'a0' declares shape \(1000000000,\).*4000000000"):
        read_npz(data)


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ({"a0.npy": npy_bytes(np.array([object()], dtype=object))}, "dtype object"),
        ({"a0.txt": b"hello"}, "not a single .npy array"),
        ({"a0.npy": b"not an npy"}, "not a readable .npy array"),
    ],
)
def test_objects_foreign_members_and_garbage_are_refused(
    members: dict[str, bytes], match: str
) -> None:
    with pytest.raises(StateFileError, match=match):
        read_npz(zip_of(members))


def test_npy_bytes_problem_compares_header_with_the_declared_array() -> None:
    good = npy_bytes(np.zeros((2, 3), np.float32))
    assert npy_bytes_problem(good, shape=(2, 3), dtype="float32") is None
    assert "declared as float32 (3, 2)" in str(
        npy_bytes_problem(good, shape=(3, 2), dtype="float32")
    )
    assert "declares 4000000000 bytes of data but 8 follow" in str(
        npy_bytes_problem(lying_npy((10**9,), b"\0" * 8), shape=(10**9,), dtype="float32")
    )


# ================================================================ checks (pure)
def test_arrays_problem_names_the_first_mismatch() -> None:
    # Prepare
    expected = {"w": np.zeros((2, 3), np.float32), "b": torch.zeros(3)}
    good = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}

    # Execute / Assert
    assert arrays_problem(good, expected, where="g") is None
    assert "missing ['b']" in str(arrays_problem({"w": good["w"]}, expected, where="g"))
    wrong = arrays_problem({**good, "w": np.ones((3, 2), np.float32)}, expected, where="g")
    assert str(wrong) == "field 'g.w' is float32 (3, 2) but the model has float32 (2, 3)"
    dtype = arrays_problem({**good, "b": np.ones(3, np.float64)}, expected, where="g")
    assert str(dtype) == "field 'g.b' is float64 (3,) but the model has float32 (3,)"
    nan = arrays_problem({**good, "b": np.array([0, np.nan, 0], np.float32)}, expected, where="g")
    assert str(nan) == "field 'g.b' holds NaN or infinite values"
    assert "expected an array" in str(arrays_problem({**good, "b": [1, 2, 3]}, expected))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (0.0, "0.0"),
        (-1.0, "-1.0"),
        (1e30, "1e\\+30"),
        ("2", "str"),
        (True, "bool"),
    ],
)
def test_positive_float_refuses_what_would_switch_a_bound_off(value: Any, match: str) -> None:
    with pytest.raises(StateFileError, match=match):
        positive_float(value, where="m", maximum=1e6)


def test_positive_float_accepts_a_finite_positive_number() -> None:
    assert positive_float(2, where="m", maximum=1e6) == 2.0
    assert positive_float(np.float32(0.5), where="m") == 0.5


# ================================================================= checkpoints
def saved_tree(tmp_path: Path, state: Mapping[str, Any]) -> StateTree:
    """Write ``state`` as a checkpoint and read it back (a tree that knows its file)."""
    path = tmp_path / "checkpoint.npz"
    save_state(path, state)
    return load_state(path)


def two_by_three(arch: str) -> dict[str, np.ndarray]:
    """Seeded initial weights of the only architecture of these tests."""
    if arch != "cnn":
        raise ValueError(f"Unknown model {arch}")
    return {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}


GOOD_GROUP = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}


@pytest.mark.parametrize(
    ("group_models", "field", "problem"),
    [
        (
            {"arrays": {"cnn": {**GOOD_GROUP, "w": np.ones((3, 2), np.float32)}}},
            "group_models.arrays.cnn.w",
            r"float32 \(3, 2\) but the model has float32 \(2, 3\)",
        ),
        (
            {"arrays": {"cnn": {**GOOD_GROUP, "b": np.array([1, np.nan, 1], np.float32)}}},
            "group_models.arrays.cnn.b",
            "NaN or infinite",
        ),
        (
            {"arrays": {"cnn": {"w": GOOD_GROUP["w"]}}},
            "group_models.arrays.cnn",
            r"missing \['b'\]",
        ),
        (
            {"arrays": {"vgg99": GOOD_GROUP}},
            "group_models.arrays.vgg99",
            "cannot build",
        ),
        (
            {"arrays": {"cnn": GOOD_GROUP}, "medians": {"cnn": {"parameters": 1e30}}},
            "group_models.medians.cnn.parameters",
            r"1e\+30",
        ),
        (
            {"arrays": {"cnn": GOOD_GROUP}, "medians": {"cnn": {"parameters": float("nan")}}},
            "group_models.medians.cnn.parameters",
            "nan",
        ),
        (
            {"arrays": {"cnn": GOOD_GROUP}, "medians": {"cnn": {"parameters": 0.0}}},
            "group_models.medians.cnn.parameters",
            "finite number > 0",
        ),
        (
            {"arrays": {"cnn": GOOD_GROUP}, "medians": {"cnn": {"weights": 1.0}}},
            "group_models.medians.cnn.weights",
            "not a scale key",
        ),
        (
            {"arrays": {"cnn": GOOD_GROUP}, "medians": {"cnn": {"parameters@0": 1.0}}},
            "group_models.medians.cnn.parameters@0",
            "kind@<size>",
        ),
        (
            {"arrays": {"cnn": GOOD_GROUP}, "medians": {"cnn": {"parameters@99999999": 1.0}}},
            "group_models.medians.cnn.parameters@99999999",
            "at most",
        ),
        (
            {"arrays": {"cnn": GOOD_GROUP}, "medians": {"vgg": {"parameters": 1.0}}},
            "group_models.medians.vgg",
            "has no arrays",
        ),
        (
            {"arrays": [1, 2]},
            "group_models.arrays",
            "expected a mapping",
        ),
    ],
)
def test_a_bad_group_models_checkpoint_is_refused_naming_file_field_and_fix(
    tmp_path: Path, group_models: dict[str, Any], field: str, problem: str
) -> None:
    # Prepare
    tree = saved_tree(tmp_path, {"group_models": group_models})
    models = GroupModels(get_aggregator("mean"), two_by_three)

    # Execute / Assert
    with pytest.raises(CheckpointError) as info:
        models.load_state_dict(tree["group_models"])
    message = str(info.value)
    assert str(tmp_path / "checkpoint.npz") in message
    assert f"field '{field}'" in message
    assert re.search(problem, message), message
    assert "start afresh without run-config 'resume'" in message
    assert models.arrays == {} and models.reports == {}  # nothing restored


def test_a_good_group_models_checkpoint_is_restored_with_its_medians(tmp_path: Path) -> None:
    # Prepare: the group's norm is sqrt(6 + 3) = 3, so medians up to 3e6 are plausible
    group_models = {"arrays": {"cnn": GOOD_GROUP}, "medians": {"cnn": {"parameters": 2.5e6}}}
    tree = saved_tree(tmp_path, {"group_models": group_models})
    models = GroupModels(get_aggregator("mean"), two_by_three)

    # Execute
    models.load_state_dict(tree["group_models"])

    # Assert
    np.testing.assert_array_equal(models.arrays["cnn"]["w"], GOOD_GROUP["w"])
    assert models.reports["cnn"].medians == {"parameters": 2.5e6}
    too_far = saved_tree(
        tmp_path, {"group_models": {**group_models, "medians": {"cnn": {"parameters": 3.1e6}}}}
    )
    with pytest.raises(CheckpointError, match=r"<= 3e\+06"):
        models.load_state_dict(too_far["group_models"])


@pytest.mark.parametrize(
    ("document", "match"),
    [
        ({"format": 1, "tree": {"x": {"__array__": 3}}}, "field 'x' refers to array 3"),
        ({"format": 1, "tree": {"x": {"__array__": "a0"}}}, "refers to array 'a0'"),
        ({"format": 1, "tree": [1]}, "does not hold a mapping"),
        ({"format": 2, "tree": {}}, "has format 2"),
    ],
)
def test_a_malformed_structure_is_refused_with_the_file_named(
    tmp_path: Path, document: dict[str, Any], match: str
) -> None:
    # Prepare
    path = tmp_path / "checkpoint.npz"
    tree = np.frombuffer(json.dumps(document).encode(), dtype=np.uint8)
    path.write_bytes(zip_of({"__tree__.npy": npy_bytes(tree)}))

    # Execute / Assert
    with pytest.raises(CheckpointError, match=match) as info:
        load_state(path)
    assert str(path) in str(info.value)


def test_a_checkpoint_with_an_inflated_entry_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # Prepare: a real checkpoint whose array entry is replaced by 40 MB deflated
    good = state_to_bytes({"round": 1, "w": np.zeros(2, np.float32)})
    with zipfile.ZipFile(io.BytesIO(good)) as archive:
        tree = archive.read("__tree__.npy")
    path = tmp_path / "checkpoint.npz"
    path.write_bytes(
        zip_of(
            {"__tree__.npy": tree, "a0.npy": npy_bytes(np.zeros(10_000_000, np.float32))},
            compression=zipfile.ZIP_DEFLATED,
        )
    )

    # Execute / Assert
    with pytest.raises(CheckpointError, match=r"declare \d+ bytes once read") as info:
        load_state(path)
    assert str(path) in str(info.value) and "resume" in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_scheme_entries_are_checked_by_the_shared_helpers(tmp_path: Path) -> None:
    # Prepare: a scheme's own entries (a generator's weights, class targets)
    tree = saved_tree(
        tmp_path,
        {
            "targets": {
                "logits": np.ones((3, 10), np.float32),
                "ids": np.arange(3),
                "bad": np.array([np.inf], np.float32),
            },
            "cvae": {"w": np.ones((2, 2), np.float32)},
        },
    )
    targets = tree["targets"]

    # Execute / Assert
    assert checked_array(targets, "logits", shape=(None, 10)).shape == (3, 10)
    assert checked_array(targets, "ids", shape=(3,), kinds="iu").dtype == np.int64
    assert set(checked_arrays(tree, "cvae", {"w": torch.zeros(2, 2)})) == {"w"}
    with pytest.raises(
        CheckpointError,
        match=r"field 'targets\.logits' is float32 \(3, 10\); expected shape \('\*', 9\)",
    ):
        checked_array(targets, "logits", shape=(None, 9))
    with pytest.raises(CheckpointError, match=r"field 'targets\.bad' holds NaN"):
        checked_array(targets, "bad")
    with pytest.raises(CheckpointError, match=r"field 'targets\.gone' is NoneType"):
        checked_array(targets, "gone")
    with pytest.raises(CheckpointError, match=r"field 'cvae\.w' is float32 \(2, 2\) but the model"):
        checked_arrays(tree, "cvae", {"w": torch.zeros(2, 3)})
    with pytest.raises(CheckpointError, match=str(tmp_path / "checkpoint.npz")):
        checked_arrays(tree, "missing", {"w": torch.zeros(2, 3)})


# -------------------------------------------------- through the ServerApp's build
@pytest.fixture
def one_round_run(
    run_config: RunConfigFactory, digits_bundle: Any, fast_clients: None, tmp_path: Path
) -> dict[str, Any]:
    """A one-round fedavg-groups run with a checkpoint; return its base run-config."""
    from server_app.app import build_server

    base = {**TINY_DIGITS, "strategy": "fedavg-groups", "output-dir": str(tmp_path)}
    config = run_config({**base, "run-name": "r", "num-server-rounds": 1})
    built = build_server(config, bundle=digits_bundle)
    built.runner.start(make_grid(config, 3), num_rounds=1, timeout=60.0)
    return base


def tampered(tree: Mapping[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(json.dumps(tree, default=lambda a: a.tolist()))
    state["group_models"] = {
        "arrays": {
            arch: {k: np.array(v, dtype=np.float32) for k, v in group.items()}
            for arch, group in tree["group_models"]["arrays"].items()
        },
        "medians": state["group_models"]["medians"],
    }
    change(state)
    return state


def first_group(state: dict[str, Any]) -> dict[str, Any]:
    arrays: dict[str, dict[str, Any]] = state["group_models"]["arrays"]
    return arrays[sorted(arrays)[0]]


def _wrong_shape(state: dict[str, Any]) -> None:
    group = first_group(state)
    key = sorted(group)[0]
    group[key] = np.zeros((*group[key].shape, 2), np.float32)


def _nan_weights(state: dict[str, Any]) -> None:
    group = first_group(state)
    key = sorted(group)[0]
    group[key] = np.full_like(group[key], np.nan)


def _huge_median(state: dict[str, Any]) -> None:
    for medians in state["group_models"]["medians"].values():
        medians["parameters"] = 1e30


def _no_run_config(state: dict[str, Any]) -> None:
    del state["run_config"]


def _partial_run_config(state: dict[str, Any]) -> None:
    del state["run_config"]["seed"]


def _node_field(state: dict[str, Any]) -> None:
    state["nodes"][0]["num_train"] = "many"


def _streak(state: dict[str, Any]) -> None:
    state["failed_streak"] = [1]


def _federation(state: dict[str, Any]) -> None:
    state["federation"] = "../../etc"


TAMPERINGS = [
    (_wrong_shape, r"group_models\.arrays\.[^.]+\.\S+' is float32 \(.*\) but the model has"),
    (_nan_weights, r"group_models\.arrays\.[^.]+\.\S+' holds NaN or infinite values"),
    (_huge_median, r"group_models\.medians\.[^.]+\.parameters' is 1e\+30"),
    (_no_run_config, r"field 'run_config' is missing"),
    (_partial_run_config, r"field 'run_config' lacks .*\['seed'\]"),
    (_node_field, r"field 'nodes\[0\]\.num_train' is 'many' \(str\); expected an integer"),
    (_streak, r"field 'failed_streak' is \[1\] \(list\)"),
    (_federation, r"field 'federation' is '\.\./\.\./etc'"),
]


def test_every_reviewed_checkpoint_problem_is_refused_when_resuming(
    run_config: RunConfigFactory, digits_bundle: Any, one_round_run: dict[str, Any], tmp_path: Path
) -> None:
    from server_app.app import build_server

    # Prepare
    original = load_state(tmp_path / "r" / "checkpoint.npz")
    assert original["group_models"]["medians"], "the run should have recorded medians"

    for change, match in TAMPERINGS:
        folder = tmp_path / change.__name__
        shutil.copytree(tmp_path / "r", folder)
        save_state(folder / "checkpoint.npz", tampered(original, change))
        config = run_config({**one_round_run, "num-server-rounds": 2, "resume": str(folder)})

        # Execute / Assert: a ConfigError (CheckpointError) naming file, field and fix
        with pytest.raises(ConfigError) as info:
            build_server(config, bundle=digits_bundle)
        message = str(info.value)
        assert isinstance(info.value, CheckpointError), (change.__name__, message)
        assert str(folder / "checkpoint.npz") in message, message
        assert re.search(match, message), (change.__name__, message)
        assert "start afresh without run-config 'resume'" in message

    # and the untouched checkpoint still resumes
    intact = tmp_path / "intact"
    shutil.copytree(tmp_path / "r", intact)
    save_state(intact / "checkpoint.npz", tampered(original, lambda state: None))
    server = build_server(
        run_config({**one_round_run, "num-server-rounds": 2, "resume": str(intact)}),
        bundle=digits_bundle,
    )
    assert isinstance(server.runner, HeteroStrategy) and server.runner.completed_round == 1


# ================================================================== node state
def _open(tmp_path: Path, federation: str, owner: str = "p0") -> NodeState:
    return NodeState.open(RecordDict(), state_dir=str(tmp_path), federation=federation, owner=owner)


def test_node_state_records_its_federation_and_a_copied_file_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: fed-a's file copied into fed-b's folder (same owner)
    state = _open(tmp_path, "fed-a")
    state.put("meta", ConfigRecord({"arch": "cnn-2"}))
    state.save(3)
    (tmp_path / "fed-b").mkdir()
    shutil.copy(tmp_path / "fed-a" / FILE_NAME, tmp_path / "fed-b" / FILE_NAME)

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        copied = _open(tmp_path, "fed-b")
        own = _open(tmp_path, "fed-a")

    # Assert
    assert not copied.restored_from_disk and copied.config("meta") is None
    assert any("federation 'fed-a' but this is 'fed-b'" in r.getMessage() for r in caplog.records)
    assert own.restored_from_disk and own.saved_round == 3
    meta = own.config("tessera.state-meta")
    assert meta is not None and meta["federation"] == "fed-a"


def test_a_node_state_file_without_a_federation_id_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a file as an older version wrote it (no federation in its metadata)
    old = NodeState(RecordDict(), path=tmp_path / "fed-a" / FILE_NAME, owner="p0")
    old.put("meta", ConfigRecord({"arch": "cnn-2"}))
    old.save(2)

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        state = _open(tmp_path, "fed-a")

    # Assert
    assert not state.restored_from_disk and state.config("meta") is None
    assert any("federation None" in r.getMessage() for r in caplog.records)


def test_a_node_state_array_whose_bytes_lie_is_ignored_before_decoding(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: an array declaring 10**9 float32 in 8 bytes
    state = _open(tmp_path, "fed-a")
    liar = Array(
        dtype="float32", shape=(10**9,), stype="numpy.ndarray", data=lying_npy((10**9,), b"\0" * 8)
    )
    state.put("tessera.model", ArrayRecord({"w": liar}))
    state.save(1)

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        again = _open(tmp_path, "fed-a")

    # Assert
    assert not again.restored_from_disk and again.arrays("tessera.model") is None
    assert any("is malformed" in r.getMessage() for r in caplog.records)
    assert record_problem(ArrayRecord({"w": liar})) is not None


def personal_model() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(2, 3), "b": torch.zeros(3)}


@pytest.mark.parametrize(
    ("stored", "problem"),
    [
        ({"w": torch.full((2, 3), float("nan")), "b": torch.zeros(3)}, "'w' holds NaN"),
        ({"w": torch.ones(3, 2), "b": torch.zeros(3)}, r"'w' is float32 \(3, 2\)"),
        ({"w": torch.ones(2, 3)}, r"missing \['b'\]"),
        ({"w": torch.ones(2, 3, dtype=torch.float64), "b": torch.zeros(3)}, "'w' is float64"),
    ],
)
def test_a_personal_model_that_no_longer_fits_is_discarded_with_a_warning(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    stored: dict[str, torch.Tensor],
    problem: str,
) -> None:
    # Prepare: the bad model was saved to disk and the node restarted
    state = _open(tmp_path, "fed-a")
    state.put("tessera.model", ArrayRecord(stored))
    state.put("tessera.model-meta", ConfigRecord({"arch": "cnn-2", "rounds": 4}))
    state.save(4)
    again = _open(tmp_path, "fed-a")
    assert again.restored_from_disk
    like = personal_model()

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        record = again.fitting_arrays("tessera.model", like=like, forget=("tessera.model-meta",))

    # Assert: forgotten with its metadata, said so; the next round starts afresh
    assert record is None
    assert again.arrays("tessera.model") is None and again.config("tessera.model-meta") is None
    assert re.search(problem, str(model_problem(ArrayRecord(stored), like)))
    assert any("discarding it and starting afresh" in r.getMessage() for r in caplog.records)


def test_a_fitting_personal_model_is_returned_as_stored() -> None:
    state = NodeState(RecordDict())
    state.put("tessera.model", ArrayRecord(personal_model()))
    record = state.fitting_arrays("tessera.model", like=personal_model())
    assert record is not None
    np.testing.assert_array_equal(record["w"].numpy(), np.ones((2, 3), np.float32))
    assert model_problem(record, wire.exchanged_state(personal_model())) is None


# ================================================================== data cache
PARTITION = PartitionConfig("dirichlet", alpha=0.5, seed=3)
PARTITION_ARGS: dict[str, Any] = {
    "partition_id": 1,
    "num_partitions": 4,
    "partition": PARTITION,
    "pool_fraction": 0.1,
    "test_fraction": 0.2,
}


@pytest.fixture
def fresh_memory() -> Iterator[None]:
    clear_memory_cache()
    yield
    clear_memory_cache()


class CountingLoader:
    """``load_bundle`` that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, spec: DatasetSpec) -> Any:
        self.calls += 1
        return load_bundle(spec)


def entry_path(cache_dir: Path) -> Path:
    key = partition_key(DatasetSpec("digits"), **PARTITION_ARGS)
    assert key is not None
    return cache_file(cache_dir, key)


def rewrite(path: Path, change: Callable[[dict[str, np.ndarray]], None]) -> None:
    with np.load(path) as npz:
        arrays = dict(npz)
    change(arrays)
    with path.open("wb") as handle:
        np.savez(handle, **arrays)


def _nan_sample(arrays: dict[str, np.ndarray]) -> None:
    arrays["x_train"][3, 0, 0, 0] = np.nan


def _flattened(arrays: dict[str, np.ndarray]) -> None:
    """Self-consistent, wrong: every sample and the declared shape flattened to (1, 64)."""
    arrays["x_train"] = arrays["x_train"].reshape(len(arrays["x_train"]), 1, 64)
    arrays["x_test"] = arrays["x_test"].reshape(len(arrays["x_test"]), 1, 64)
    arrays["input_shape"] = np.array([1, 64], np.int64)


@pytest.mark.parametrize(
    ("change", "logged"),
    [(_nan_sample, "NaN or infinite"), (_flattened, r"shape \(1, 64\) but the federation")],
)
def test_a_bad_cache_entry_is_discarded_and_rebuilt_with_a_warning(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fresh_memory: None,
    change: Callable[[dict[str, np.ndarray]], None],
    logged: str,
) -> None:
    # Prepare
    load = CountingLoader()
    good = node_partition_data("digits", cache_dir=tmp_path, load=load, **PARTITION_ARGS)
    rewrite(entry_path(tmp_path), change)
    clear_memory_cache()  # the next message is a new process

    # Execute
    with caplog.at_level(logging.WARNING, logger="tessera.data.cache"):
        rebuilt = node_partition_data(
            "digits", cache_dir=tmp_path, load=load, expect_shape=(1, 8, 8), **PARTITION_ARGS
        )

    # Assert: rebuilt once, said why, and the rewritten entry is good again
    assert load.calls == 2
    assert any(re.search(logged, r.getMessage()) for r in caplog.records)
    np.testing.assert_array_equal(rebuilt.train.x, good.train.x)
    key = partition_key(DatasetSpec("digits"), **PARTITION_ARGS)
    assert key is not None
    again = read_entry(entry_path(tmp_path), key, expect_shape=(1, 8, 8))
    assert again is not None and again.input_shape == (1, 8, 8)


def test_a_memory_entry_of_another_shape_is_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fresh_memory: None
) -> None:
    # Prepare: the process holds a self-consistent entry of shape (64,)
    load = CountingLoader()
    memory = MemoryCache(max_entries=4, max_bytes=1 << 26)
    good = node_partition_data("digits", load=load, memory=memory, **PARTITION_ARGS)
    key = partition_key(DatasetSpec("digits"), **PARTITION_ARGS)
    assert key is not None
    flat = NodeSplits(
        train=type(good.train)(x=good.train.x.reshape(len(good.train), 64), y=good.train.y),
        test=type(good.test)(x=good.test.x.reshape(len(good.test), 64), y=good.test.y),
        num_classes=10,
        input_shape=(64,),
    )
    memory.put(key, flat)

    # Execute
    with caplog.at_level(logging.WARNING, logger="tessera.data.cache"):
        splits = node_partition_data(
            "digits", load=load, memory=memory, expect_shape=(1, 8, 8), **PARTITION_ARGS
        )

    # Assert: the node's slice is cut again from the federation's partitioning (kept
    # by the process, so the dataset is not loaded again)
    assert splits.input_shape == (1, 8, 8) and load.calls == 1
    np.testing.assert_array_equal(splits.train.x, good.train.x)
    assert memory.get(key) is splits
    assert any("held in memory is unusable" in r.getMessage() for r in caplog.records)


def test_entry_problem_checks_shape_classes_and_finiteness() -> None:
    # Prepare
    x = np.zeros((4, 1, 2, 2), np.float32)
    y = np.array([0, 1, 2, 1], np.int64)
    splits = NodeSplits(
        train=type_dataset(x, y),
        test=type_dataset(x[:1], y[:1]),
        num_classes=3,
        input_shape=(1, 2, 2),
    )

    # Execute / Assert
    assert entry_problem(splits, expect_shape=(1, 2, 2), expect_classes=3) is None
    assert entry_problem(splits, expect_classes=10) is None  # a node may hold fewer classes
    assert "3 classes but the federation has 2" in str(entry_problem(splits, expect_classes=2))
    x[2, 0, 1, 1] = np.inf
    assert "train samples hold NaN" in str(entry_problem(splits))
    assert entry_problem(splits, finite=False) is None


def type_dataset(x: np.ndarray, y: np.ndarray) -> Any:
    from tessera.data import ArrayDataset

    return ArrayDataset(x=x, y=y)


def test_an_inflated_cache_entry_is_discarded_before_it_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    path = tmp_path / "node-data-x.npz"
    big = npy_bytes(np.zeros(10_000_000, np.float32))
    path.write_bytes(zip_of({"x_train.npy": big}, compression=zipfile.ZIP_DEFLATED))

    # Execute
    with caplog.at_level(logging.WARNING, logger="tessera.data.cache"):
        entry = read_entry(path, "key")

    # Assert
    assert entry is None and not path.exists()
    assert any("declare" in r.getMessage() for r in caplog.records)


# ============================================================ ensemble artifact
ARCHS = ("cnn-1", "mlp-s")


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    """A small, valid two-model artifact for 8x8 one-channel images and 10 classes."""
    from models import get_model
    from strategies.ensemble.artifact import save_ensemble

    weights = []
    for arch in ARCHS:
        torch.manual_seed(0)
        model = get_model(arch, input_shape=(1, 8, 8), num_classes=10, norm="group")
        weights.append({k: v.numpy() for k, v in wire.exchanged_state(model.state_dict()).items()})
    return save_ensemble(
        tmp_path / "ensemble.npz",
        archs=list(ARCHS),
        weights=weights,
        alpha=np.full((2, 10), 0.5),
        input_shape=(1, 8, 8),
        class_names=[str(c) for c in range(10)],
        norm="group",
        extra={"optimizer": "uniform", "model_kwargs": {"flat_input": "signal"}},
    )


def edited(
    artifact: Path,
    *,
    manifest: Callable[[dict[str, Any]], None] | None = None,
    arrays: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> Path:
    with np.load(artifact) as npz:
        entries = dict(npz)
    if manifest is not None:
        document = json.loads(str(entries["manifest"]))
        manifest(document)
        entries["manifest"] = np.array(json.dumps(document))
    if arrays is not None:
        arrays(entries)
    path = artifact.with_name("edited.npz")
    np.savez(path, **entries)
    return path


def truncated(artifact: Path) -> Path:
    path = artifact.with_name("truncated.npz")
    path.write_bytes(artifact.read_bytes()[: artifact.stat().st_size // 2])
    return path


BAD_ARTIFACTS: list[tuple[str, Callable[[Path], Path], str]] = [
    ("truncated", truncated, "not a readable .npz"),
    (
        "no archs",
        lambda a: edited(a, manifest=lambda m: m.pop("archs")),
        "'manifest.archs' is missing",
    ),
    (
        "archs not a list",
        lambda a: edited(a, manifest=lambda m: m.update(archs="cnn-1")),
        "'manifest.archs' is 'cnn-1' \\(str\\); expected a list",
    ),
    (
        "unknown arch",
        lambda a: edited(a, manifest=lambda m: m.update(archs=["cnn-1", "nope-9"])),
        "'manifest.archs\\[1\\]' names architecture 'nope-9'",
    ),
    (
        "input shape too large",
        lambda a: edited(a, manifest=lambda m: m.update(input_shape=[3, 4096, 4096])),
        "'manifest.input_shape' is \\[3, 4096, 4096\\]",
    ),
    (
        "negative input shape",
        lambda a: edited(a, manifest=lambda m: m.update(input_shape=[1, -8, 8])),
        "'manifest.input_shape\\[1\\]' is -8",
    ),
    (
        "class names and count disagree",
        lambda a: edited(a, manifest=lambda m: m.update(num_classes=3)),
        "names 10 classes but num_classes is 3",
    ),
    (
        "unknown model kwarg",
        lambda a: edited(a, manifest=lambda m: m.update(model_kwargs={"depth": 99})),
        "unknown keys \\['depth'\\]",
    ),
    (
        "manifest not JSON",
        lambda a: edited(a, arrays=lambda e: e.update(manifest=np.array("{not json"))),
        "'manifest' is not JSON",
    ),
    (
        "alpha NaN",
        lambda a: edited(a, arrays=lambda e: e.update(alpha=np.full((2, 10), np.nan))),
        "'alpha' is float64 \\(2, 10\\); expected finite floats",
    ),
    (
        "weights of the wrong shape",
        lambda a: edited(a, arrays=lambda e: e.update({"m1/head.bias": np.zeros(3, np.float32)})),
        "'m1.head.bias' is float32 \\(3,\\) but the model has float32 \\(10,\\)",
    ),
    (
        "NaN weights",
        lambda a: edited(
            a, arrays=lambda e: e.update({"m1/head.bias": np.full(10, np.nan, np.float32)})
        ),
        "'m1.head.bias' holds NaN",
    ),
    (
        "an entry of a model that is not named",
        lambda a: edited(a, arrays=lambda e: e.update({"m7/x": np.zeros(1, np.float32)})),
        "'m7/x' is not an entry of the 2 model",
    ),
]


@pytest.mark.parametrize(
    ("make", "match"), [(m, r) for _, m, r in BAD_ARTIFACTS], ids=[n for n, _, _ in BAD_ARTIFACTS]
)
def test_a_bad_artifact_is_refused_with_a_clear_error(
    artifact: Path, make: Callable[[Path], Path], match: str
) -> None:
    from strategies.ensemble.artifact import ArtifactError, load_ensemble

    # Prepare
    bad = make(artifact)

    # Execute / Assert
    with pytest.raises(ArtifactError, match=match) as info:
        load_ensemble(bad)
    assert str(bad) in str(info.value)


def test_the_valid_artifact_loads_and_predicts(artifact: Path) -> None:
    from strategies.ensemble.artifact import load_ensemble

    ensemble = load_ensemble(artifact)
    labels = ensemble.predict(np.zeros((5, 1, 8, 8), np.float32))
    assert ensemble.archs == list(ARCHS) and labels.shape == (5,)


def test_a_huge_declared_input_shape_builds_nothing_for_real(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import models
    from strategies.ensemble.artifact import ArtifactError, load_ensemble

    # Prepare: 1 x 2048 x 2048 samples would give mlp-s a 1 GB first layer
    bad = edited(artifact, manifest=lambda m: m.update(input_shape=[1, 2048, 2048]))
    assert bad.stat().st_size < 200_000
    devices: list[str] = []
    real = models.get_model

    def spy(*args: Any, **kwargs: Any) -> Any:
        devices.append(torch.empty(0).device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "get_model", spy)

    # Execute / Assert: refused (mlp-s would need 64 x 4194304 weights, the file holds
    # 64 x 64); every model was built on the meta device only (no memory)
    with pytest.raises(
        ArtifactError,
        match=r"'m1\.\S+' is float32 \(64, 64\) but the model has float32 \(64, 4194304\)",
    ):
        load_ensemble(bad)
    assert devices and set(devices) == {"meta"}


@pytest.mark.parametrize(("make", "match"), [(truncated, "not a readable")])
def test_the_predict_command_prints_the_error_and_exits_non_zero(
    artifact: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], Path],
    match: str,
) -> None:
    from strategies.ensemble.__main__ import main

    # Prepare
    data = tmp_path / "x.npy"
    np.save(data, np.zeros((3, 1, 8, 8), np.float32))
    no_archs = edited(artifact, manifest=lambda m: m.pop("archs"))

    # Execute / Assert: a truncated artifact, a manifest without archs, garbage data
    assert main(["predict", str(make(artifact)), str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and "Traceback" not in err
    assert main(["predict", str(no_archs), str(data)]) == 2
    assert "field 'manifest.archs' is missing" in capsys.readouterr().err
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"PK\x03\x04 not really a zip")
    assert main(["predict", str(artifact), str(garbage)]) == 2
    assert "cannot be read as samples" in capsys.readouterr().err


# ======================================================= through the ClientApp
# A node's own stored state and data cache, damaged between two rounds, read back
# by the real ``train`` handler in a new process: the round trains, with a warning.
NODE_ID = 7
FEDERATION_ID = "fed-a"


def node_context(
    run_config: RunConfigFactory, state_dir: Path, *, strategy: str = "local", **node: Any
) -> Any:
    """A fresh ClientApp context (as after a restart) of a node with a ``state-dir``."""
    from tessera.local_grid import make_context

    where = node or {"partition-id": 1, "num-partitions": 3}
    config = run_config({"strategy": strategy, "local-epochs": 1, "model-family": "cnn"})
    return make_context(NODE_ID, config, {**where, "state-dir": str(state_dir)})


def round_message(server_round: int, *, scheme: str = "local") -> Any:
    """The server's train message: cnn-1 on the 10 digit classes of shape (1, 8, 8)."""
    from tessera.local_grid import instruction

    config = ConfigRecord(
        {
            "server-round": server_round,
            "scheme": scheme,
            "model": "cnn-1",
            "arch": "cnn-1",
            "num-classes": 10,
            "input-shape": [1, 8, 8],
            "federation": FEDERATION_ID,
        }
    )
    return instruction(RecordDict({wire.CONFIG: config}), dst_node_id=NODE_ID, message_type="train")


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """The model's weights as local training starts, one entry per train call."""
    import client_app.app
    from tessera.training import train_model as real

    seen: list[dict[str, torch.Tensor]] = []

    def recording(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(client_app.app, "train_model", recording)
    return seen


def _nan_personal(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    first = next(k for k, v in state.items() if v.is_floating_point())
    return {**state, first: torch.full_like(state[first], float("nan"))}


def _five_class_personal(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Same names, a 5-class head: a model of another task."""
    from models import get_model

    other = get_model("cnn-1", input_shape=(1, 8, 8), num_classes=5)
    return wire.exchanged_state(other.state_dict())


@pytest.mark.parametrize(
    ("damage", "logged"),
    [
        (_nan_personal, "holds NaN or infinite values"),
        (_five_class_personal, r"is float32 \(5, \d+\) but the model has float32 \(10, \d+\)"),
    ],
)
def test_a_node_restarted_with_a_bad_personal_model_trains_afresh_with_a_warning(
    run_config: RunConfigFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fast_clients: None,
    fresh_memory: None,
    starts: list[dict[str, torch.Tensor]],
    damage: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    logged: str,
) -> None:
    from client_app.app import STATE_MODEL, STATE_MODEL_META, train
    from strategies.core.client import MODEL_ROUNDS
    from tessera.config import NodeConfig

    # Prepare: round 1 keeps a personal model in the state-dir; the file is then
    # damaged and the node restarts (a new context, its state empty)
    first = node_context(run_config, tmp_path)
    train(round_message(1), first)
    owner = NodeConfig.from_flower(first.node_config).owner
    on_disk = NodeState.open(
        RecordDict(), state_dir=str(tmp_path), federation=FEDERATION_ID, owner=owner
    )
    stored = on_disk.arrays(STATE_MODEL)
    assert stored is not None and on_disk.restored_from_disk
    on_disk.put(STATE_MODEL, ArrayRecord(damage(stored.to_torch_state_dict())))
    on_disk.save(1)
    restarted = node_context(run_config, tmp_path)

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        reply = train(round_message(2), restarted)

    # Assert: said why, started from the fresh initialisation (the same seeded
    # weights round 1 started from), trained, and stored a good model again
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "stored 'tessera.model' does not fit the model" in m and re.search(logged, m)
        for m in messages
    ), messages
    assert len(starts) == 2
    for name, value in starts[0].items():
        torch.testing.assert_close(starts[1][name], value)
    metrics = reply.content.metric_records[wire.METRICS]
    assert metrics[MODEL_ROUNDS] == 1  # the personal model's count starts again
    assert np.isfinite(metrics[wire.TRAIN_LOSS])
    model = restarted.state.array_records[STATE_MODEL]
    assert model_problem(model, wire.exchanged_state(starts[0])) is None
    assert restarted.state.config_records[STATE_MODEL_META]["rounds"] == 1


def _more_classes(arrays: dict[str, np.ndarray]) -> None:
    """Self-consistent, wrong: the entry claims 20 classes (its labels stay below 10)."""
    arrays["num_classes"] = np.asarray(20, np.int64)


@pytest.mark.parametrize(
    ("change", "logged"),
    [
        (_nan_sample, "NaN or infinite"),
        (_flattened, r"shape \(1, 64\) but the federation trains on \(1, 8, 8\)"),
        (_more_classes, "20 classes but the federation has 10"),
    ],
)
def test_a_node_whose_data_cache_entry_is_bad_rebuilds_it_and_trains(
    run_config: RunConfigFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fast_clients: None,
    fresh_memory: None,
    change: Callable[[dict[str, np.ndarray]], None],
    logged: str,
) -> None:
    from client_app.app import train

    # Prepare: round 1 writes the node's data cache; it is damaged, and the next
    # message comes to a new process (nothing in memory)
    context = node_context(run_config, tmp_path, strategy="fedavg-groups")
    first = train(round_message(1, scheme="fedavg-groups"), context)
    (entry,) = (tmp_path / ".data-cache").glob("node-data-*.npz")
    rewrite(entry, change)
    clear_memory_cache()

    # Execute
    with caplog.at_level(logging.WARNING, logger="tessera.data.cache"):
        second = train(round_message(2, scheme="fedavg-groups"), context)

    # Assert: discarded with the reason, rebuilt the same, written back good
    assert any(
        "is unusable" in r.getMessage() and re.search(logged, r.getMessage())
        for r in caplog.records
    ), caplog.text
    before = first.content.metric_records[wire.METRICS]
    after = second.content.metric_records[wire.METRICS]
    for key in (wire.NUM_EXAMPLES, wire.NUM_TEST_EXAMPLES):
        assert after[key] == before[key]
    assert np.isfinite(after[wire.TRAIN_LOSS])
    with np.load(entry) as npz:
        assert np.isfinite(npz["x_train"]).all()
        assert tuple(npz["input_shape"]) == (1, 8, 8) and int(npz["num_classes"]) == 10


def test_a_node_whose_own_data_file_cache_claims_more_classes_rebuilds_it(
    run_config: RunConfigFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fast_clients: None,
    fresh_memory: None,
) -> None:
    from client_app.app import train

    # Prepare: a node with its own data file (labels 0..9); its cache entry then
    # claims 20 classes, which the handler would refuse as a real mismatch
    data = tmp_path / "mine.npz"
    rng = np.random.default_rng(0)
    x = rng.random((60, 1, 8, 8), dtype=np.float32)
    np.savez(data, x_train=x, y_train=np.arange(60, dtype=np.int64) % 10)
    state_dir = tmp_path / "state"
    context = node_context(
        run_config, state_dir, strategy="fedavg-groups", **{"data-path": str(data)}
    )
    train(round_message(1, scheme="fedavg-groups"), context)
    (entry,) = (state_dir / ".data-cache").glob("node-data-*.npz")
    rewrite(entry, _more_classes)
    clear_memory_cache()

    # Execute
    with caplog.at_level(logging.WARNING, logger="tessera.data.cache"):
        reply = train(round_message(2, scheme="fedavg-groups"), context)

    # Assert: 60 samples, local-test-fraction 0.2 -> 48 train
    assert "20 classes but the federation has 10" in caplog.text
    assert reply.content.metric_records[wire.METRICS][wire.NUM_EXAMPLES] == 48
    with np.load(entry) as npz:
        assert int(npz["num_classes"]) == 10


# ===================================================== byte order, shapes, members
# numpy names ``>f4`` and ``<f4`` both ``float32``, but torch reads only the native
# order: a file holding the other must be converted on read or refused, never used.
OTHER_F4 = np.dtype(np.float32).newbyteorder("S")
"""float32 in the byte order this machine does not use (``>f4`` on x86 and ARM)."""


def other_order(array: np.ndarray) -> np.ndarray:
    """The same values stored in the byte order this machine does not use."""
    return array.astype(array.dtype.newbyteorder("S"))


def test_read_npz_returns_arrays_of_the_other_byte_order_in_the_native_one() -> None:
    # Prepare
    buffer = io.BytesIO()
    w = np.array([[1.5, -2.0, 3.25]], np.float32)
    ids = np.asfortranarray(np.array([[1, 2], [3, 4]], np.int64))
    np.savez(buffer, w=other_order(w), ids=other_order(ids))  # type: ignore[arg-type]

    # Execute
    back = read_npz(buffer.getvalue())

    # Assert: the same values, in the order torch reads
    assert back["w"].dtype == np.float32 and back["w"].dtype.isnative
    assert back["ids"].dtype == np.int64 and back["ids"].dtype.isnative
    np.testing.assert_array_equal(back["w"], [[1.5, -2.0, 3.25]])
    np.testing.assert_array_equal(back["ids"], [[1, 2], [3, 4]])
    assert torch.from_numpy(back["w"]).tolist() == [[1.5, -2.0, 3.25]]


def test_a_checkpoint_of_the_other_byte_order_is_restored_in_the_native_one(
    tmp_path: Path,
) -> None:
    # Prepare: group weights and a scheme's entry written big-endian (on x86)
    group = {"w": other_order(np.full((2, 3), 0.5, np.float32)), "b": other_order(GOOD_GROUP["b"])}
    tree = saved_tree(
        tmp_path,
        {"group_models": {"arrays": {"cnn": group}}, "targets": {"ids": other_order(np.arange(3))}},
    )
    models = GroupModels(get_aggregator("mean"), two_by_three)

    # Execute
    models.load_state_dict(tree["group_models"])
    ids = checked_array(tree["targets"], "ids", shape=(3,), kinds="iu")

    # Assert: usable by torch, values unchanged
    w = models.arrays["cnn"]["w"]
    assert w.dtype.isnative and torch.from_numpy(w).sum().item() == 3.0
    assert ids.dtype.isnative and torch.from_numpy(ids).tolist() == [0, 1, 2]


def test_arrays_problem_refuses_an_array_of_the_other_byte_order() -> None:
    # Prepare
    expected = {"w": torch.zeros(2, 3)}

    # Execute
    problem = arrays_problem({"w": np.ones((2, 3), OTHER_F4)}, expected, where="g")

    # Assert: the field, what it is and the dtype expected
    assert problem is not None and problem.field == "g.w"
    assert re.search(
        r"is float32 in \w+-endian byte order .*; expected float32 in this", str(problem)
    )


def test_npy_bytes_problem_refuses_the_other_byte_order_and_negative_dimensions() -> None:
    # Prepare: a header declaring shape (-2, -2), which math.prod makes 4 values
    other = npy_bytes(np.ones((2, 3), OTHER_F4))
    negative = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": (-2, -2)}
    np.lib.format.write_array_header_1_0(negative, header)

    # Execute
    order = npy_bytes_problem(other, shape=(2, 3), dtype="float32")
    dims = npy_bytes_problem(negative.getvalue() + b"\0" * 16, shape=(-2, -2), dtype="float32")

    # Assert
    assert order is not None and "expected float32 in this machine's byte order" in order
    assert dims is not None and "shape (-2, -2); dimensions must be >= 0" in dims


@pytest.mark.parametrize(
    ("array", "problem"),
    [
        (
            Array(
                dtype="float32",
                shape=(2, 3),
                stype="numpy.ndarray",
                data=npy_bytes(np.ones((2, 3), OTHER_F4)),
            ),
            "byte order",
        ),
        (
            Array(
                dtype="float32",
                shape=(-2, -2),
                stype="numpy.ndarray",
                data=lying_npy((-2, -2), b"\0" * 16),
            ),
            "dimensions must be >= 0",
        ),
    ],
    ids=["other byte order", "negative dimensions"],
)
def test_a_node_state_array_torch_cannot_take_is_discarded_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, array: Array, problem: str
) -> None:
    # Prepare: the node saved it and restarted
    state = _open(tmp_path, "fed-a")
    state.put("tessera.model", ArrayRecord({"w": array}))
    state.save(2)
    in_memory = NodeState(RecordDict())
    in_memory.put("tessera.model", ArrayRecord({"w": array}))

    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr.tessera"):
        again = _open(tmp_path, "fed-a")
        fitting = in_memory.fitting_arrays("tessera.model", like={"w": torch.zeros(2, 3)})

    # Assert: the file is not used, the record is forgotten, both said so
    assert not again.restored_from_disk and again.arrays("tessera.model") is None
    assert fitting is None and in_memory.arrays("tessera.model") is None
    assert any(
        "is malformed" in r.getMessage() and problem in r.getMessage() for r in caplog.records
    )
    assert problem in str(record_problem(ArrayRecord({"w": array})))


def test_an_artifact_of_the_other_byte_order_predicts_as_the_native_one(artifact: Path) -> None:
    from strategies.ensemble.artifact import load_ensemble

    # Prepare: every model weight and alpha written in the other byte order
    def swap(entries: dict[str, np.ndarray]) -> None:
        for name, value in list(entries.items()):
            if name != "manifest":
                entries[name] = other_order(value)

    swapped = edited(artifact, arrays=swap)
    x = np.random.default_rng(0).normal(size=(6, 1, 8, 8)).astype(np.float32)

    # Execute
    labels = load_ensemble(swapped).predict(x)

    # Assert
    np.testing.assert_array_equal(labels, load_ensemble(artifact).predict(x))


def test_a_duplicate_member_is_still_refused() -> None:
    # Prepare: two members named a0.npy (np.savez never writes that)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive, pytest.warns(UserWarning, match="Duplicate"):
        archive.writestr("a0.npy", npy_bytes(np.zeros(1, np.float32)))
        archive.writestr("a0.npy", npy_bytes(np.ones(1, np.float32)))

    # Execute / Assert
    with pytest.raises(StateFileError, match=r"'a0.npy' is not a single .npy array"):
        read_npz(buffer.getvalue())
