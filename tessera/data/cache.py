"""A node's data, loaded and split once and reused across messages.

Every message a node handles needs its data: its partition (load the whole
dataset, hold out the server pool, run the partitioner, split locally) or its own
``data-path`` file (read, convert, split). In deployment Flower starts a fresh
ClientApp process for every message, so without a cache each message pays all of
that again. :func:`node_partition_data` and :func:`node_local_data` keep the result

- in memory, per process (:class:`MemoryCache`, bounded in entries and bytes):
  a simulation worker process serves many messages;
- on disk, per node, in ``<state-dir>/.data-cache/`` (node-config ``state-dir``,
  see :func:`node_cache_dir`; without one nothing is written): one
  ``node-data-<digest>.npz`` per key, numeric arrays only (read back with
  ``allow_pickle=False``), written to a temporary file and renamed into place.

The key (:func:`partition_key`, :func:`local_file_key`) is a canonical JSON text
of everything the result depends on: the cache format version, the dataset spec,
for a file its resolved path, size, modification and change times, the
partitioning (:class:`~tessera.data.spec.PartitionConfig`, seed included, the
partition count, the partition id, the server-pool and local-test fractions), and
the versions of the libraries that compute the splits (numpy, scikit-learn,
flwr-datasets, datasets), since a new version may split differently and a node's
cached partition must stay the one the server computes. The file name is a digest
of the key and the file stores the key itself, so a changed key never reads an old
entry. An entry is checked before use, since a node must never fail every round
because of what it stored: its sizes are bounded by the file's own before anything is
read (:func:`tessera.state_checks.read_npz`), its arrays must have their dtypes and
ranks, agree with each other, hold finite samples and labels in range, and, when the
caller says what the federation trains on (``expect_shape``, ``expect_classes``),
match it. An entry that fails (truncated, corrupt, another key, NaN, a shape that is
self-consistent but wrong) is logged, deleted and rebuilt; a built entry that fails
is used but not written. A cache that cannot be written is logged and skipped. At
most :data:`MAX_DISK_ENTRIES` entries are kept, the least recently used removed
first.

A hub dataset (``hf:<id>``) is keyed by its id: a hub dataset that changes under
the same id is not noticed (clear the folder). A data file replaced by one of
the same size with both its times restored is not noticed either (the change
time cannot be set by a user, so this takes a restored backup of the whole disk).

The arrays returned are shared with later calls: copy before changing them in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from tessera.data.arrays import ArrayDataset, DataBundle, DataError, validate_labels
from tessera.data.loaders import load_bundle
from tessera.data.spec import DatasetSpec, PartitionConfig, parse_dataset_spec
from tessera.data.splits import (
    FederationPartitions,
    NodeSplits,
    federation_partitions,
    local_data,
)
from tessera.state_checks import read_npz

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
"""Version of the cache's key and file layout; bump it when either changes."""
CACHE_DIR_NAME = ".data-cache"
"""The cache folder inside node-config ``state-dir``. A federation id (the state's
other folders) cannot start with ``.``, so the names never collide."""
FILE_PREFIX = "node-data-"
MAX_DISK_ENTRIES = 4
"""Cache files kept per node (a node rarely needs more than its current run's)."""
STALE_TMP_SECONDS = 3600.0
"""Age after which a temporary file left by a killed writer is removed."""
LIBRARIES = ("numpy", "scikit-learn", "flwr-datasets", "datasets")
"""Distributions whose version is part of every key."""
ENTRY_ARRAYS = ("key", "x_train", "y_train", "x_test", "y_test", "num_classes", "input_shape")


class MemoryCache:
    """A least-recently-used map from key to :class:`NodeSplits`, bounded twice.

    Parameters
    ----------
    max_entries : int
        Most entries kept.
    max_bytes : int
        Most array bytes kept; an entry larger than this is not kept at all.

    Raises
    ------
    ValueError
        If a bound is negative.
    """

    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(
                f"MemoryCache bounds must be >= 0, got max_entries={max_entries} and "
                f"max_bytes={max_bytes}; use 0 to keep nothing"
            )
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, NodeSplits] = OrderedDict()

    def __len__(self) -> int:
        """Return the number of entries held."""
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Array bytes held by all entries."""
        return sum(entry.nbytes for entry in self._entries.values())

    def get(self, key: str) -> NodeSplits | None:
        """Return the entry of ``key`` (marking it recently used), or ``None``."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, value: NodeSplits) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used to fit."""
        self._entries.pop(key, None)
        if self.max_entries == 0 or value.nbytes > self.max_bytes:
            return
        self._entries[key] = value
        total = self.nbytes
        while len(self._entries) > self.max_entries or total > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            total -= evicted.nbytes

    def discard(self, key: str) -> None:
        """Drop the entry of ``key`` if there is one."""
        self._entries.pop(key, None)

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()


# Per process on purpose: Flower calls the handlers as plain functions, so module
# state is the only thing a simulation worker keeps from one message to the next
# (``context.state`` is serialised and would copy the arrays on every message).
_MEMORY = MemoryCache(max_entries=16, max_bytes=1 << 30)

FEDERATIONS_KEPT = 2
"""Federations whose partitioning a process keeps (:func:`federation_of`)."""
_FEDERATIONS: OrderedDict[str, FederationPartitions] = OrderedDict()


def clear_memory_cache() -> None:
    """Forget every node's data held in this process (the disk cache is kept)."""
    _MEMORY.clear()
    _FEDERATIONS.clear()


def federation_of(
    key: str | None, build: Callable[[], FederationPartitions]
) -> FederationPartitions:
    """Return a federation's partitioning, computed once per process per ``key``.

    A simulation worker serves every node of a federation in turn, far more nodes
    than the per-node cache holds; the server-pool split and the partitioning are
    the same for all of them, so they are kept (the last :data:`FEDERATIONS_KEPT`
    federations) and each node's data is then a slice of them.
    """
    if key is None:
        return build()
    found = _FEDERATIONS.get(key)
    if found is None:
        found = build()
        _FEDERATIONS[key] = found
        while len(_FEDERATIONS) > FEDERATIONS_KEPT:
            _FEDERATIONS.popitem(last=False)
    else:
        _FEDERATIONS.move_to_end(key)
    return found


def node_cache_dir(state_dir: str | None) -> Path | None:
    """Return the data-cache folder of a node with node-config ``state-dir``.

    Parameters
    ----------
    state_dir : str or None
        The node's state folder; ``None`` keeps the cache in memory only.

    Returns
    -------
    pathlib.Path or None
        ``<state-dir>/.data-cache``, or ``None`` without a state folder.
    """
    if state_dir is None:
        return None
    return Path(state_dir).expanduser() / CACHE_DIR_NAME


def library_versions() -> dict[str, str]:
    """Return the installed version of each of :data:`LIBRARIES` (without importing them)."""
    from importlib import metadata  # here: tens of milliseconds where nothing loaded it yet

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def file_fingerprint(path: str | Path) -> dict[str, Any] | None:
    """Identify a file's current content by its path, size and times.

    Parameters
    ----------
    path : str or pathlib.Path
        The file.

    Returns
    -------
    dict or None
        Resolved path, size, ``mtime_ns`` and ``ctime_ns``; ``None`` if the file
        cannot be examined (the loader then reports why).
    """
    try:
        resolved = Path(path).expanduser().resolve()
        stat = resolved.stat()
    except (OSError, RuntimeError):
        return None
    return {
        "path": str(resolved),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
    }


def _key_text(fields: dict[str, Any]) -> str:
    return json.dumps(
        {"format": CACHE_FORMAT, **fields, "libraries": library_versions()},
        sort_keys=True,
        separators=(",", ":"),
    )


def partition_key(
    spec: DatasetSpec,
    *,
    partition_id: int,
    num_partitions: int,
    partition: PartitionConfig,
    pool_fraction: float,
    test_fraction: float,
) -> str | None:
    """Return the cache key of one partition's local splits.

    Parameters
    ----------
    spec : DatasetSpec
        The dataset.
    partition_id, num_partitions : int
        Which partition of how many.
    partition : PartitionConfig
        Scheme, its parameters and the seed.
    pool_fraction, test_fraction : float
        Server-pool and local-test shares.

    Returns
    -------
    str or None
        Canonical JSON text; ``None`` when an ``npz`` dataset file cannot be
        examined (nothing is cached then).
    """
    fields: dict[str, Any] = {
        "kind": "partition",
        "dataset": str(spec),
        "partition_id": partition_id,
        "num_partitions": num_partitions,
        "partition": asdict(partition),
        "pool_fraction": pool_fraction,
        "test_fraction": test_fraction,
    }
    if spec.kind == "npz":
        fingerprint = file_fingerprint(spec.target)
        if fingerprint is None:
            return None
        fields["file"] = fingerprint
    return _key_text(fields)


def local_file_key(
    path: str, *, test_fraction: float, seed: int, num_classes: int | None
) -> str | None:
    """Return the cache key of a node's own data file split into train and test.

    Parameters
    ----------
    path : str
        The ``.npz`` file (node-config ``data-path``).
    test_fraction : float
        Local-test share (used when the file has no test split).
    seed : int
        Split seed.
    num_classes : int or None
        The class count the labels are checked against.

    Returns
    -------
    str or None
        Canonical JSON text; ``None`` when the file cannot be examined.
    """
    fingerprint = file_fingerprint(path)
    if fingerprint is None:
        return None
    return _key_text(
        {
            "kind": "local",
            "file": fingerprint,
            "test_fraction": test_fraction,
            "seed": seed,
            "num_classes": num_classes,
        }
    )


def cache_file(cache_dir: Path, key: str) -> Path:
    """Return the file that holds ``key``'s entry in ``cache_dir``."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return cache_dir / f"{FILE_PREFIX}{digest}.npz"


def read_entry(
    path: Path,
    key: str,
    *,
    expect_shape: tuple[int, ...] | None = None,
    expect_classes: int | None = None,
) -> NodeSplits | None:
    """Read ``key``'s entry from ``path``, checking it before it is used.

    Parameters
    ----------
    path : pathlib.Path
        The cache file.
    key : str
        The key the entry must have been written for.
    expect_shape : tuple of int, optional
        The sample shape the federation trains on (unchecked if ``None``).
    expect_classes : int, optional
        The federation's class count: the entry may not have more.

    Returns
    -------
    NodeSplits or None
        The entry; ``None`` if there is none, or if it is unreadable, belongs to
        another key or fails a check (then it is logged and deleted, and the caller
        rebuilds it).
    """
    if not path.is_file():
        return None
    try:
        arrays = read_npz(path)  # sizes bounded by the file's before anything is read
        missing = [name for name in ENTRY_ARRAYS if name not in arrays]
        if missing:
            raise DataError(f"it lacks array(s) {missing}")
        stored = arrays["key"]
        if stored.ndim != 0 or stored.dtype.kind != "U" or str(stored) != key:
            raise DataError("it was written for another key")
        splits = _checked_entry({name: arrays[name] for name in ENTRY_ARRAYS[1:]})
        problem = entry_problem(splits, expect_shape=expect_shape, expect_classes=expect_classes)
        if problem is not None:
            raise DataError(problem)
    except Exception as err:  # a broken cache must never stop the node: rebuild it
        logger.warning("node data cache %s is unusable (%s); rebuilding it", path, err)
        _unlink(path)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: pruned last
    return splits


def _scalar_int(value: np.ndarray, *, what: str) -> int:
    if value.ndim != 0 or value.dtype.kind not in "iu":
        raise DataError(f"its {what} is {value.dtype} {value.shape}, not one integer")
    return int(value)


def _checked_entry(arrays: dict[str, np.ndarray]) -> NodeSplits:
    """Rebuild the splits from a cache file's arrays, checking they are consistent."""
    num_classes = _scalar_int(arrays["num_classes"], what="class count")
    shape = arrays["input_shape"]
    if shape.ndim != 1 or shape.dtype.kind not in "iu" or not 1 <= len(shape) <= 3:
        raise DataError(f"its input shape is {shape.dtype} {shape.shape}, not 1 to 3 integers")
    input_shape = tuple(int(d) for d in shape)
    train = ArrayDataset(x=arrays["x_train"], y=arrays["y_train"])
    test = ArrayDataset(x=arrays["x_test"], y=arrays["y_test"])
    if num_classes < 1 or len(train) == 0:
        raise DataError(f"it holds {len(train)} training samples and {num_classes} classes")
    for split, part in (("train", train), ("test", test)):
        if part.input_shape != input_shape:
            raise DataError(f"its {split} samples have shape {part.input_shape}, not {input_shape}")
        validate_labels(part.y, num_classes, what=f"cached {split} labels")
    return NodeSplits(train=train, test=test, num_classes=num_classes, input_shape=input_shape)


def entry_problem(
    splits: NodeSplits,
    *,
    expect_shape: tuple[int, ...] | None = None,
    expect_classes: int | None = None,
    finite: bool = True,
) -> str | None:
    """Say why an entry cannot be used (``None``: it can).

    Parameters
    ----------
    splits : NodeSplits
        The entry (its dtypes, ranks and labels already checked).
    expect_shape : tuple of int, optional
        The sample shape the federation trains on (unchecked if ``None``).
    expect_classes : int, optional
        The federation's class count: the entry may not have more.
    finite : bool
        Also check that every sample is finite (a pass over the data).

    Returns
    -------
    str or None
        The problem, or ``None``.
    """
    if expect_shape is not None and tuple(splits.input_shape) != tuple(expect_shape):
        return (
            f"its samples have shape {splits.input_shape} but the federation trains on "
            f"{tuple(expect_shape)}"
        )
    if expect_classes is not None and splits.num_classes > expect_classes:
        return f"it has {splits.num_classes} classes but the federation has {expect_classes}"
    if finite:
        for split, part in (("train", splits.train), ("test", splits.test)):
            if not bool(np.isfinite(part.x).all()):
                return f"its {split} samples hold NaN or infinite values"
    return None


def write_entry(path: Path, key: str, splits: NodeSplits) -> None:
    """Write ``key``'s entry to ``path`` atomically, then prune the folder.

    The arrays go to a temporary file in the same folder, which is flushed to disk
    and renamed over ``path``: a reader sees the old entry or the new one, never
    half of one. A failure is logged and leaves no file behind.

    Parameters
    ----------
    path : pathlib.Path
        The cache file.
    key : str
        The key stored with the entry.
    splits : NodeSplits
        The entry.
    """
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            np.savez(
                handle,
                key=np.asarray(key),
                x_train=splits.train.x,
                y_train=splits.train.y,
                x_test=splits.test.x,
                y_test=splits.test.y,
                num_classes=np.asarray(splits.num_classes, dtype=np.int64),
                input_shape=np.asarray(splits.input_shape, dtype=np.int64),
            )
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        logger.warning(
            "cannot write node data cache %s (%s); the data is rebuilt next time",
            path,
            err,
        )
        return
    finally:
        if tmp is not None:
            _unlink(Path(tmp))
    _prune(path.parent, keep=path)


def _prune(cache_dir: Path, *, keep: Path) -> None:
    """Remove the least recently used entries beyond the limit and stale temporaries."""
    try:
        entries = [p for p in cache_dir.glob(f"{FILE_PREFIX}*.npz") if p != keep]
        entries.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in entries[MAX_DISK_ENTRIES - 1 :]:
            _unlink(old)
        now = time.time()
        for tmp in cache_dir.glob(f".{FILE_PREFIX}*.tmp"):
            if now - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                _unlink(tmp)
    except OSError as err:  # another process pruned concurrently
        logger.debug("pruning %s: %s", cache_dir, err)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        logger.warning("cannot remove %s (%s)", path, err)


def cached(
    key: str | None,
    build: Callable[[], NodeSplits],
    *,
    cache_dir: Path | str | None,
    memory: MemoryCache | None = None,
    expect_shape: tuple[int, ...] | None = None,
    expect_classes: int | None = None,
) -> NodeSplits:
    """Return ``key``'s entry from memory, else from disk, else ``build()`` it.

    A cached entry that does not match ``expect_shape`` / ``expect_classes`` is
    dropped with a warning and rebuilt; a built entry is returned as it is (the
    caller reports a real mismatch), and written to disk only if it passes
    :func:`entry_problem`.

    Parameters
    ----------
    key : str or None
        The entry's key; ``None`` bypasses the cache.
    build : Callable[[], NodeSplits]
        Computes the entry (called at most once, only on a miss).
    cache_dir : pathlib.Path, str or None
        The node's cache folder (:func:`node_cache_dir`); ``None``: memory only.
    memory : MemoryCache, optional
        The in-process cache; this process's own by default.
    expect_shape : tuple of int, optional
        The sample shape the federation trains on.
    expect_classes : int, optional
        The federation's class count.

    Returns
    -------
    NodeSplits
        The entry.
    """
    if key is None:
        return build()
    memory = _MEMORY if memory is None else memory
    splits = memory.get(key)
    if splits is not None:
        problem = entry_problem(
            splits, expect_shape=expect_shape, expect_classes=expect_classes, finite=False
        )
        if problem is None:
            return splits
        logger.warning("node data held in memory is unusable (%s); rebuilding it", problem)
        memory.discard(key)
    path = None if cache_dir is None else cache_file(Path(cache_dir), key)
    splits = (
        None
        if path is None
        else read_entry(path, key, expect_shape=expect_shape, expect_classes=expect_classes)
    )
    if splits is None:
        splits = build()
        if path is not None:
            problem = entry_problem(splits)
            if problem is None:
                write_entry(path, key, splits)
            else:
                logger.warning("node data not cached in %s: %s", path, problem)
    else:
        logger.debug("node data read from %s", path)
    memory.put(key, splits)
    return splits


def node_partition_data(
    source: DatasetSpec | str,
    *,
    partition_id: int,
    num_partitions: int,
    partition: PartitionConfig,
    pool_fraction: float,
    test_fraction: float,
    cache_dir: Path | str | None = None,
    load: Callable[[DatasetSpec], DataBundle] = load_bundle,
    memory: MemoryCache | None = None,
    expect_shape: tuple[int, ...] | None = None,
    expect_classes: int | None = None,
) -> NodeSplits:
    """Return one partition's local splits (:func:`client_data`), cached.

    Parameters
    ----------
    source : DatasetSpec or str
        The dataset.
    partition_id, num_partitions : int
        Which partition of how many.
    partition : PartitionConfig
        Scheme and seed (must equal the server's).
    pool_fraction, test_fraction : float
        Server-pool and local-test shares.
    cache_dir : pathlib.Path or str, optional
        The node's cache folder (:func:`node_cache_dir`); memory only without it.
    load : Callable[[DatasetSpec], DataBundle], optional
        Loads the whole dataset on a miss (:func:`load_bundle`).
    memory : MemoryCache, optional
        The in-process cache; this process's own by default.
    expect_shape : tuple of int, optional
        The sample shape the federation trains on: a cached entry of another
        shape is discarded and rebuilt.
    expect_classes : int, optional
        The federation's class count: a cached entry with more is rebuilt.

    Returns
    -------
    NodeSplits
        Train and local test data, the dataset's class count and sample shape.

    Raises
    ------
    DataError
        If the spec is invalid or building the splits fails.
    """
    spec = parse_dataset_spec(source) if isinstance(source, str) else source

    def build() -> NodeSplits:
        federation = federation_of(
            partition_key(
                spec,
                partition_id=-1,  # the whole federation
                num_partitions=num_partitions,
                partition=partition,
                pool_fraction=pool_fraction,
                test_fraction=0.0,
            ),
            lambda: federation_partitions(
                load(spec),
                num_partitions=num_partitions,
                partition=partition,
                pool_fraction=pool_fraction,
            ),
        )
        train, test = federation.client_split(partition_id, test_fraction=test_fraction)
        return NodeSplits(train, test, federation.num_classes, federation.input_shape)

    key = partition_key(
        spec,
        partition_id=partition_id,
        num_partitions=num_partitions,
        partition=partition,
        pool_fraction=pool_fraction,
        test_fraction=test_fraction,
    )
    return cached(
        key,
        build,
        cache_dir=cache_dir,
        memory=memory,
        expect_shape=expect_shape,
        expect_classes=expect_classes,
    )


def node_local_data(
    path: str,
    *,
    test_fraction: float,
    seed: int,
    num_classes: int | None = None,
    cache_dir: Path | str | None = None,
    memory: MemoryCache | None = None,
    expect_shape: tuple[int, ...] | None = None,
    expect_classes: int | None = None,
) -> NodeSplits:
    """Return a node's own data file split into train and test (:func:`local_data`), cached.

    Parameters
    ----------
    path : str
        The ``.npz`` file (node-config ``data-path``).
    test_fraction : float
        Local-test share when the file has no test split.
    seed : int
        Split seed.
    num_classes : int, optional
        The federation's class count, to check the labels against.
    cache_dir : pathlib.Path or str, optional
        The node's cache folder (:func:`node_cache_dir`); memory only without it.
    memory : MemoryCache, optional
        The in-process cache; this process's own by default.
    expect_shape : tuple of int, optional
        The sample shape the federation trains on: a cached entry of another
        shape is discarded and rebuilt.
    expect_classes : int, optional
        The federation's class count, when known but not given as ``num_classes``
        (which is part of the key and changes how labels are counted): a cached
        entry with more classes is discarded and rebuilt. ``num_classes`` is
        expected by default.

    Returns
    -------
    NodeSplits
        Train and test data, the class count and the sample shape.

    Raises
    ------
    DataError
        If the file is missing or malformed or a label is out of range.
    """

    def build() -> NodeSplits:
        train, test, classes, shape = local_data(
            path, test_fraction=test_fraction, seed=seed, num_classes=num_classes
        )
        return NodeSplits(train, test, classes, tuple(shape))

    key = local_file_key(path, test_fraction=test_fraction, seed=seed, num_classes=num_classes)
    if num_classes is not None:
        expect_classes = num_classes if expect_classes is None else min(num_classes, expect_classes)
    return cached(
        key,
        build,
        cache_dir=cache_dir,
        memory=memory,
        expect_shape=expect_shape,
        expect_classes=expect_classes,
    )
