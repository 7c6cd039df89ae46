"""In-memory datasets, the data error, and validation of sample and label arrays.

``x`` is float32 with shape ``(N, D)`` for vectors, ``(N, C, L)`` for 1-D
(multi-channel) signals or ``(N, C, H, W)`` for images; ``y`` is int64 in
``[0, num_classes)``. Raw arrays from files are converted by :func:`split_arrays`;
a 3-D array is ambiguous (grayscale images ``(N, H, W)`` or signals ``(N, C, L)``),
so signals need their layout named (:data:`SAMPLE_LAYOUTS`, in an ``.npz`` the
optional array ``layout``, e.g. ``np.savez(path, ..., layout="NCL")``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]

CHANNEL_COUNTS = (1, 3, 4)
SAMPLE_LAYOUTS = ("ND", "NCL", "NLC", "NHW", "NCHW", "NHWC")
"""Axis orders :func:`as_samples` accepts: ``N`` samples, ``D`` features, ``C``
channels, ``L`` signal length, ``H``/``W`` image height and width. Every layout is
converted to ``(N, D)``, ``(N, C, L)`` or ``(N, C, H, W)``."""
SIGNAL_HINT_MAX_CHANNELS = 16
"""An unnamed 3-D array with at most this many rows, each at least 8 times as long,
looks like a signal: it is still read as an image, with a warning."""


class DataError(ValueError):
    """A dataset, data file or data-related setting is unusable.

    The message names the offending value and how to fix it.
    """


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Samples and labels held in memory.

    Parameters
    ----------
    x : numpy.ndarray
        float32 samples: ``(N, D)`` vectors, ``(N, C, L)`` 1-D signals or
        ``(N, C, H, W)`` images.
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
        """Shape of one sample, ``(D,)``, ``(C, L)`` or ``(C, H, W)``."""
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
    labels = as_labels(np.asarray(y), what=what)
    if labels.size and int(labels.max()) >= num_classes:
        pos = int(np.argmax(labels >= num_classes))
        raise DataError(
            f"{what}: label {int(labels[pos])} at index {pos} is out of range for "
            f"num_classes={num_classes}; labels must be in [0, {num_classes - 1}] "
            "(relabel the data or raise num_classes)"
        )
    return labels


def as_labels(y: np.ndarray, *, what: str) -> IntArray:
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


def as_samples(x: np.ndarray, *, what: str, layout: str | None = None) -> FloatArray:
    """Convert raw samples to float32 ``(N, D)``, ``(N, C, L)`` or ``(N, C, H, W)``.

    Without ``layout`` the rank decides: 2-D is ``(N, D)``; 3-D is ``(N, H, W)``
    and gains a channel axis (a warning is logged when it looks like signals);
    ``(N, H, W, C)`` with ``C`` in ``{1, 3, 4}`` is transposed to channels-first
    (when both axis 1 and the last axis could be channels, channels-last is
    assumed and a warning is logged); other 4-D arrays are taken as
    ``(N, C, H, W)``. A ``layout`` from :data:`SAMPLE_LAYOUTS` names the axes
    instead: ``"NCL"`` signals are kept, ``"NLC"`` ones transposed to
    ``(N, C, L)``. uint8 data is scaled by 1/255; other dtypes are kept as they
    are (integer data above 1 is logged).

    Raises
    ------
    DataError
        If the dtype is not numeric, the rank is unsupported or does not match
        ``layout``, ``layout`` is unknown, or a value is not finite.
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
    if layout is not None:
        values = _apply_layout(values, layout, what=what)
    elif values.ndim == 2:
        pass
    elif values.ndim == 3:
        rows, length = values.shape[1:]
        if rows <= SIGNAL_HINT_MAX_CHANNELS and length >= 8 * rows:
            logger.warning(
                "%s have shape %s and are read as %d x %d grayscale images (N, H, W); "
                "if they are 1-D signals with %d channels, save the layout with them: "
                "np.savez(path, ..., layout='NCL') (or 'NLC' for (N, L, C))",
                what,
                values.shape,
                rows,
                length,
                rows,
            )
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
            f"{what} have shape {x.shape}; use (N, D) vectors, (N, C, L) signals "
            "(with layout 'NCL'), or (N, H, W), (N, H, W, C) or (N, C, H, W) images"
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


def label_gap_message(present: IntArray, *, what: str) -> str | None:
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


def check_labels_are_class_indices(y_train: IntArray, y_test: IntArray, *, name: str) -> int:
    """Return the class count of a whole dataset whose labels must be ``0..C-1``.

    Raises
    ------
    DataError
        If the labels of both splits together skip a class index, e.g. labels
        ``1..10`` (1-based) or ``{0, 5}``.
    """
    present = np.unique(np.concatenate([y_train, y_test]))
    message = label_gap_message(present, what=name)
    if message is not None:
        raise DataError(
            f"{message}. Remap the labels to 0..{present.size - 1} over train and test "
            "together, e.g. classes, y_all = np.unique(np.concatenate([y_train, "
            "y_test]), return_inverse=True)"
        )
    return int(present.size)


def split_arrays(
    x_raw: np.ndarray, y_raw: np.ndarray, *, what: str, layout: str | None = None
) -> tuple[FloatArray, IntArray]:
    """Convert one split's arrays and check they are non-empty and aligned.

    ``layout`` names the axes of ``x_raw`` (see :func:`as_samples`).
    """
    if x_raw.ndim == 0:
        raise DataError(
            f"{what} samples are a scalar ({x_raw!r}), not an array of samples; "
            "save x with shape (N, D), (N, C, L) or (N, C, H, W)"
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
    samples = as_samples(x_raw, what=f"{what} samples", layout=layout)
    return samples, as_labels(y_raw, what=f"{what} labels")


def check_layout(value: object, *, what: str) -> str:
    """Return ``value`` as one of :data:`SAMPLE_LAYOUTS` (case and spaces ignored).

    Raises
    ------
    DataError
        If ``value`` is not a string naming one of them.
    """
    text = value.strip().upper() if isinstance(value, str) else None
    if text not in SAMPLE_LAYOUTS:
        raise DataError(
            f"{what} is {value!r}; use one of {list(SAMPLE_LAYOUTS)}, e.g. 'NCL' for "
            "1-D signals of shape (N, channels, length)"
        )
    return text


def _apply_layout(values: np.ndarray, layout: str, *, what: str) -> np.ndarray:
    """Reorder ``values`` from the named ``layout`` to channels-first."""
    order = check_layout(layout, what=f"the layout of {what}")
    if values.ndim != len(order):
        raise DataError(
            f"{what} have shape {values.shape} ({values.ndim} axes) but the layout "
            f"{order!r} names {len(order)}; save the layout that matches the array"
        )
    if order == "NLC":
        return np.transpose(values, (0, 2, 1))
    if order == "NHW":
        return values[:, None, :, :]
    if order == "NHWC":
        return np.transpose(values, (0, 3, 1, 2))
    return values  # ND, NCL, NCHW are already channels-first
