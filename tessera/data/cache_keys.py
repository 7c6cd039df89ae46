"""The keys of the node-data cache: everything a node's data depends on.

A key (:func:`partition_key`, :func:`local_file_key`) is a canonical JSON text of
everything the result depends on: the cache format version (:data:`CACHE_FORMAT`),
the dataset spec, for a file its resolved path, size, modification and change times
(:func:`file_fingerprint`), the partitioning
(:class:`~tessera.data.spec.PartitionConfig`, seed included, the partition count,
the partition id, the server-pool and local-test fractions), and the versions of the
libraries that compute the splits (:data:`LIBRARIES`), since a new version may split
differently and a node's cached partition must stay the one the server computes.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import cache
from pathlib import Path
from typing import Any

from tessera.data.spec import DatasetSpec, PartitionConfig

CACHE_FORMAT = 1
"""Version of the cache's key and file layout; bump it when either changes."""
LIBRARIES = ("numpy", "scikit-learn", "flwr-datasets", "datasets")
"""Distributions whose version is part of every key."""


def library_versions() -> dict[str, str]:
    """Return the installed version of each of :data:`LIBRARIES` (without importing them).

    Read once per process: each lookup parses the distribution's metadata (about 3 ms),
    and every message a simulation worker serves builds keys, so reading them per key
    cost a 1,000-node round about 6 s of client time. Within a process the libraries
    that split the data are those it loaded, whatever is installed later.
    """
    return dict(_installed_versions())


@cache
def _installed_versions() -> tuple[tuple[str, str], ...]:
    from importlib import metadata  # here: tens of milliseconds where nothing loaded it yet

    versions = []
    for name in LIBRARIES:
        try:
            versions.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            versions.append((name, "absent"))
    return tuple(versions)


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
