"""A node's data, loaded and split once and reused across messages.

Every message a node handles needs its data: its partition (load the whole
dataset, hold out the server pool, run the partitioner, split locally) or its own
``data-path`` file (read, convert, split). In deployment Flower starts a fresh
ClientApp process for every message, so without a cache each message pays all of
that again. :func:`node_partition_data` and :func:`node_local_data` keep the result

- in memory, per process (:class:`~tessera.data.cache_memory.MemoryCache`, bounded
  in entries and bytes; :mod:`tessera.data.cache_memory`): a simulation worker
  process serves many messages;
- on disk, per node, in ``<state-dir>/.data-cache/`` (node-config ``state-dir``,
  see :func:`node_cache_dir`; without one nothing is written): one
  ``node-data-<digest>.npz`` per key, numeric arrays only (read back with
  ``allow_pickle=False``), written to a temporary file and renamed into place
  (:mod:`tessera.data.cache_entry`).

The key (:func:`~tessera.data.cache_keys.partition_key`,
:func:`~tessera.data.cache_keys.local_file_key`; :mod:`tessera.data.cache_keys`) is
a canonical JSON text of everything the result depends on: the cache format version,
the dataset spec, for a file its resolved path, size, modification and change times,
the partitioning (:class:`~tessera.data.spec.PartitionConfig`, seed included, the
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
most :data:`~tessera.data.cache_entry.MAX_DISK_ENTRIES` entries are kept, the least
recently used removed first.

A hub dataset (``hf:<id>``) is keyed by its id: a hub dataset that changes under
the same id is not noticed (clear the folder). A data file replaced by one of
the same size with both its times restored is not noticed either (the change
time cannot be set by a user, so this takes a restored backup of the whole disk).

The arrays returned are shared with later calls: copy before changing them in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from tessera.data.arrays import DataBundle
from tessera.data.cache_entry import cache_file, entry_problem, read_entry, write_entry
from tessera.data.cache_keys import local_file_key, partition_key
from tessera.data.cache_memory import MemoryCache, federation_of, process_cache
from tessera.data.loaders import load_bundle
from tessera.data.spec import DatasetSpec, PartitionConfig, parse_dataset_spec
from tessera.data.splits import NodeSplits, federation_partitions, local_data

logger = logging.getLogger(__name__)

CACHE_DIR_NAME = ".data-cache"
"""The cache folder inside node-config ``state-dir``. A federation id (the state's
other folders) cannot start with ``.``, so the names never collide."""


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
    memory = process_cache() if memory is None else memory
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
