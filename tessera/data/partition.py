"""The server pool and the federated partitions of the client pool.

Pure, seeded functions: the ServerApp and every ClientApp compute the same pool
split and partitions independently from the same arguments.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from tessera.data.arrays import ArrayDataset, DataBundle, DataError, IntArray, as_labels
from tessera.data.spec import PartitionConfig

if TYPE_CHECKING:
    import datasets
    from flwr_datasets.partitioner import Partitioner

logger = logging.getLogger(__name__)


def check_fraction(value: float, *, name: str) -> None:
    """Raise :class:`DataError` unless ``value`` (named ``name``) is in ``[0, 1)``."""
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise DataError(f"{name}={value!r} must be in [0, 1); e.g. 0.1")


def two_way_split(labels: IntArray, n_second: int, seed: int) -> tuple[IntArray, IntArray]:
    """Split ``arange(len(labels))`` into two sorted index sets.

    Stratified by label when every class can appear on both sides, otherwise a
    plain seeded random split.
    """
    from sklearn.model_selection import train_test_split

    n = int(labels.shape[0])
    everything = np.arange(n, dtype=np.int64)
    if n_second == 0:
        return everything, np.empty(0, dtype=np.int64)
    try:
        first, second = train_test_split(
            everything, test_size=n_second, stratify=labels, random_state=seed
        )
    except ValueError:
        logger.debug("stratified split of %d samples impossible; splitting randomly", n)
        first, second = train_test_split(everything, test_size=n_second, random_state=seed)
    return np.sort(first).astype(np.int64), np.sort(second).astype(np.int64)


def split_server_pool(
    bundle: DataBundle, *, pool_fraction: float, seed: int
) -> tuple[ArrayDataset, ArrayDataset]:
    """Hold out part of the training split for the server.

    Parameters
    ----------
    bundle : DataBundle
        The whole dataset.
    pool_fraction : float
        Share of the training split kept by the server, in ``[0, 1)``. A
        positive fraction keeps at least one sample; 0 gives an empty pool.
    seed : int
        Seed of the (stratified when possible) split.

    Returns
    -------
    tuple of ArrayDataset
        ``(client_pool, server_pool)``, disjoint, together the training split.

    Raises
    ------
    DataError
        If ``pool_fraction`` is out of range or leaves no data for clients.
    """
    client_idx, pool_idx = server_pool_indices(
        bundle.train.y, pool_fraction=pool_fraction, seed=seed
    )
    return bundle.train.subset(client_idx), bundle.train.subset(pool_idx)


def server_pool_indices(
    labels: npt.ArrayLike, *, pool_fraction: float, seed: int
) -> tuple[IntArray, IntArray]:
    """Return row indices of the client pool and the server pool.

    See :func:`split_server_pool`.

    Parameters
    ----------
    labels : array_like of int
        Labels of the training split.
    pool_fraction : float
        Share kept by the server, in ``[0, 1)``.
    seed : int
        Split seed.

    Returns
    -------
    tuple of numpy.ndarray
        Sorted ``(client_indices, server_indices)``.

    Raises
    ------
    DataError
        If ``pool_fraction`` is out of range or leaves no data for clients.
    """
    check_fraction(pool_fraction, name="pool_fraction")
    y = as_labels(np.asarray(labels), what="training labels")
    n = int(y.shape[0])
    n_pool = 0 if pool_fraction == 0 else max(1, round(pool_fraction * n))
    if n - n_pool < 1:
        raise DataError(
            f"pool_fraction={pool_fraction} of {n} training samples leaves no data "
            "for the clients; lower pool_fraction"
        )
    return two_way_split(y, n_pool, seed)


@contextmanager
def _warnings_to_log() -> Iterator[None]:
    """Route warnings raised by flwr-datasets partitioners to this module's log."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for item in caught:
        logger.warning("flwr-datasets: %s", item.message)


def _make_partitioner(
    num_partitions: int, config: PartitionConfig, *, min_partition_size: int
) -> Partitioner:
    """Build the flwr-datasets partitioner of ``config``."""
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    if config.scheme == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if config.scheme == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=config.alpha,
            min_partition_size=min_partition_size,
            self_balancing=config.self_balancing,
            shuffle=True,
            seed=config.seed,
        )
    return PathologicalPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        num_classes_per_partition=config.classes_per_client,
        class_assignment_mode=config.class_assignment,
        shuffle=True,
        seed=config.seed,
    )


def _run_partitioner(
    dataset: datasets.Dataset,
    num_partitions: int,
    config: PartitionConfig,
    *,
    min_partition_size: int,
) -> list[IntArray]:
    partitioner = _make_partitioner(num_partitions, config, min_partition_size=min_partition_size)
    partitioner.dataset = dataset
    parts = []
    for pid in range(num_partitions):
        rows = partitioner.load_partition(pid).with_format("numpy")[:]["idx"]
        parts.append(np.sort(np.asarray(rows, dtype=np.int64)))
    return parts


def partition_indices(
    labels: npt.ArrayLike, *, num_partitions: int, config: PartitionConfig
) -> list[IntArray]:
    """Split sample indices across clients with a flwr-datasets partitioner.

    ``iid`` shuffles with ``config.seed`` and shards contiguously
    (``IidPartitioner``); ``dirichlet`` uses ``DirichletPartitioner`` on the
    label; ``pathological`` uses ``PathologicalPartitioner`` with
    ``config.classes_per_client`` classes per partition. The result depends only
    on ``labels``, ``num_partitions`` and ``config``.

    Parameters
    ----------
    labels : array_like of int
        Labels of the client pool, shape ``(N,)``.
    num_partitions : int
        Number of clients.
    config : PartitionConfig
        Scheme and seed.

    Returns
    -------
    list of numpy.ndarray
        ``num_partitions`` sorted, disjoint int64 arrays of row indices into
        ``labels``. Their union covers every row, except classes that a
        pathological assignment gives to no partition (logged as a warning).

    Raises
    ------
    DataError
        If there are more partitions than samples, ``classes_per_client``
        exceeds the number of classes, or a partition would hold fewer than
        ``config.min_partition_size`` samples.
    """
    y = as_labels(np.asarray(labels), what="partition labels")
    n = int(y.shape[0])
    if num_partitions < 1:
        raise DataError(f"num_partitions={num_partitions} must be >= 1")
    if num_partitions > n:
        raise DataError(
            f"num_partitions={num_partitions} exceeds the {n} samples in the client "
            f"pool; use at most {n} partitions, a larger dataset or a smaller "
            "pool_fraction"
        )
    num_present = int(np.unique(y).shape[0])
    if config.scheme == "pathological" and config.classes_per_client > num_present:
        raise DataError(
            f"classes_per_client={config.classes_per_client} exceeds the "
            f"{num_present} classes present in the client pool; use at most "
            f"{num_present}"
        )
    import datasets

    dataset = datasets.Dataset.from_dict({"label": y, "idx": np.arange(n, dtype=np.int64)})
    if config.scheme == "iid":
        dataset = dataset.shuffle(seed=config.seed)
    with _warnings_to_log():
        try:
            parts = _run_partitioner(
                dataset,
                num_partitions,
                config,
                min_partition_size=config.min_partition_size,
            )
        except ValueError as exc:
            raise _partition_failure(dataset, num_partitions, config, exc) from exc
    for pid, part in enumerate(parts):
        if part.shape[0] < config.min_partition_size:
            raise DataError(
                f"partition {pid} of {num_partitions} ({config.scheme}) has "
                f"{part.shape[0]} samples, fewer than min_partition_size="
                f"{config.min_partition_size}; use fewer partitions, a larger alpha, "
                "or the iid scheme"
            )
    return parts


def _partition_failure(
    dataset: datasets.Dataset,
    num_partitions: int,
    config: PartitionConfig,
    exc: ValueError,
) -> DataError:
    """Turn a flwr-datasets failure into a DataError naming a partition if possible."""
    if config.scheme != "dirichlet":
        return DataError(
            f"{config.scheme} partitioning into {num_partitions} partitions failed: "
            f"{exc}. Use fewer partitions or fewer classes_per_client"
        )
    # Redraw once without the size constraint (same seed, so the same first draw)
    # to name the partition that ended up too small.
    with _warnings_to_log():
        first_draw = _run_partitioner(dataset, num_partitions, config, min_partition_size=0)
    sizes = [int(p.shape[0]) for p in first_draw]
    pid = int(np.argmin(sizes))
    return DataError(
        f"dirichlet partitioning (alpha={config.alpha}, seed={config.seed}) could "
        f"not give all {num_partitions} partitions at least "
        f"{config.min_partition_size} samples in 10 draws; e.g. partition {pid} got "
        f"{sizes[pid]} samples in the first draw. Use fewer partitions, a larger "
        "alpha, or the iid scheme"
    )
