"""One node's data: its partition's local train/test split, or its own data file."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tessera.data.arrays import (
    ArrayDataset,
    DataBundle,
    DataError,
    IntArray,
    as_labels,
    label_gap_message,
    split_arrays,
    validate_labels,
)
from tessera.data.loaders import load_bundle, npz_layout, read_npz
from tessera.data.partition import (
    check_fraction,
    partition_indices,
    split_server_pool,
    two_way_split,
)
from tessera.data.spec import DatasetSpec, PartitionConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class NodeSplits:
    """One node's data, as it trains and tests on it.

    Parameters
    ----------
    train : ArrayDataset
        Local training data (at least one sample).
    test : ArrayDataset
        Local test data (may be empty for a tiny partition).
    num_classes : int
        The dataset's class count (a partition's own labels may cover fewer).
    input_shape : tuple of int
        Shape of one sample.
    """

    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    input_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes held by the four arrays."""
        return int(
            self.train.x.nbytes + self.train.y.nbytes + self.test.x.nbytes + self.test.y.nbytes
        )


def split_local(
    labels: npt.ArrayLike, *, test_fraction: float, seed: int
) -> tuple[IntArray, IntArray]:
    """Split one client's samples into local train and local test indices.

    ``round(test_fraction * n)`` samples go to test, capped at ``n - 1`` so the
    client always trains on at least one sample. A partition too small for that
    (``n == 1``, or a fraction that rounds to 0) keeps everything for training
    and gets an empty local test set; nothing is duplicated. The split is
    stratified when every class can appear on both sides.

    Parameters
    ----------
    labels : array_like of int
        The client's labels.
    test_fraction : float
        Share for local test, in ``[0, 1)``.
    seed : int
        Split seed.

    Returns
    -------
    tuple of numpy.ndarray
        Sorted ``(train_indices, test_indices)``.

    Raises
    ------
    DataError
        If ``test_fraction`` is out of range or there are no samples.
    """
    check_fraction(test_fraction, name="test_fraction")
    y = as_labels(np.asarray(labels), what="client labels")
    n = int(y.shape[0])
    if n == 0:
        raise DataError("cannot split an empty partition; every client needs data")
    n_test = min(round(test_fraction * n), n - 1)
    return two_way_split(y, n_test, seed)


def _as_bundle(source: DataBundle | DatasetSpec | str) -> DataBundle:
    return source if isinstance(source, DataBundle) else load_bundle(source)


def _client_seed(seed: int, partition_id: int) -> int:
    """Derive a per-client split seed, identical in every process."""
    state = np.random.SeedSequence([seed, partition_id]).generate_state(1)
    return int(state[0])


def client_data(
    source: DataBundle | DatasetSpec | str,
    *,
    partition_id: int,
    num_partitions: int,
    partition: PartitionConfig,
    pool_fraction: float,
    test_fraction: float,
) -> tuple[ArrayDataset, ArrayDataset]:
    """Return one client's local train and local test data.

    The client's partition (see :func:`partition_indices`) is split with
    :func:`split_local`; the local test set may be empty for a tiny partition.

    Parameters
    ----------
    source : DataBundle, DatasetSpec or str
        The dataset, or a spec to load it from.
    partition_id : int
        This client's partition, in ``[0, num_partitions)``.
    num_partitions : int
        Number of client partitions.
    partition : PartitionConfig
        Partitioning scheme and seed (must equal the server's).
    pool_fraction : float
        Share of the training split held out as the server pool.
    test_fraction : float
        Share of the partition used as local test, in ``[0, 1)``.

    Returns
    -------
    tuple of ArrayDataset
        ``(train, test)``, disjoint, with at least one training sample.

    Raises
    ------
    DataError
        If ``partition_id`` is out of range or any step fails.
    """
    if not 0 <= partition_id < num_partitions:
        raise DataError(
            f"partition_id={partition_id} is out of range for num_partitions="
            f"{num_partitions}; use 0..{num_partitions - 1} (check the node config "
            "'partition-id' against the run config)"
        )
    check_fraction(test_fraction, name="test_fraction")
    federation = federation_partitions(
        _as_bundle(source),
        num_partitions=num_partitions,
        partition=partition,
        pool_fraction=pool_fraction,
    )
    return federation.client_split(partition_id, test_fraction=test_fraction)


@dataclass(frozen=True)
class FederationPartitions:
    """The part of :func:`client_data` every node of a federation computes alike.

    The client pool (the training split minus the server pool) and every partition's
    indices into it; :meth:`client_split` then cuts one client's data from them.
    Computing this once per process and reusing it for every node (a simulation
    worker serves hundreds of nodes) makes a node's data cost a slice, not a
    re-partitioning of the whole data set.
    """

    client_pool: ArrayDataset
    parts: tuple[IntArray, ...]
    seed: int
    num_classes: int
    input_shape: tuple[int, ...]

    def client_split(
        self, partition_id: int, *, test_fraction: float
    ) -> tuple[ArrayDataset, ArrayDataset]:
        """Return partition ``partition_id``'s local train and test data."""
        if not 0 <= partition_id < len(self.parts):
            raise DataError(
                f"partition_id={partition_id} is out of range for num_partitions="
                f"{len(self.parts)}; use 0..{len(self.parts) - 1}"
            )
        own = self.client_pool.subset(self.parts[partition_id])
        train_idx, test_idx = split_local(
            own.y,
            test_fraction=test_fraction,
            seed=_client_seed(self.seed, partition_id),
        )
        return own.subset(train_idx), own.subset(test_idx)


def federation_partitions(
    bundle: DataBundle,
    *,
    num_partitions: int,
    partition: PartitionConfig,
    pool_fraction: float,
) -> FederationPartitions:
    """Split off the server pool and partition the rest (the federation-wide steps).

    Parameters
    ----------
    bundle : DataBundle
        The dataset.
    num_partitions : int
        Number of client partitions.
    partition : PartitionConfig
        Partitioning scheme and seed (must equal the server's).
    pool_fraction : float
        Share of the training split held out as the server pool.

    Returns
    -------
    FederationPartitions
        The client pool and every partition's indices into it.
    """
    client_pool, _ = split_server_pool(bundle, pool_fraction=pool_fraction, seed=partition.seed)
    parts = partition_indices(client_pool.y, num_partitions=num_partitions, config=partition)
    return FederationPartitions(
        client_pool=client_pool,
        parts=tuple(parts),
        seed=partition.seed,
        num_classes=bundle.num_classes,
        input_shape=bundle.input_shape,
    )


def local_data(
    path: str,
    *,
    test_fraction: float,
    seed: int,
    num_classes: int | None = None,
) -> tuple[ArrayDataset, ArrayDataset, int, tuple[int, ...]]:
    """Load a device's own data (node config ``data-path``).

    The file has the npz format of ``npz:<path>``. When ``x_test``/``y_test``
    are absent, ``x_train`` is split with :func:`split_local` (seeded,
    stratified when possible).

    Parameters
    ----------
    path : str
        Path of the ``.npz`` file.
    test_fraction : float
        Share of ``x_train`` used as local test when the file has no test split.
    seed : int
        Seed of that split.
    num_classes : int, optional
        The federation's class count; labels are checked against it. Without
        it, the count is the largest label + 1 in the file.

    Returns
    -------
    tuple
        ``(train, test, num_classes, input_shape)``.

    Raises
    ------
    DataError
        If the file is missing or malformed or a label is out of range.
    """
    file = Path(path)
    arrays = read_npz(file)
    for required in ("x_train", "y_train"):
        if required not in arrays:
            raise DataError(
                f"data file {path!r} lacks array {required!r}; it has "
                f"{sorted(arrays)}. Save it with np.savez(path, x_train=..., "
                "y_train=...) (x_test/y_test optional)"
            )
    has_test = ["x_test" in arrays, "y_test" in arrays]
    if any(has_test) and not all(has_test):
        present = "x_test" if has_test[0] else "y_test"
        raise DataError(
            f"data file {path!r} has {present!r} but not its partner; save both "
            "x_test and y_test, or neither to split x_train"
        )
    layout = npz_layout(arrays, file)
    x_train, y_train = split_arrays(
        arrays["x_train"], arrays["y_train"], what=f"{file.name} train", layout=layout
    )
    if all(has_test):
        x_test, y_test = split_arrays(
            arrays["x_test"], arrays["y_test"], what=f"{file.name} test", layout=layout
        )
        if x_test.shape[1:] != x_train.shape[1:]:
            raise DataError(
                f"data file {path!r}: train samples have shape {x_train.shape[1:]} "
                f"but test samples have shape {x_test.shape[1:]}; both must match"
            )
    else:
        x_test, y_test = x_train[:0], y_train[:0]
    if num_classes is None:
        # A node may hold only some of the federation's classes (non-IID), so
        # gaps are allowed here; the federation's count is checked at handshake.
        labels_found = np.unique(np.concatenate([y_train, y_test]))
        num_classes = int(labels_found[-1]) + 1
        gaps = label_gap_message(labels_found, what=f"data file {path!r}")
        if gaps is not None:
            logger.warning(
                "%s. Using %d classes; if the labels are not the federation's class "
                "indices 0..C-1, remap them",
                gaps,
                num_classes,
            )
    validate_labels(y_train, num_classes, what=f"{file.name} train labels")
    validate_labels(y_test, num_classes, what=f"{file.name} test labels")
    train = ArrayDataset(x=x_train, y=y_train)
    if all(has_test):
        test = ArrayDataset(x=x_test, y=y_test)
    else:
        train_idx, test_idx = split_local(y_train, test_fraction=test_fraction, seed=seed)
        train, test = train.subset(train_idx), train.subset(test_idx)
    return train, test, num_classes, train.input_shape
