"""One entry of the node-data cache on disk: its file, format, checks and pruning.

An entry is one ``node-data-<digest>.npz`` per key (:func:`cache_file`), numeric
arrays only (read back with ``allow_pickle=False``) plus the key itself, so a
changed key never reads an old entry. :func:`write_entry` writes it to a temporary
file and renames it into place, then keeps at most :data:`MAX_DISK_ENTRIES` entries,
the least recently used removed first. :func:`read_entry` checks an entry before
use, since a node must never fail every round because of what it stored: its sizes
are bounded by the file's own before anything is read
(:func:`tessera.state_checks.read_npz`), its arrays must have their dtypes and
ranks, agree with each other, declare a sample shape of positive dimensions and a
class count above every label and at most :data:`MAX_CLASSES` (checked before
anything is sized by them), hold finite samples and labels in range, and, when the
caller says what the federation trains on, match it (:func:`entry_problem`). An
entry that fails is logged and deleted, and the caller rebuilds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from tessera.data.arrays import ArrayDataset, DataError, validate_labels
from tessera.data.splits import NodeSplits
from tessera.state_checks import read_npz

# The cache's one logger: its messages keep the name they are filtered by.
logger = logging.getLogger("tessera.data.cache")

FILE_PREFIX = "node-data-"
MAX_DISK_ENTRIES = 4
"""Cache files kept per node (a node rarely needs more than its current run's)."""
STALE_TMP_SECONDS = 3600.0
"""Age after which a temporary file left by a killed writer is removed."""
ENTRY_ARRAYS = ("key", "x_train", "y_train", "x_test", "y_test", "num_classes", "input_shape")
MAX_CLASSES = 100_000
"""The most classes an entry may declare: more than any classification task a node
trains on (ImageNet-21k has 21,841), and few enough that what is sized by it (the
handshake's label counts, a model's head) stays small. A class count is only a
number in the file: without a bound, 8 bytes could make every message allocate
terabytes."""


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
    """Rebuild the splits from a cache file's arrays, checking they are consistent.

    The class count must lie in ``[1, MAX_CLASSES]`` and above every label, and
    every dimension of the sample shape must be positive, before anything is sized
    by them.
    """
    num_classes = _scalar_int(arrays["num_classes"], what="class count")
    if not 1 <= num_classes <= MAX_CLASSES:
        raise DataError(
            f"it declares {num_classes} classes, outside [1, {MAX_CLASSES}] (MAX_CLASSES)"
        )
    shape = arrays["input_shape"]
    if shape.ndim != 1 or shape.dtype.kind not in "iu" or not 1 <= len(shape) <= 3:
        raise DataError(f"its input shape is {shape.dtype} {shape.shape}, not 1 to 3 integers")
    input_shape = tuple(int(d) for d in shape)
    if min(input_shape) < 1:
        raise DataError(f"its input shape {input_shape} has a dimension below 1")
    train = ArrayDataset(x=arrays["x_train"], y=arrays["y_train"])
    test = ArrayDataset(x=arrays["x_test"], y=arrays["y_test"])
    if len(train) == 0:
        raise DataError("it holds no training samples")
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
