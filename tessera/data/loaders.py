"""Loading whole datasets: scikit-learn digits, ``.npz`` files, Hugging Face hub datasets."""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tessera.data.arrays import (
    ArrayDataset,
    DataBundle,
    DataError,
    FloatArray,
    IntArray,
    check_labels_are_class_indices,
    check_layout,
    split_arrays,
)
from tessera.data.spec import DatasetSpec, parse_dataset_spec

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

HF_IMAGE_COLUMNS = ("img", "image")
HF_LABEL_COLUMNS = ("label", "fine_label", "labels")
NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
"""Required arrays of an ``npz:`` dataset; an optional string ``layout`` names the
axes of ``x_train`` and ``x_test`` (see :data:`~tessera.data.arrays.SAMPLE_LAYOUTS`)."""
NPZ_HOWTO = "save it with np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)"
NPY_MAGIC = b"\x93NUMPY"
"""First bytes of a single-array ``.npy`` file (what ``np.save`` writes)."""
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
"""First bytes of a zip archive (an ``.npz``) with entries, and of an empty one."""
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


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
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

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


def read_npz(path: Path) -> dict[str, np.ndarray]:
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
    arrays = read_npz(path)
    missing = [n for n in NPZ_ARRAYS if n not in arrays]
    if missing:
        raise DataError(
            f"data file {str(path)!r} lacks array(s) {missing}; it has "
            f"{sorted(arrays)}. Save it with np.savez(path, x_train=..., "
            "y_train=..., x_test=..., y_test=...)"
        )
    layout = npz_layout(arrays, path)
    x_train, y_train = split_arrays(
        arrays["x_train"], arrays["y_train"], what=f"{path.name} train", layout=layout
    )
    x_test, y_test = split_arrays(
        arrays["x_test"], arrays["y_test"], what=f"{path.name} test", layout=layout
    )
    return _bundle_from_arrays(x_train, y_train, x_test, y_test, name=name)


def npz_layout(arrays: Mapping[str, np.ndarray], path: Path) -> str | None:
    """Return the axis order an ``.npz`` names in its optional ``layout`` array.

    Parameters
    ----------
    arrays : Mapping[str, numpy.ndarray]
        The file's arrays (:func:`read_npz`).
    path : pathlib.Path
        The file, for messages.

    Returns
    -------
    str or None
        One of :data:`~tessera.data.arrays.SAMPLE_LAYOUTS` for both splits'
        samples, or ``None`` when the file names none (the rank decides).

    Raises
    ------
    DataError
        If ``layout`` is not a single string naming a known layout.
    """
    if "layout" not in arrays:
        return None
    value = arrays["layout"]
    what = f"array 'layout' of data file {str(path)!r}"
    if value.ndim != 0 or value.dtype.kind not in "US":
        raise DataError(
            f"{what} has shape {value.shape} and dtype {value.dtype}; save one string, "
            "e.g. np.savez(path, ..., layout='NCL')"
        )
    text = value.item()
    return check_layout(text.decode() if isinstance(text, bytes) else text, what=what)


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
        num_classes = check_labels_are_class_indices(y_train, y_test, name=name)
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
    import datasets

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
    return split_arrays(images, np.asarray(columns[label_col]), what=what)


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
    import datasets

    x_train, y_train = arrays_from_hf(train, what=f"{name} train")
    x_test, y_test = arrays_from_hf(test, what=f"{name} test")
    _, label_col = detect_hf_columns(train.features)
    feature = train.features[label_col]
    num_classes = int(feature.num_classes) if isinstance(feature, datasets.ClassLabel) else None
    return _bundle_from_arrays(x_train, y_train, x_test, y_test, name=name, num_classes=num_classes)


def _load_hf_bundle(dataset_id: str, *, name: str) -> DataBundle:
    """Download (or read from the local HF cache) a hub dataset."""
    from flwr_datasets import FederatedDataset

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
