"""Tests for tessera.data.cache: a node's data loaded once, kept in memory and on disk."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tessera.data import (
    ArrayDataset,
    DataBundle,
    DatasetSpec,
    NodeSplits,
    PartitionConfig,
    cache_keys,
    client_data,
    load_bundle,
    local_data,
    node_cache_dir,
    node_local_data,
    node_partition_data,
)
from tessera.data import cache as data_cache
from tessera.data.cache import CACHE_DIR_NAME
from tessera.data.cache_entry import MAX_DISK_ENTRIES, cache_file
from tessera.data.cache_keys import partition_key
from tessera.data.cache_memory import MemoryCache, clear_memory_cache

PARTITION = PartitionConfig("dirichlet", alpha=0.5, seed=3)


@pytest.fixture(autouse=True)
def _fresh_memory() -> Iterator[None]:
    clear_memory_cache()
    yield
    clear_memory_cache()


class CountingLoader:
    """``load_bundle`` that counts its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, spec: DatasetSpec) -> DataBundle:
        self.calls.append(str(spec))
        return load_bundle(spec)


def _ids_npz(path: Path, *, n_train: int = 120, shift: float = 0.0) -> Path:
    """Vectors whose first feature is a sample id; 4 classes."""
    x_train = np.zeros((n_train, 5), dtype=np.float32)
    x_train[:, 0] = np.arange(n_train) + shift
    x_test = np.ones((20, 5), dtype=np.float32)
    np.savez(
        path,
        x_train=x_train,
        y_train=np.arange(n_train) % 4,
        x_test=x_test,
        y_test=np.arange(20) % 4,
    )
    return path


def _partition(
    cache_dir: Path | None,
    load: Callable[[DatasetSpec], DataBundle],
    *,
    source: str = "digits",
    **changes: Any,
) -> NodeSplits:
    args: dict[str, Any] = {
        "partition_id": 1,
        "num_partitions": 4,
        "partition": PARTITION,
        "pool_fraction": 0.1,
        "test_fraction": 0.2,
        **changes,
    }
    return node_partition_data(source, cache_dir=cache_dir, load=load, **args)


def _entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("node-data-*.npz"))


def _assert_same(a: NodeSplits, b: NodeSplits) -> None:
    for left, right in ((a.train, b.train), (a.test, b.test)):
        assert left.x.dtype == right.x.dtype == np.float32
        assert left.y.dtype == right.y.dtype == np.int64
        np.testing.assert_array_equal(left.x, right.x)
        np.testing.assert_array_equal(left.y, right.y)
    assert (a.num_classes, a.input_shape) == (b.num_classes, b.input_shape)


# --------------------------------------------------------------------------- #
# Hits
# --------------------------------------------------------------------------- #


def test_second_call_reuses_memory_then_disk_without_reloading(tmp_path: Path) -> None:
    # Prepare
    load = CountingLoader()
    cache_dir = node_cache_dir(str(tmp_path / "state"))
    assert cache_dir == tmp_path / "state" / CACHE_DIR_NAME

    # Execute
    first = _partition(cache_dir, load)
    again = _partition(cache_dir, load)  # same process: memory
    clear_memory_cache()  # a new process (the next message in deployment)
    from_disk = _partition(cache_dir, load)

    # Assert
    assert load.calls == ["digits"]
    assert again is first
    _assert_same(from_disk, first)
    assert len(_entries(cache_dir)) == 1


def test_memory_only_without_a_state_dir(tmp_path: Path) -> None:
    load = CountingLoader()

    first = _partition(None, load)
    again = _partition(None, load)

    assert node_cache_dir(None) is None
    assert load.calls == ["digits"] and again is first
    assert list(tmp_path.iterdir()) == []


def test_cached_arrays_equal_the_uncached_ones_exactly(tmp_path: Path) -> None:
    # Prepare: the pipeline without any cache
    train, test = client_data(
        "digits",
        partition_id=1,
        num_partitions=4,
        partition=PARTITION,
        pool_fraction=0.1,
        test_fraction=0.2,
    )
    cache_dir = tmp_path / "cache"

    # Execute
    built = _partition(cache_dir, load_bundle)
    clear_memory_cache()
    read = _partition(cache_dir, load_bundle)

    # Assert
    expected = NodeSplits(train, test, 10, (1, 8, 8))
    _assert_same(built, expected)
    _assert_same(read, expected)
    assert len(read.train) + len(read.test) == len(train) + len(test)


def test_local_file_is_read_once_and_equals_local_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    calls: list[str] = []

    def counting_local_data(path: str, **kwargs: Any) -> Any:
        calls.append(path)
        return local_data(path, **kwargs)

    monkeypatch.setattr(data_cache, "local_data", counting_local_data)
    path = str(_ids_npz(tmp_path / "mine.npz"))
    cache_dir = tmp_path / "cache"

    # Execute
    first = node_local_data(path, test_fraction=0.25, seed=0, cache_dir=cache_dir)
    clear_memory_cache()
    second = node_local_data(path, test_fraction=0.25, seed=0, cache_dir=cache_dir)

    # Assert
    assert calls == [path]
    train, test, num_classes, shape = local_data(path, test_fraction=0.25, seed=0)
    _assert_same(second, NodeSplits(train, test, num_classes, shape))
    _assert_same(first, second)
    assert (len(second.train), len(second.test), second.num_classes) == (120, 20, 4)


# --------------------------------------------------------------------------- #
# Invalidation
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("changes", "loads"),
    [
        ({"partition": PartitionConfig("dirichlet", alpha=0.5, seed=4)}, 2),  # seed
        ({"partition": PartitionConfig("dirichlet", alpha=0.1, seed=3)}, 2),  # alpha
        ({"partition": PartitionConfig("iid", seed=3)}, 2),  # scheme
        ({"num_partitions": 5}, 2),
        ({"pool_fraction": 0.2}, 2),
        # the same federation: its partitioning is kept, only the node's split is new
        ({"partition_id": 2}, 1),
        ({"test_fraction": 0.3}, 1),
    ],
)
def test_a_changed_key_rebuilds(tmp_path: Path, changes: dict[str, Any], loads: int) -> None:
    # Prepare
    load = CountingLoader()
    cache_dir = tmp_path / "cache"
    base = _partition(cache_dir, load)

    # Execute
    changed = _partition(cache_dir, load, **changes)
    clear_memory_cache()
    base_again = _partition(cache_dir, load)

    # Assert: built twice (the data set loaded again unless only the node differs),
    # both entries kept, the first still served from disk
    assert load.calls == ["digits"] * loads
    assert len(_entries(cache_dir)) == 2
    assert len(changed.train) != len(base.train) or not np.array_equal(
        changed.train.x, base.train.x
    )
    _assert_same(base_again, base)


def test_a_different_dataset_rebuilds(tmp_path: Path) -> None:
    load = CountingLoader()
    cache_dir = tmp_path / "cache"
    path = _ids_npz(tmp_path / "ids.npz")

    digits = _partition(cache_dir, load)
    ids = _partition(cache_dir, load, source=f"npz:{path}")

    assert load.calls == ["digits", f"npz:{path}"]
    assert digits.input_shape == (1, 8, 8) and ids.input_shape == (5,)
    assert len(_entries(cache_dir)) == 2


def test_a_modified_dataset_file_rebuilds(tmp_path: Path) -> None:
    # Prepare: a dataset file written long ago
    load = CountingLoader()
    cache_dir = tmp_path / "cache"
    path = _ids_npz(tmp_path / "ids.npz")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    old = _partition(cache_dir, load, source=f"npz:{path}")

    # Execute: the same file name, same size, new content
    _ids_npz(path, shift=1000.0)
    clear_memory_cache()
    new = _partition(cache_dir, load, source=f"npz:{path}")

    # Assert
    assert len(load.calls) == 2
    np.testing.assert_array_equal(new.train.x[:, 0], old.train.x[:, 0] + 1000.0)
    np.testing.assert_array_equal(new.train.y, old.train.y)


@pytest.mark.parametrize(
    "change",
    ["content", "seed", "test_fraction", "num_classes"],
)
def test_a_changed_local_file_or_split_rebuilds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    # Prepare
    calls: list[str] = []

    def counting_local_data(path: str, **kwargs: Any) -> Any:
        calls.append(path)
        return local_data(path, **kwargs)

    monkeypatch.setattr(data_cache, "local_data", counting_local_data)
    path = str(_ids_npz(tmp_path / "mine.npz"))
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    args: dict[str, Any] = {"test_fraction": 0.25, "seed": 0, "num_classes": None}
    node_local_data(path, cache_dir=tmp_path / "cache", **args)

    # Execute
    if change == "content":
        _ids_npz(Path(path), n_train=80)
    else:
        args[change] = {"seed": 1, "test_fraction": 0.5, "num_classes": 10}[change]
    clear_memory_cache()
    second = node_local_data(path, cache_dir=tmp_path / "cache", **args)

    # Assert
    assert calls == [path, path]
    if change == "content":
        assert len(second.train) == 80
    if change == "num_classes":
        assert second.num_classes == 10


def test_a_library_upgrade_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A new scikit-learn or flwr-datasets may split differently; the node's cached
    # partition must stay the one the server computes.
    load = CountingLoader()
    _partition(tmp_path, load)
    versions = cache_keys.library_versions()
    monkeypatch.setattr(
        cache_keys, "library_versions", lambda: {**versions, "scikit-learn": "99.0"}
    )
    clear_memory_cache()

    _partition(tmp_path, load)

    assert len(load.calls) == 2


# --------------------------------------------------------------------------- #
# Per node, on disk
# --------------------------------------------------------------------------- #


def test_two_nodes_keep_separate_caches(tmp_path: Path) -> None:
    # Prepare
    load = CountingLoader()
    dirs = [node_cache_dir(str(tmp_path / f"node-{i}")) for i in range(2)]

    # Execute
    nodes = [_partition(d, load, partition_id=i) for i, d in enumerate(dirs)]
    clear_memory_cache()
    reread = [_partition(d, load, partition_id=i) for i, d in enumerate(dirs)]

    # Assert: one entry in each node's own folder, each read back as its own
    assert all(d is not None and len(_entries(d)) == 1 for d in dirs)
    # one process (a simulation worker) loads and partitions the data set once for
    # both; what each node keeps on disk is its own
    assert len(load.calls) == 1
    for own, again in zip(nodes, reread, strict=True):
        _assert_same(again, own)
    assert not np.array_equal(nodes[0].train.y, nodes[1].train.y)


def test_the_same_partition_on_two_nodes_writes_two_files(tmp_path: Path) -> None:
    load = CountingLoader()
    first, second = tmp_path / "a", tmp_path / "b"

    _partition(first, load)
    clear_memory_cache()
    _partition(second, load)

    assert len(load.calls) == 2  # b never reads a's folder
    assert [p.name for p in _entries(first)] == [p.name for p in _entries(second)]


def _corrupt_truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_garbage(path: Path) -> None:
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 100)


def _corrupt_empty(path: Path) -> None:
    path.write_bytes(b"")


def _corrupt_other_key(path: Path) -> None:
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["key"] = np.asarray("another node's key")
    with path.open("wb") as handle:
        np.savez(handle, **arrays)


def _corrupt_pickled(path: Path) -> None:
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["y_train"] = np.array([{"evil": 1}], dtype=object)
    with path.open("wb") as handle:
        np.savez(handle, **arrays)


def _corrupt_bad_labels(path: Path) -> None:
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["y_train"] = arrays["y_train"] + 100
    with path.open("wb") as handle:
        np.savez(handle, **arrays)


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_truncated,
        _corrupt_garbage,
        _corrupt_empty,
        _corrupt_other_key,
        _corrupt_pickled,
        _corrupt_bad_labels,
    ],
)
def test_a_corrupt_cache_file_is_logged_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt: Callable[[Path], None]
) -> None:
    # Prepare
    load = CountingLoader()
    good = _partition(tmp_path, load)
    (entry,) = _entries(tmp_path)
    corrupt(entry)
    clear_memory_cache()

    # Execute
    with caplog.at_level(logging.WARNING, logger="tessera.data.cache"):
        rebuilt = _partition(tmp_path, load)

    # Assert: logged, rebuilt, and the rewritten file is good again
    assert len(load.calls) == 2
    assert any(
        str(entry) in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records
    )
    _assert_same(rebuilt, good)
    clear_memory_cache()
    _assert_same(_partition(tmp_path, load), good)
    assert len(load.calls) == 2


def test_an_unwritable_cache_is_logged_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    load = CountingLoader()

    with caplog.at_level(logging.WARNING, logger="tessera.data.cache"):
        splits = _partition(blocker / "cache", load)

    assert len(splits.train) > 0 and load.calls == ["digits"]
    assert any("cannot write node data cache" in r.getMessage() for r in caplog.records)


def test_the_file_is_numeric_npz_with_its_key_and_no_temporaries(tmp_path: Path) -> None:
    _partition(tmp_path, load_bundle)
    key = partition_key(
        DatasetSpec("digits"),
        partition_id=1,
        num_partitions=4,
        partition=PARTITION,
        pool_fraction=0.1,
        test_fraction=0.2,
    )
    assert key is not None

    with np.load(cache_file(tmp_path, key), allow_pickle=False) as npz:
        assert str(npz["key"]) == key
        assert int(npz["num_classes"]) == 10
        assert npz["input_shape"].tolist() == [1, 8, 8]
    assert [p.name for p in tmp_path.iterdir()] == [cache_file(tmp_path, key).name]


def test_the_folder_keeps_the_most_recently_used_entries(tmp_path: Path) -> None:
    # Prepare: as many entries as the folder keeps, entry s last used s seconds
    # after the epoch (seed 1 the least recently used once seed 0 is read again)
    load = CountingLoader()
    path = _ids_npz(tmp_path / "ids.npz")
    cache_dir = tmp_path / "cache"

    def node(seed: int) -> NodeSplits:
        config = PartitionConfig("iid", seed=seed)
        return _partition(cache_dir, load, source=f"npz:{path}", partition=config)

    for seed in range(MAX_DISK_ENTRIES):
        before = set(_entries(cache_dir)) if cache_dir.exists() else set()
        node(seed)
        (written,) = set(_entries(cache_dir)) - before
        os.utime(written, ns=((seed + 1) * 10**9, (seed + 1) * 10**9))
    clear_memory_cache()
    node(0)  # a disk hit marks seed 0 recently used
    assert len(load.calls) == MAX_DISK_ENTRIES

    # Execute
    node(MAX_DISK_ENTRIES)

    # Assert: seed 1 was removed, seed 0 kept
    assert len(_entries(cache_dir)) == MAX_DISK_ENTRIES
    clear_memory_cache()
    node(0)
    assert len(load.calls) == MAX_DISK_ENTRIES + 1
    node(1)
    assert len(load.calls) == MAX_DISK_ENTRIES + 2


def test_a_missing_dataset_file_still_raises_the_loader_error(tmp_path: Path) -> None:
    from tessera.data import DataError

    with pytest.raises(DataError, match=r"nope\.npz.*does not exist"):
        _partition(tmp_path, load_bundle, source=f"npz:{tmp_path / 'nope.npz'}")
    assert _entries(tmp_path) == []


# --------------------------------------------------------------------------- #
# Memory bounds
# --------------------------------------------------------------------------- #


def _splits(fill: float) -> NodeSplits:
    """60 bytes: train 2 x 3 float32 (24) + 2 int64 (16), test 1 x 3 (12) + 1 (8)."""
    train = ArrayDataset(x=np.full((2, 3), fill, dtype=np.float32), y=np.zeros(2, dtype=np.int64))
    test = ArrayDataset(x=np.full((1, 3), fill, dtype=np.float32), y=np.zeros(1, dtype=np.int64))
    return NodeSplits(train, test, 1, (3,))


def test_memory_cache_evicts_least_recently_used_by_bytes() -> None:
    # Prepare: room for 150 bytes, i.e. two 60-byte entries
    memory = MemoryCache(max_entries=10, max_bytes=150)
    a, b, c = _splits(1), _splits(2), _splits(3)
    assert a.nbytes == 60

    # Execute
    memory.put("a", a)
    memory.put("b", b)
    assert memory.get("a") is a  # a is now the most recently used
    memory.put("c", c)

    # Assert
    assert memory.get("b") is None
    assert memory.get("a") is a and memory.get("c") is c
    assert (len(memory), memory.nbytes) == (2, 120)


def test_memory_cache_evicts_by_count_and_skips_oversized_entries() -> None:
    memory = MemoryCache(max_entries=1, max_bytes=100)
    memory.put("a", _splits(1))
    memory.put("b", _splits(2))
    assert memory.get("a") is None and len(memory) == 1

    small = MemoryCache(max_entries=5, max_bytes=59)
    small.put("a", _splits(1))  # 60 bytes > 59: not kept
    assert len(small) == 0


def test_memory_cache_counts_its_bytes_through_replace_discard_and_clear() -> None:
    # the byte count is kept as entries come and go (not summed per put): check it
    # against the entries after each kind of change
    memory = MemoryCache(max_entries=10, max_bytes=1000)
    memory.put("a", _splits(1))
    memory.put("a", _splits(2))  # replaced, not added
    memory.put("b", _splits(3))
    assert (len(memory), memory.nbytes) == (2, 120)
    memory.discard("a")
    memory.discard("missing")
    assert (len(memory), memory.nbytes) == (1, 60)
    memory.clear()
    assert (len(memory), memory.nbytes) == (0, 0)
    memory.put("c", _splits(4))
    assert memory.nbytes == 60


def test_memory_cache_rejects_negative_bounds() -> None:
    with pytest.raises(ValueError, match="max_entries=-1"):
        MemoryCache(max_entries=-1, max_bytes=0)


def test_every_node_of_a_federation_is_a_slice_of_one_partitioning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: a simulation worker serving 20 nodes, more than the per-node cache holds
    import tessera.data.splits as splits

    calls: list[int] = []
    real = splits.partition_indices

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(splits, "partition_indices", counting)
    load = CountingLoader()

    # Execute: every node twice (two rounds)
    got = [
        _partition(None, load, partition_id=pid, num_partitions=20)
        for _ in range(2)
        for pid in range(20)
    ]

    # Assert: loaded and partitioned once; each node's data is what client_data gives
    assert load.calls == ["digits"] and len(calls) == 1
    train, test = client_data(
        "digits",
        partition_id=13,
        num_partitions=20,
        partition=PARTITION,
        pool_fraction=0.1,
        test_fraction=0.2,
    )
    _assert_same(got[33], NodeSplits(train, test, got[33].num_classes, got[33].input_shape))


def test_a_worker_serving_hundreds_of_nodes_splits_each_node_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: a simulation worker serves 300 nodes in turn, round after round; the
    # per-node cache once held 16, so every message rebuilt its node's splits
    import tessera.data.splits as splits

    clear_memory_cache()
    split_calls: list[int] = []
    real = splits.FederationPartitions.client_split

    def counting(self: Any, partition_id: int, **kwargs: Any) -> Any:
        split_calls.append(partition_id)
        return real(self, partition_id, **kwargs)

    monkeypatch.setattr(splits.FederationPartitions, "client_split", counting)
    load = CountingLoader()

    # Execute: three messages per node (handshake, two rounds)
    for _ in range(3):
        for pid in range(300):
            _partition(
                None,
                load,
                partition_id=pid,
                num_partitions=300,
                partition=PartitionConfig("iid", seed=3),
            )

    # Assert: each node split once, then served from memory
    assert sorted(split_calls) == list(range(300))
    clear_memory_cache()


def test_library_versions_are_read_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: count the metadata lookups (each parses a distribution's METADATA)
    from importlib import metadata

    from tessera.data import cache_keys

    calls: list[str] = []

    def version(name: str) -> str:
        calls.append(name)
        return "1.0"

    monkeypatch.setattr(metadata, "version", version)
    cache_keys._installed_versions.cache_clear()

    # Execute
    try:
        first = cache_keys.library_versions()
        first["numpy"] = "changed by a caller"
        second = cache_keys.library_versions()
    finally:
        cache_keys._installed_versions.cache_clear()  # the next test reads the real ones

    # Assert: one lookup per library, and a caller's copy is its own
    assert calls == list(cache_keys.LIBRARIES)
    assert second == dict.fromkeys(cache_keys.LIBRARIES, "1.0")
