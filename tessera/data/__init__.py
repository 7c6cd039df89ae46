"""Datasets, server pool, federated partitions and per-client splits.

Everything here is a pure, seeded function of its arguments: the ServerApp and
every ClientApp compute the same partitions independently from the same
``(dataset, num_partitions, PartitionConfig, pool_fraction)``; nothing is
exchanged to agree on them.

The pipeline is::

    load_bundle(spec)                  -> DataBundle (train split, test split)
    split_server_pool(bundle, ...)     -> client pool | server pool   (disjoint)
    partition_indices(client_pool.y)   -> one index array per client   (disjoint)
    client_data(...)                   -> that client's train | local test split

The modules, one concern each:

- :mod:`tessera.data.arrays`: :class:`ArrayDataset`, :class:`DataBundle`,
  :class:`DataError`, validation and conversion of sample and label arrays;
- :mod:`tessera.data.spec`: :class:`DatasetSpec`, :func:`parse_dataset_spec`,
  :class:`PartitionConfig`;
- :mod:`tessera.data.loaders`: :func:`load_bundle` (digits, ``.npz``, hub);
- :mod:`tessera.data.partition`: the server pool and the partitioners;
- :mod:`tessera.data.splits`: one node's data, :func:`client_data` and
  :func:`local_data`;
- :mod:`tessera.data.plot`: :func:`plot_label_distribution`;
- :mod:`tessera.data.cache`: a node's data kept across messages, in memory and in
  ``<state-dir>/.data-cache`` (:func:`node_partition_data`, :func:`node_local_data`);
  its keys in :mod:`tessera.data.cache_keys`, its entries on disk in
  :mod:`tessera.data.cache_entry`, in memory in :mod:`tessera.data.cache_memory`.

Nothing here imports scikit-learn, flwr-datasets, datasets or matplotlib at import
time: a deployed ClientApp is a fresh process per message, and those load only in
the functions that need them (digits, hub datasets, partitioners, splits, plots).

Dataset specs (:func:`parse_dataset_spec`):

``digits``
    scikit-learn's bundled 8x8 digits (no download), 1797 images, 10 classes,
    a fixed stratified 80/20 train/test split (seed 0).
``npz:<path>``
    A NumPy ``.npz`` with ``x_train``, ``y_train``, ``x_test``, ``y_test``
    (and optionally ``layout``).
``hf:<name>`` or a known short name
    A Hugging Face hub dataset loaded through ``flwr_datasets.FederatedDataset``.
    Short names: ``cifar10`` (``uoft-cs/cifar10``), ``cifar100``
    (``uoft-cs/cifar100``, fine labels), ``fashion_mnist``
    (``zalando-datasets/fashion_mnist``), ``mnist`` (``ylecun/mnist``). A bare
    ``owner/name`` is passed through as a hub id.

Array layout: ``x`` is float32 with shape ``(N, D)`` for vectors, ``(N, C, L)``
for 1-D (multi-channel) signals or ``(N, C, H, W)`` for images; ``y`` is int64 in
``[0, num_classes)``. An ``.npz`` of signals names its axes in an optional string
array ``layout`` (``"NCL"``, or ``"NLC"`` for channels-last), since a 3-D array is
otherwise read as ``(N, H, W)`` grayscale images.
"""

from tessera.data.arrays import ArrayDataset, DataBundle, DataError, validate_labels
from tessera.data.cache import node_cache_dir, node_local_data, node_partition_data
from tessera.data.loaders import arrays_from_hf, bundle_from_hf, detect_hf_columns, load_bundle
from tessera.data.partition import partition_indices, server_pool_indices, split_server_pool
from tessera.data.plot import plot_label_distribution
from tessera.data.spec import DatasetSpec, PartitionConfig, parse_dataset_spec
from tessera.data.splits import NodeSplits, client_data, local_data, split_local

__all__ = [
    "ArrayDataset",
    "DataBundle",
    "DataError",
    "DatasetSpec",
    "NodeSplits",
    "PartitionConfig",
    "arrays_from_hf",
    "bundle_from_hf",
    "client_data",
    "detect_hf_columns",
    "load_bundle",
    "local_data",
    "node_cache_dir",
    "node_local_data",
    "node_partition_data",
    "parse_dataset_spec",
    "partition_indices",
    "plot_label_distribution",
    "server_pool_indices",
    "split_local",
    "split_server_pool",
    "validate_labels",
]
