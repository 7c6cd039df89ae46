"""Datasets, server pool, federated partitions and per-client splits.

Everything in this module is a pure, seeded function of its arguments: the
ServerApp and every ClientApp compute the same partitions independently from the
same ``(dataset, num_partitions, PartitionConfig, pool_fraction)``; nothing is
written to disk or exchanged to agree on them.

The pipeline is::

    load_bundle(spec)                  -> DataBundle (train split, test split)
    split_server_pool(bundle, ...)     -> client pool | server pool   (disjoint)
    partition_indices(client_pool.y)   -> one index array per client   (disjoint)
    client_data(...)                   -> that client's train | local test split

Dataset specs (:func:`parse_dataset_spec`):

``digits``
    scikit-learn's bundled 8x8 digits (no download), 1797 images, 10 classes,
    a fixed stratified 80/20 train/test split (seed 0).
``npz:<path>``
    A NumPy ``.npz`` with ``x_train``, ``y_train``, ``x_test``, ``y_test``.
``hf:<name>`` or a known short name
    A Hugging Face hub dataset loaded through ``flwr_datasets.FederatedDataset``.
    Short names: ``cifar10`` (``uoft-cs/cifar10``), ``cifar100``
    (``uoft-cs/cifar100``, fine labels), ``fashion_mnist``
    (``zalando-datasets/fashion_mnist``), ``mnist`` (``ylecun/mnist``). A bare
    ``owner/name`` is passed through as a hub id.

Array layout: ``x`` is float32 with shape ``(N, C, H, W)`` for images or
``(N, D)`` for vectors; ``y`` is int64 in ``[0, num_classes)``.
"""

from __future__ import annotations

import logging
import math
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import numpy.typing as npt
from flwr_datasets import FederatedDataset
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    Partitioner,
    PathologicalPartitioner,
)
from matplotlib import colormaps
from matplotlib.figure import Figure
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]

SCHEMES = ("iid", "dirichlet", "pathological")
CLASS_ASSIGNMENT_MODES = ("deterministic", "random", "first-deterministic")
HF_ALIASES: Mapping[str, str] = {
    "cifar10": "uoft-cs/cifar10",
    "cifar100": "uoft-cs/cifar100",
    "fashion_mnist": "zalando-datasets/fashion_mnist",
    "mnist": "ylecun/mnist",
}
HF_IMAGE_COLUMNS = ("img", "image")
HF_LABEL_COLUMNS = ("label", "fine_label", "labels")
NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
NPZ_HOWTO = "save it with np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)"
NPY_MAGIC = b"\x93NUMPY"
"""First bytes of a single-array ``.npy`` file (what ``np.save`` writes)."""
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
"""First bytes of a zip archive (an ``.npz``) with entries, and of an empty one."""
CHANNEL_COUNTS = (1, 3, 4)
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
SPEC_FORMS = (
    "'digits', 'npz:<path to .npz>', 'hf:<hub dataset id>', a hub id "
    f"'owner/name', or one of {sorted(HF_ALIASES)}"
)


class DataError(ValueError):
    """A dataset, data file or data-related setting is unusable.

    The message names the offending value and how to fix it.
    """


# --------------------------------------------------------------------------- #
# Containers
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Samples and labels held in memory.

    Parameters
    ----------
    x : numpy.ndarray
        float32 samples, shape ``(N, C, H, W)`` for images or ``(N, D)`` for vectors.
    y : numpy.ndarray
        int64 labels, shape ``(N,)``.

    Raises
    ------
    DataError
        If the dtypes, ranks or lengths are wrong.
    """

    x: FloatArray
    y: IntArray

    def __post_init__(self) -> None:
        """Check dtypes, ranks and lengths."""
        if not isinstance(self.x, np.ndarray) or self.x.dtype != np.float32:
            raise DataError(
                f"ArrayDataset.x must be a float32 numpy array, got "
                f"{type(self.x).__name__} of dtype {getattr(self.x, 'dtype', None)}; "
                "convert with x.astype(np.float32)"
            )
        if not isinstance(self.y, np.ndarray) or self.y.dtype != np.int64:
            raise DataError(
                f"ArrayDataset.y must be an int64 numpy array, got "
                f"{type(self.y).__name__} of dtype {getattr(self.y, 'dtype', None)}; "
                "convert with y.astype(np.int64)"
            )
        if self.x.ndim < 2:
            raise DataError(
                f"ArrayDataset.x has shape {self.x.shape}; it needs a sample axis "
                "and at least one feature axis, e.g. (N, D) or (N, C, H, W)"
            )
        if self.y.ndim != 1 or self.y.shape[0] != self.x.shape[0]:
            raise DataError(
                f"ArrayDataset.y has shape {self.y.shape} but x has "
                f"{self.x.shape[0]} samples; y must have shape ({self.x.shape[0]},)"
            )

    def __len__(self) -> int:
        """Return the number of samples."""
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, ``(C, H, W)`` or ``(D,)``."""
        return tuple(int(d) for d in self.x.shape[1:])

    def subset(self, indices: npt.ArrayLike) -> ArrayDataset:
        """Return the samples at ``indices`` (a copy).

        Parameters
        ----------
        indices : array_like of int
            Row indices into this dataset.

        Returns
        -------
        ArrayDataset
            The selected rows, in the order given.
        """
        idx = np.asarray(indices, dtype=np.int64)
        return ArrayDataset(x=self.x[idx], y=self.y[idx])


@dataclass(frozen=True, eq=False)
class DataBundle:
    """A whole dataset before federation.

    Parameters
    ----------
    train : ArrayDataset
        The dataset's training split (client pool plus server pool).
    test : ArrayDataset
        The dataset's test split, used as the global test set.
    num_classes : int
        Number of classes; every label is in ``[0, num_classes)``.
    input_shape : tuple of int
        Shape of one sample.
    name : str
        Canonical spec of the dataset (``"digits"``, ``"npz:/a/b.npz"``, ...).

    Raises
    ------
    DataError
        If the splits disagree with ``input_shape`` or hold out-of-range labels.
    """

    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    input_shape: tuple[int, ...]
    name: str

    def __post_init__(self) -> None:
        """Check that both splits match the declared shape and classes."""
        if self.num_classes < 1:
            raise DataError(
                f"DataBundle {self.name!r} has num_classes={self.num_classes}; "
                "it needs at least one class"
            )
        for split, part in (("train", self.train), ("test", self.test)):
            if part.input_shape != self.input_shape:
                raise DataError(
                    f"DataBundle {self.name!r}: {split} samples have shape "
                    f"{part.input_shape} but input_shape is {self.input_shape}; "
                    "both splits must share one per-sample shape"
                )
            validate_labels(part.y, self.num_classes, what=f"{self.name} {split}")


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed dataset reference.

    Parameters
    ----------
    kind : str
        ``"digits"``, ``"npz"`` or ``"hf"``.
    target : str
        The npz path or the hub dataset id; empty for ``digits``.
    """

    kind: str
    target: str = ""

    def __post_init__(self) -> None:
        """Check the kind and that npz/hf specs carry a target."""
        if self.kind not in ("digits", "npz", "hf"):
            raise DataError(f"dataset kind {self.kind!r} is unknown; use 'digits', 'npz' or 'hf'")
        if self.kind != "digits" and not self.target:
            raise DataError(
                f"dataset spec '{self.kind}:' has no {self.kind} target; write "
                f"'{self.kind}:<{'path' if self.kind == 'npz' else 'name'}>'"
            )

    def __str__(self) -> str:
        """Return the canonical spec string, e.g. ``hf:uoft-cs/cifar10``."""
        return self.kind if self.kind == "digits" else f"{self.kind}:{self.target}"


@dataclass(frozen=True)
class PartitionConfig:
    """How the client pool is split across clients.

    Parameters
    ----------
    scheme : str
        ``"iid"``, ``"dirichlet"`` or ``"pathological"``.
    alpha : float
        Dirichlet concentration (smaller is more skewed); dirichlet only.
    classes_per_client : int
        Number of classes each client holds; pathological only.
    seed : int
        Seed of the server-pool split, the partitioner and the local splits.
    min_partition_size : int
        Fewest samples any partition may have. Dirichlet redraws (up to 10
        times, as flwr-datasets does) until it holds; other schemes raise.
    self_balancing : bool
        Dirichlet only: stop giving samples to partitions that already exceed
        the average size (flwr-datasets ``self_balancing``).
    class_assignment : str
        Pathological only: ``"deterministic"`` (partition ``i`` gets classes
        ``i, i+1, ..., i+k-1`` modulo the class count), ``"random"`` or
        ``"first-deterministic"`` (flwr-datasets ``class_assignment_mode``).

    Raises
    ------
    DataError
        If a field is out of range.
    """

    scheme: str
    alpha: float = 0.5
    classes_per_client: int = 2
    seed: int = 42
    min_partition_size: int = 1
    self_balancing: bool = False
    class_assignment: str = "deterministic"

    def __post_init__(self) -> None:
        """Validate every field."""
        if self.scheme not in SCHEMES:
            raise DataError(f"partition scheme {self.scheme!r} is unknown; use one of {SCHEMES}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise DataError(
                f"dirichlet alpha={self.alpha!r} must be a finite number > 0; "
                "e.g. 0.1 (very skewed) to 100 (close to iid)"
            )
        if self.classes_per_client < 1:
            raise DataError(f"classes_per_client={self.classes_per_client} must be >= 1")
        if self.seed < 0:
            raise DataError(f"seed={self.seed} must be >= 0")
        if self.min_partition_size < 1:
            raise DataError(
                f"min_partition_size={self.min_partition_size} must be >= 1 so that "
                "every client has data"
            )
        if self.class_assignment not in CLASS_ASSIGNMENT_MODES:
            raise DataError(
                f"class_assignment={self.class_assignment!r} is unknown; use one of "
                f"{CLASS_ASSIGNMENT_MODES}"
            )

    @classmethod
    def parse(cls, text: str, *, seed: int = 42) -> PartitionConfig:
        """Parse ``"iid"``, ``"dirichlet[:alpha]"`` or ``"pathological[:k]"``.

        Parameters
        ----------
        text : str
            The scheme, optionally followed by ``:`` and its parameter.
        seed : int
            Seed stored in the returned config.

        Returns
        -------
        PartitionConfig
            The parsed configuration.

        Raises
        ------
        DataError
            If the scheme or its parameter is invalid.
        """
        scheme, _, param = text.strip().partition(":")
        scheme = scheme.strip().lower()
        param = param.strip()
        if not param:
            return cls(scheme=scheme, seed=seed)
        if scheme == "dirichlet":
            try:
                alpha = float(param)
            except ValueError as exc:
                raise DataError(
                    f"dirichlet alpha {param!r} in {text!r} is not a number; "
                    "write e.g. 'dirichlet:0.5'"
                ) from exc
            return cls(scheme=scheme, alpha=alpha, seed=seed)
        if scheme == "pathological":
            if not param.isdigit():
                raise DataError(
                    f"classes per client {param!r} in {text!r} is not a whole "
                    "number; write e.g. 'pathological:2'"
                )
            return cls(scheme=scheme, classes_per_client=int(param), seed=seed)
        raise DataError(
            f"partition spec {text!r} is invalid; use 'iid', 'dirichlet[:alpha]' "
            "or 'pathological[:k]'"
        )


@dataclass(frozen=True, eq=False)
class FederationData:
    """What the server needs to know about the federated data.

    Parameters
    ----------
    global_test : ArrayDataset
        The dataset's test split.
    server_pool : ArrayDataset
        Held-out part of the training split; disjoint from every client partition.
    label_counts : numpy.ndarray
        int64 ``(num_partitions, num_classes)`` label counts per client partition
        (before each client's local train/test split).
    num_classes : int
        Number of classes.
    input_shape : tuple of int
        Shape of one sample.
    name : str
        Canonical dataset spec.
    """

    global_test: ArrayDataset
    server_pool: ArrayDataset
    label_counts: IntArray
    num_classes: int
    input_shape: tuple[int, ...]
    name: str

    @property
    def partition_sizes(self) -> IntArray:
        """Number of samples in each client partition."""
        return np.asarray(self.label_counts.sum(axis=1), dtype=np.int64)

    @property
    def num_partitions(self) -> int:
        """Number of client partitions."""
        return int(self.label_counts.shape[0])


# --------------------------------------------------------------------------- #
# Validation and array conversion
# --------------------------------------------------------------------------- #


def validate_labels(y: npt.ArrayLike, num_classes: int, *, what: str = "labels") -> IntArray:
    """Check that labels are integers in ``[0, num_classes)``.

    Parameters
    ----------
    y : array_like
        Labels, shape ``(N,)``.
    num_classes : int
        Number of classes.
    what : str
        Name used in error messages.

    Returns
    -------
    numpy.ndarray
        The labels as int64.

    Raises
    ------
    DataError
        If a label is not an integer or lies outside ``[0, num_classes)``.
    """
    labels = _as_labels(np.asarray(y), what=what)
    if labels.size and int(labels.max()) >= num_classes:
        pos = int(np.argmax(labels >= num_classes))
        raise DataError(
            f"{what}: label {int(labels[pos])} at index {pos} is out of range for "
            f"num_classes={num_classes}; labels must be in [0, {num_classes - 1}] "
            "(relabel the data or raise num_classes)"
        )
    return labels


def _as_labels(y: np.ndarray, *, what: str) -> IntArray:
    """Convert integer(-valued) labels to int64 ``(N,)``; reject anything else."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(
            f"{what} have shape {y.shape}; labels must be one integer per sample, "
            "shape (N,) (for one-hot labels use y.argmax(axis=1))"
        )
    int64_max = np.iinfo(np.int64).max
    if np.issubdtype(y.dtype, np.integer):
        if y.dtype.kind == "u" and y.size and int(y.max()) > int64_max:
            pos = int(np.argmax(y))
            raise DataError(
                f"{what}: label {int(y[pos])} at index {pos} is too large for a class "
                "index; labels must be class indices 0, 1, 2, ..."
            )
        labels = y.astype(np.int64)
    elif np.issubdtype(y.dtype, np.floating):
        bad = ~np.isfinite(y) | (y != np.round(y))
        if bad.any():
            pos = int(np.argmax(bad))
            raise DataError(
                f"{what}: label {float(y[pos])!r} at index {pos} is not an integer; "
                "labels must be whole class indices 0, 1, 2, ..."
            )
        huge = np.abs(y) > float(2**62)
        if huge.any():
            pos = int(np.argmax(huge))
            raise DataError(
                f"{what}: label {float(y[pos])!r} at index {pos} is too large for a "
                "class index; labels must be class indices 0, 1, 2, ..."
            )
        labels = y.astype(np.int64)
    else:
        raise DataError(
            f"{what} have dtype {y.dtype}; labels must be integer class indices "
            "(map class names to 0, 1, 2, ... first)"
        )
    if labels.size and int(labels.min()) < 0:
        pos = int(np.argmin(labels))
        raise DataError(
            f"{what}: label {int(labels[pos])} at index {pos} is negative; "
            "labels must be class indices >= 0"
        )
    return labels


def _as_samples(x: np.ndarray, *, what: str) -> FloatArray:
    """Convert raw samples to float32 ``(N, D)`` or ``(N, C, H, W)``.

    ``(N, H, W)`` gains a channel axis; ``(N, H, W, C)`` with ``C`` in
    ``{1, 3, 4}`` is transposed to channels-first (when both axis 1 and the last
    axis could be channels, channels-last is assumed and a warning is logged);
    other 4-D arrays are taken as ``(N, C, H, W)``. uint8 data is scaled by
    1/255; other dtypes are kept as they are (integer data above 1 is logged).
    """
    if x.dtype == np.uint8:
        values = x.astype(np.float32) / np.float32(255.0)
    elif x.dtype.kind in "biuf":
        with np.errstate(over="ignore"):  # overflow to inf is reported below
            values = x.astype(np.float32)
        if x.dtype.kind in "iu" and x.size and values.max() > 1.0:
            logger.warning(
                "%s have integer dtype %s with values up to %s; only uint8 is "
                "scaled to [0, 1], these are used as they are",
                what,
                x.dtype,
                values.max(),
            )
    else:
        raise DataError(
            f"{what} have dtype {x.dtype}; samples must be numeric (uint8 images or float features)"
        )
    if values.ndim == 2:
        pass
    elif values.ndim == 3:
        values = values[:, None, :, :]
    elif values.ndim == 4:
        last_is_channel = values.shape[-1] in CHANNEL_COUNTS
        if last_is_channel and values.shape[1] in CHANNEL_COUNTS:
            logger.warning(
                "%s have shape %s: both axis 1 and the last axis could be channels; "
                "assuming channels-last (N, H, W, C)",
                what,
                values.shape,
            )
        if last_is_channel:
            values = np.transpose(values, (0, 3, 1, 2))
    else:
        raise DataError(
            f"{what} have shape {x.shape}; use (N, D) vectors, (N, H, W), "
            "(N, H, W, C) or (N, C, H, W) images"
        )
    finite = np.isfinite(values).reshape(values.shape[0], -1)
    if not finite.all():
        bad_rows = ~finite.all(axis=1)
        pos = int(np.argmax(bad_rows))
        value = values.reshape(values.shape[0], -1)[pos][~finite[pos]][0]
        raise DataError(
            f"{what} contain NaN or infinite values in {int(bad_rows.sum())} sample(s), "
            f"the first is sample {pos} (value {float(value)}); clean or impute them "
            "first (values beyond float32's range, about 3.4e38, also become infinite)"
        )
    return np.ascontiguousarray(values, dtype=np.float32)


def _describe_labels(present: IntArray) -> str:
    """Name a sorted set of distinct labels briefly: ``[1, 2, ..., 10] (10 distinct)``."""
    values = [int(v) for v in present]
    if len(values) <= 12:
        return str(values)
    shown = ", ".join(str(v) for v in values[:5])
    return f"[{shown}, ..., {values[-1]}] ({len(values)} distinct)"


def _first_missing(present: IntArray, limit: int = 5) -> list[int]:
    """Return up to ``limit`` class indices in ``[0, present.max()]`` with no label."""
    missing: list[int] = []
    expected = 0
    for value in (int(v) for v in present):
        while expected < value and len(missing) < limit:
            missing.append(expected)
            expected += 1
        if len(missing) >= limit:
            break
        expected = value + 1
    return missing


def _label_gap_message(present: IntArray, *, what: str) -> str | None:
    """Explain why ``present`` (sorted distinct labels >= 0) is not ``0..C-1``.

    Returns ``None`` when the labels are exactly ``0, 1, ..., C-1``.
    """
    num_classes = int(present[-1]) + 1
    if present.size == num_classes:
        return None
    missing = _first_missing(present)
    n_missing = num_classes - int(present.size)
    missing_text = ", ".join(str(m) for m in missing) + (
        ", ..." if n_missing > len(missing) else ""
    )
    message = (
        f"{what}: the labels found are {_describe_labels(present)}, not the class "
        f"indices 0..{num_classes - 1}: {n_missing} class(es) ({missing_text}) have no "
        f"sample, so largest label + 1 would give {num_classes} classes"
    )
    offset = int(present[0])
    if offset > 0 and present.size > 1 and int(present[-1]) - offset + 1 == present.size:
        message += f" (the labels look {offset}-based: subtract {offset})"
    return message


def _check_labels_are_class_indices(y_train: IntArray, y_test: IntArray, *, name: str) -> int:
    """Return the class count of a whole dataset whose labels must be ``0..C-1``.

    Raises
    ------
    DataError
        If the labels of both splits together skip a class index, e.g. labels
        ``1..10`` (1-based) or ``{0, 5}``.
    """
    present = np.unique(np.concatenate([y_train, y_test]))
    message = _label_gap_message(present, what=name)
    if message is not None:
        raise DataError(
            f"{message}. Remap the labels to 0..{present.size - 1} over train and test "
            "together, e.g. classes, y_all = np.unique(np.concatenate([y_train, "
            "y_test]), return_inverse=True)"
        )
    return int(present.size)


def _split_arrays(
    x_raw: np.ndarray, y_raw: np.ndarray, *, what: str
) -> tuple[FloatArray, IntArray]:
    """Convert one split's arrays and check they are non-empty and aligned."""
    if x_raw.ndim == 0:
        raise DataError(
            f"{what} samples are a scalar ({x_raw!r}), not an array of samples; "
            "save x with shape (N, D) or (N, C, H, W)"
        )
    if x_raw.shape[0] == 0:
        raise DataError(
            f"{what} samples are empty (shape {x_raw.shape}); every split needs at least one sample"
        )
    if y_raw.ndim == 0 or y_raw.shape[0] != x_raw.shape[0]:
        raise DataError(
            f"{what}: {x_raw.shape[0] if x_raw.ndim else 0} samples but labels of "
            f"shape {y_raw.shape}; x and y must have the same length"
        )
    return _as_samples(x_raw, what=f"{what} samples"), _as_labels(y_raw, what=f"{what} labels")


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def parse_dataset_spec(spec: str) -> DatasetSpec:
    """Parse a dataset reference.

    Parameters
    ----------
    spec : str
        ``"digits"``, ``"npz:<path>"``, ``"hf:<hub id>"``, a hub id ``owner/name``,
        or a short name (``cifar10``, ``cifar100``, ``fashion_mnist``, ``mnist``).

    Returns
    -------
    DatasetSpec
        The parsed spec; short names resolve to their hub ids.

    Raises
    ------
    DataError
        If ``spec`` matches none of the forms.
    """
    text = spec.strip()
    if text.lower() == "digits":
        return DatasetSpec(kind="digits")
    prefix, sep, rest = text.partition(":")
    if sep and prefix.lower() in ("npz", "hf"):
        kind = prefix.lower()
        target = rest.strip()
        if kind == "hf":
            target = HF_ALIASES.get(target.lower(), target)
        return DatasetSpec(kind=kind, target=target)
    if text.lower() in HF_ALIASES:
        return DatasetSpec(kind="hf", target=HF_ALIASES[text.lower()])
    if not sep and text.count("/") == 1 and all(text.split("/")):
        return DatasetSpec(kind="hf", target=text)
    raise DataError(f"dataset spec {spec!r} is not recognised; use {SPEC_FORMS}")


def load_bundle(spec: DatasetSpec | str) -> DataBundle:
    """Load a whole dataset into memory.

    Parameters
    ----------
    spec : DatasetSpec or str
        What to load (see :func:`parse_dataset_spec`).

    Returns
    -------
    DataBundle
        Train and test splits with their class count and sample shape.

    Raises
    ------
    DataError
        If the spec is unknown or the data is missing or malformed.
    """
    parsed = parse_dataset_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind == "digits":
        bundle = _load_digits()
    elif parsed.kind == "npz":
        bundle = _load_npz_bundle(Path(parsed.target), name=str(parsed))
    else:
        bundle = _load_hf_bundle(parsed.target, name=str(parsed))
    logger.info(
        "loaded %s: %d train, %d test, %d classes, input shape %s",
        bundle.name,
        len(bundle.train),
        len(bundle.test),
        bundle.num_classes,
        bundle.input_shape,
    )
    return bundle


def _load_digits() -> DataBundle:
    """Load sklearn digits with a fixed seeded stratified 80/20 split."""
    raw = load_digits()
    x = (np.asarray(raw.images, dtype=np.float32) / np.float32(16.0))[:, None, :, :]
    y = np.asarray(raw.target, dtype=np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(len(y)),
        test_size=DIGITS_TEST_FRACTION,
        stratify=y,
        random_state=DIGITS_SPLIT_SEED,
    )
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    return DataBundle(
        train=ArrayDataset(x=x[train_idx], y=y[train_idx]),
        test=ArrayDataset(x=x[test_idx], y=y[test_idx]),
        num_classes=10,
        input_shape=(1, 8, 8),
        name="digits",
    )


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """Read every array of an ``.npz`` file, with clear errors.

    The file must be a zip of numeric ``.npy`` arrays (what ``np.savez``
    writes); a single ``.npy`` array, a truncated archive, and object
    (pickled) arrays are refused: arrays load with ``allow_pickle=False``.
    """
    shown = str(path)
    if not path.is_file():
        raise DataError(
            f"data file {shown!r} does not exist or is not a file; check the "
            "path (npz:<path> and data-path are relative to the working directory)"
        )
    try:
        with path.open("rb") as handle:
            head = handle.read(len(NPY_MAGIC))
    except OSError as exc:
        raise DataError(
            f"data file {shown!r} cannot be read ({exc}); check its permissions"
        ) from exc
    if head.startswith(NPY_MAGIC):
        raise DataError(
            f"data file {shown!r} holds a single .npy array (np.save), not an .npz "
            f"archive of the named arrays {list(NPZ_ARRAYS)}; {NPZ_HOWTO}"
        )
    if not head.startswith(ZIP_MAGICS):
        raise DataError(
            f"data file {shown!r} is not a readable .npz archive: it starts with "
            f"{head!r}, not the zip signature b'PK\\x03\\x04' of an .npz; {NPZ_HOWTO}"
        )
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(
            f"data file {shown!r} is not a readable .npz archive of numeric "
            f"arrays ({exc}); {NPZ_HOWTO}"
        ) from exc
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DataError(
            f"data file {shown!r} holds a single array, not an .npz archive; {NPZ_HOWTO}"
        )
    arrays: dict[str, np.ndarray] = {}
    with npz:
        for name in npz.files:
            try:
                value = npz[name]
            except ValueError as exc:
                raise DataError(
                    f"array {name!r} of data file {shown!r} cannot be loaded ({exc}); "
                    "arrays must be numeric: Python objects (dtype=object) are refused "
                    "because they would be unpickled. Save e.g. "
                    "x_train=np.asarray(x, dtype=np.float32), "
                    "y_train=np.asarray(y, dtype=np.int64)"
                ) from exc
            except (OSError, EOFError, zipfile.BadZipFile) as exc:
                raise DataError(
                    f"array {name!r} of data file {shown!r} is corrupt ({exc}); "
                    f"write the file again: {NPZ_HOWTO}"
                ) from exc
            if not isinstance(value, np.ndarray):
                raise DataError(
                    f"member {name!r} of data file {shown!r} is not a .npy array "
                    f"(the zip was not written by np.savez); {NPZ_HOWTO}"
                )
            arrays[name] = value
    return arrays


def _load_npz_bundle(path: Path, *, name: str) -> DataBundle:
    """Load an npz with all four arrays into a bundle."""
    arrays = _read_npz(path)
    missing = [n for n in NPZ_ARRAYS if n not in arrays]
    if missing:
        raise DataError(
            f"data file {str(path)!r} lacks array(s) {missing}; it has "
            f"{sorted(arrays)}. Save it with np.savez(path, x_train=..., "
            "y_train=..., x_test=..., y_test=...)"
        )
    x_train, y_train = _split_arrays(
        arrays["x_train"], arrays["y_train"], what=f"{path.name} train"
    )
    x_test, y_test = _split_arrays(arrays["x_test"], arrays["y_test"], what=f"{path.name} test")
    return _bundle_from_arrays(x_train, y_train, x_test, y_test, name=name)


def _bundle_from_arrays(
    x_train: FloatArray,
    y_train: IntArray,
    x_test: FloatArray,
    y_test: IntArray,
    *,
    name: str,
    num_classes: int | None = None,
) -> DataBundle:
    """Assemble a bundle, checking shapes agree and deriving the class count."""
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(
            f"{name}: train samples have shape {x_train.shape[1:]} but test "
            f"samples have shape {x_test.shape[1:]}; both splits must share one "
            "per-sample shape"
        )
    if num_classes is None:
        num_classes = _check_labels_are_class_indices(y_train, y_test, name=name)
    return DataBundle(
        train=ArrayDataset(x=x_train, y=y_train),
        test=ArrayDataset(x=x_test, y=y_test),
        num_classes=num_classes,
        input_shape=tuple(int(d) for d in x_train.shape[1:]),
        name=name,
    )


def detect_hf_columns(features: datasets.Features) -> tuple[str, str]:
    """Find the image and label columns of a Hugging Face dataset.

    Known names are tried first (``img``/``image`` and
    ``label``/``fine_label``/``labels``), then the first column typed
    ``datasets.Image`` and the first typed ``datasets.ClassLabel``.

    Parameters
    ----------
    features : datasets.Features
        The dataset's features.

    Returns
    -------
    tuple of str
        ``(image_column, label_column)``.

    Raises
    ------
    DataError
        If either column cannot be found.
    """
    image_col = next((c for c in HF_IMAGE_COLUMNS if c in features), None)
    if image_col is None:
        image_col = next((c for c, f in features.items() if isinstance(f, datasets.Image)), None)
    label_col = next((c for c in HF_LABEL_COLUMNS if c in features), None)
    if label_col is None:
        label_col = next(
            (c for c, f in features.items() if isinstance(f, datasets.ClassLabel)),
            None,
        )
    if image_col is None or label_col is None:
        raise DataError(
            f"cannot find the {'image' if image_col is None else 'label'} column "
            f"among {list(features)}; expected one of "
            f"{HF_IMAGE_COLUMNS if image_col is None else HF_LABEL_COLUMNS} or a "
            "datasets.Image / datasets.ClassLabel column. Rename the column or "
            "convert the data to npz:<path>"
        )
    return image_col, label_col


def arrays_from_hf(split: datasets.Dataset, *, what: str = "split") -> tuple[FloatArray, IntArray]:
    """Convert a Hugging Face image-classification split to arrays.

    Parameters
    ----------
    split : datasets.Dataset
        One split with an image column and an integer label column.
    what : str
        Name used in error messages.

    Returns
    -------
    tuple of numpy.ndarray
        float32 ``(N, C, H, W)`` images scaled to ``[0, 1]`` and int64 labels.

    Raises
    ------
    DataError
        If the columns are missing, the images differ in size or mode, or the
        labels are not class indices.
    """
    image_col, label_col = detect_hf_columns(split.features)
    if split.num_rows == 0:
        raise DataError(f"{what} is empty; every split needs at least one sample")
    columns = split.select_columns([image_col, label_col]).with_format("numpy")[:]
    images = np.asarray(columns[image_col])
    if images.dtype == object:
        raise DataError(
            f"{what}: images in column {image_col!r} differ in size or colour mode; "
            "resize them to one shape (e.g. with datasets.map) or convert the data "
            "to npz:<path>"
        )
    return _split_arrays(images, np.asarray(columns[label_col]), what=what)


def bundle_from_hf(train: datasets.Dataset, test: datasets.Dataset, *, name: str) -> DataBundle:
    """Build a bundle from Hugging Face train and test splits.

    Parameters
    ----------
    train, test : datasets.Dataset
        The splits (see :func:`arrays_from_hf`).
    name : str
        Canonical spec of the dataset.

    Returns
    -------
    DataBundle
        The converted dataset. ``num_classes`` comes from the label column's
        ``ClassLabel`` feature when it has one, else from the largest label.

    Raises
    ------
    DataError
        If a split cannot be converted.
    """
    x_train, y_train = arrays_from_hf(train, what=f"{name} train")
    x_test, y_test = arrays_from_hf(test, what=f"{name} test")
    _, label_col = detect_hf_columns(train.features)
    feature = train.features[label_col]
    num_classes = int(feature.num_classes) if isinstance(feature, datasets.ClassLabel) else None
    return _bundle_from_arrays(x_train, y_train, x_test, y_test, name=name, num_classes=num_classes)


def _load_hf_bundle(dataset_id: str, *, name: str) -> DataBundle:
    """Download (or read from the local HF cache) a hub dataset."""
    try:
        fds = FederatedDataset(dataset=dataset_id, partitioners={"train": 1})
        train = fds.load_split("train")
    except Exception as exc:
        raise DataError(
            f"could not load Hugging Face dataset {dataset_id!r} "
            f"({type(exc).__name__}: {exc}). The hub may be unreachable (no "
            "internet, or HF_HUB_OFFLINE=1 without a cached copy) or the name may "
            "be wrong. Check the name, or use local data: 'npz:<path>' or 'digits'"
        ) from exc
    try:
        test = fds.load_split("test")
    except ValueError as exc:
        raise DataError(
            f"Hugging Face dataset {dataset_id!r} has no 'test' split ({exc}); "
            "export it to npz:<path> with your own x_test/y_test"
        ) from exc
    return bundle_from_hf(train, test, name=name)


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
    arrays = _read_npz(file)
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
    x_train, y_train = _split_arrays(
        arrays["x_train"], arrays["y_train"], what=f"{file.name} train"
    )
    if all(has_test):
        x_test, y_test = _split_arrays(arrays["x_test"], arrays["y_test"], what=f"{file.name} test")
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
        gaps = _label_gap_message(labels_found, what=f"data file {path!r}")
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


# --------------------------------------------------------------------------- #
# Splitting and partitioning
# --------------------------------------------------------------------------- #


def _check_fraction(value: float, *, name: str) -> None:
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise DataError(f"{name}={value!r} must be in [0, 1); e.g. 0.1")


def _two_way_split(labels: IntArray, n_second: int, seed: int) -> tuple[IntArray, IntArray]:
    """Split ``arange(len(labels))`` into two sorted index sets.

    Stratified by label when every class can appear on both sides, otherwise a
    plain seeded random split.
    """
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
    _check_fraction(pool_fraction, name="pool_fraction")
    y = _as_labels(np.asarray(labels), what="training labels")
    n = int(y.shape[0])
    n_pool = 0 if pool_fraction == 0 else max(1, round(pool_fraction * n))
    if n - n_pool < 1:
        raise DataError(
            f"pool_fraction={pool_fraction} of {n} training samples leaves no data "
            "for the clients; lower pool_fraction"
        )
    return _two_way_split(y, n_pool, seed)


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
    _check_fraction(test_fraction, name="test_fraction")
    y = _as_labels(np.asarray(labels), what="client labels")
    n = int(y.shape[0])
    if n == 0:
        raise DataError("cannot split an empty partition; every client needs data")
    n_test = min(round(test_fraction * n), n - 1)
    return _two_way_split(y, n_test, seed)


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
    y = _as_labels(np.asarray(labels), what="partition labels")
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


def label_counts(labels: npt.ArrayLike, partitions: list[IntArray], num_classes: int) -> IntArray:
    """Count labels per partition.

    Parameters
    ----------
    labels : array_like of int
        Labels indexed by the partitions.
    partitions : list of numpy.ndarray
        Row indices per partition.
    num_classes : int
        Number of classes (columns).

    Returns
    -------
    numpy.ndarray
        int64 ``(len(partitions), num_classes)``.
    """
    y = validate_labels(labels, num_classes)
    counts = np.zeros((len(partitions), num_classes), dtype=np.int64)
    for pid, part in enumerate(partitions):
        counts[pid] = np.bincount(y[part], minlength=num_classes)
    return counts


def _as_bundle(source: DataBundle | DatasetSpec | str) -> DataBundle:
    return source if isinstance(source, DataBundle) else load_bundle(source)


def federation_data(
    source: DataBundle | DatasetSpec | str,
    *,
    num_partitions: int,
    partition: PartitionConfig,
    pool_fraction: float,
) -> FederationData:
    """Compute the server's view of the federated data.

    Parameters
    ----------
    source : DataBundle, DatasetSpec or str
        The dataset, or a spec to load it from.
    num_partitions : int
        Number of client partitions.
    partition : PartitionConfig
        Partitioning scheme; its seed also seeds the server-pool split.
    pool_fraction : float
        Share of the training split held out as the server pool.

    Returns
    -------
    FederationData
        Global test split, server pool and per-partition label counts.

    Raises
    ------
    DataError
        If loading, the pool split or the partitioning fails.
    """
    bundle = _as_bundle(source)
    client_pool, server_pool = split_server_pool(
        bundle, pool_fraction=pool_fraction, seed=partition.seed
    )
    parts = partition_indices(client_pool.y, num_partitions=num_partitions, config=partition)
    counts = label_counts(client_pool.y, parts, bundle.num_classes)
    logger.info(
        "%s: %d partitions (%s), sizes %s, server pool %d, global test %d",
        bundle.name,
        num_partitions,
        partition.scheme,
        counts.sum(axis=1).tolist(),
        len(server_pool),
        len(bundle.test),
    )
    return FederationData(
        global_test=bundle.test,
        server_pool=server_pool,
        label_counts=counts,
        num_classes=bundle.num_classes,
        input_shape=bundle.input_shape,
        name=bundle.name,
    )


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
    _check_fraction(test_fraction, name="test_fraction")
    bundle = _as_bundle(source)
    client_pool, _ = split_server_pool(bundle, pool_fraction=pool_fraction, seed=partition.seed)
    parts = partition_indices(client_pool.y, num_partitions=num_partitions, config=partition)
    own = client_pool.subset(parts[partition_id])
    train_idx, test_idx = split_local(
        own.y,
        test_fraction=test_fraction,
        seed=_client_seed(partition.seed, partition_id),
    )
    return own.subset(train_idx), own.subset(test_idx)


# --------------------------------------------------------------------------- #
# Plot
# --------------------------------------------------------------------------- #


def plot_label_distribution(label_counts: npt.ArrayLike, path: Path, *, title: str) -> None:
    """Write a stacked horizontal bar chart of labels per client as PNG.

    One bar per client, one colour per class. Up to 20 classes get a legend;
    more classes get a colour bar instead.

    Parameters
    ----------
    label_counts : array_like of int
        ``(num_partitions, num_classes)`` counts.
    path : pathlib.Path
        Output file; parent directories are created.
    title : str
        Figure title.

    Raises
    ------
    DataError
        If ``label_counts`` is not a non-empty 2-D array of counts >= 0.
    """
    counts = np.asarray(label_counts)
    if (
        counts.ndim != 2
        or counts.size == 0
        or counts.dtype.kind not in "iuf"
        or not np.isfinite(counts).all()
        or (counts < 0).any()
    ):
        raise DataError(
            f"label_counts has shape {counts.shape} and dtype {counts.dtype}; pass a "
            "non-empty (num_partitions, num_classes) array of counts >= 0"
        )
    num_clients, num_classes = counts.shape
    if num_classes <= 10:
        cmap = colormaps["tab10"]
    elif num_classes <= 20:
        cmap = colormaps["tab20"]
    else:
        cmap = colormaps["viridis"]
    colours = (
        [cmap(c) for c in range(num_classes)]
        if num_classes <= 20
        else [cmap(c / max(num_classes - 1, 1)) for c in range(num_classes)]
    )
    fig = Figure(figsize=(9.0, max(2.5, 0.3 * num_clients + 1.5)))
    ax = fig.add_subplot()
    clients = np.arange(num_clients)
    left = np.zeros(num_clients)
    for cls in range(num_classes):
        ax.barh(
            clients,
            counts[:, cls],
            left=left,
            color=colours[cls],
            label=str(cls),
            height=0.8,
        )
        left += counts[:, cls]
    step = 1 if num_clients <= 50 else num_clients // 25
    ax.set_yticks(clients[::step])
    ax.invert_yaxis()
    ax.set_xlabel("samples")
    ax.set_ylabel("client (partition id)")
    ax.set_title(title)
    if num_classes <= 20:
        ax.legend(
            title="class",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            ncol=1 if num_classes <= 10 else 2,
            fontsize="small",
        )
    else:
        mappable = ax.scatter([], [], c=[], cmap=cmap, vmin=0, vmax=num_classes - 1)
        fig.colorbar(mappable, ax=ax, label="class")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    logger.info("wrote label distribution plot %s", path)


__all__ = [
    "ArrayDataset",
    "DataBundle",
    "DataError",
    "DatasetSpec",
    "FederationData",
    "PartitionConfig",
    "arrays_from_hf",
    "bundle_from_hf",
    "client_data",
    "detect_hf_columns",
    "federation_data",
    "label_counts",
    "load_bundle",
    "local_data",
    "parse_dataset_spec",
    "partition_indices",
    "plot_label_distribution",
    "server_pool_indices",
    "split_local",
    "split_server_pool",
    "validate_labels",
]
