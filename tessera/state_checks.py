"""Checks shared by every state file read back: bounded reading, typed fields, arrays.

A file a process wrote earlier (a server checkpoint, a node's state, its data cache,
an ensemble artifact) is input like any other: it may be truncated, edited, written
by another version or another federation. Nothing read from one is used before it
is checked, and nothing is allocated before its size is bounded:

- :func:`read_npz` reads an ``.npz`` (a zip of ``.npy`` members) after checking
  every member's declared size against a byte budget, and every ``.npy`` header's
  shape and dtype against the member's size, so a small file cannot make it
  decompress or allocate gigabytes; arrays written in the other byte order are
  returned in this machine's (same values), since torch reads no other;
- :func:`npy_bytes_problem` does the same for one serialised array (Flower's
  :class:`~flwr.app.Array` holds ``.npy`` bytes), and refuses one in the other
  byte order (Flower decodes it as stored, and torch cannot take it);
- :func:`get_int`, :func:`get_str`, :func:`get_mapping`, :func:`get_list` and
  :func:`positive_float` read typed fields of a decoded JSON tree;
- :func:`arrays_problem` compares arrays with the ones a model has (names, shapes,
  dtypes, byte order) and checks they are finite.

Every failure is a :class:`StateFileError` naming the field and what was expected;
the caller adds the file and the fix (refuse a checkpoint, discard a node's own
state and rebuild it).
"""

from __future__ import annotations

import io
import math
import re
import zipfile
import zlib
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Final

import numpy as np

__all__ = [
    "MEDIAN_KINDS",
    "MEDIAN_LIMIT",
    "NPY_KINDS",
    "SAFE_ID",
    "StateFileError",
    "arrays_problem",
    "byte_order_problem",
    "dtype_name",
    "get_int",
    "get_list",
    "get_mapping",
    "get_str",
    "int_list",
    "npy_bytes_problem",
    "positive_float",
    "read_npz",
]

NPY_KINDS: Final = "biufcUS"
"""numpy dtype kinds a state file may hold: numbers, booleans and strings (never
objects, structured records, dates or raw bytes)."""
MAX_NPY_HEADER: Final = 10_000
"""Largest ``.npy`` header read (numpy's own default limit)."""
SAFE_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
"""A federation id: a safe folder name of at most 128 characters."""

MEDIAN_KINDS: Final = ("parameters", "statistics")
"""Entry kinds a checkpoint's median distances are kept for (``strategies.core.aggregators.
entry_kind``)."""
MEDIAN_LIMIT: Final = 1e6
"""Largest median distance a checkpoint may hold, as a multiple of the norm of its
group's weights (at least 1). One round moves honest weights by a fraction of their
norm; a median this far beyond it can only be a damaged or forged file, and it would
put the clip bound out of reach."""

_MISSING: Final = object()


class StateFileError(ValueError):
    """A state file, or one of its fields, does not match its schema.

    Parameters
    ----------
    field : str
        Where in the file (``"round"``, ``"group_models.arrays.cnn-2"``, an array's
        name); empty for the file as a whole.
    problem : str
        What is wrong and what was expected.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"field '{field}' {problem}" if field else problem)


def dtype_name(dtype: Any) -> str:
    """Return the numpy name of a numpy or torch dtype (``torch.float32`` -> ``float32``)."""
    return str(dtype).removeprefix("torch.")


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def _kind(value: Any) -> str:
    return type(value).__name__


# --------------------------------------------------------------------------- npy
def _read_header(fp: IO[bytes], *, what: str) -> tuple[tuple[int, ...], np.dtype[Any], bool]:
    """Read an ``.npy`` header from ``fp`` and check its dtype; return shape, dtype, order."""
    from numpy.lib import format as npy_format

    try:
        version = npy_format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = npy_format.read_array_header_1_0(
                fp, max_header_size=MAX_NPY_HEADER
            )
        elif version == (2, 0):
            shape, fortran, dtype = npy_format.read_array_header_2_0(
                fp, max_header_size=MAX_NPY_HEADER
            )
        else:
            raise ValueError(f".npy format version {version} is not one numpy writes for numbers")
    except (ValueError, EOFError, OSError, SyntaxError) as err:
        raise StateFileError(what, f"is not a readable .npy array ({err})") from err
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in NPY_KINDS:
        raise StateFileError(
            what, f"has dtype {dtype}; only numbers, booleans and strings are read back"
        )
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise StateFileError(what, f"declares shape {dims}; dimensions must be >= 0")
    return dims, dtype, bool(fortran)


def byte_order_problem(dtype: np.dtype[Any]) -> str | None:
    """Say why ``dtype`` is not in this machine's byte order (``None``: it is, or has none).

    numpy names ``>f4`` and ``<f4`` both ``float32``, but torch reads only the native
    order (``torch.from_numpy`` raises on the other).

    Parameters
    ----------
    dtype : numpy.dtype
        The dtype an array was read with.

    Returns
    -------
    str or None
        The problem (the order found and the dtype expected), or ``None``.
    """
    if dtype.isnative:
        return None
    order = "big-endian" if dtype.byteorder == ">" else "little-endian"
    native = dtype.newbyteorder("=")
    return (
        f"is {dtype.name} in {order} byte order ({dtype.str}); expected {native.name} in "
        f"this machine's byte order ({native.str})"
    )


def _nbytes(shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    return math.prod(shape) * dtype.itemsize  # Python integers: no overflow


def npy_bytes_problem(data: bytes, *, shape: tuple[int, ...], dtype: str) -> str | None:
    """Say why ``.npy`` bytes do not hold an array of ``shape`` and ``dtype`` (``None``: they do).

    Only the header is parsed: nothing of the declared size is allocated, so the
    bytes can then be decoded (``np.load``) with their size bounded by ``len(data)``.
    A negative dimension, and an array in the other byte order (``>f4`` is named
    ``float32`` too, but torch cannot take it), are problems.

    Parameters
    ----------
    data : bytes
        A serialised array (``np.save``).
    shape : tuple[int, ...]
        The shape the container declares for it.
    dtype : str
        The dtype name the container declares for it.

    Returns
    -------
    str or None
        The problem, or ``None``.
    """
    fp = io.BytesIO(data)
    try:
        got_shape, got_dtype, _ = _read_header(fp, what="")
    except StateFileError as err:
        return err.problem
    if got_shape != tuple(shape) or got_dtype.name != dtype:
        return (
            f"its bytes hold {got_dtype.name} {got_shape} but it is declared as {dtype} "
            f"{tuple(shape)}"
        )
    order = byte_order_problem(got_dtype)
    if order is not None:
        return f"its bytes hold an array that {order}"
    if fp.tell() + _nbytes(got_shape, got_dtype) != len(data):
        return (
            f"its header declares {_nbytes(got_shape, got_dtype)} bytes of data but "
            f"{len(data) - fp.tell()} follow"
        )
    return None


# --------------------------------------------------------------------------- npz
def _read_member(fp: IO[bytes], size: int, *, what: str) -> np.ndarray:
    """Read one ``.npy`` member of ``size`` bytes, its declared size checked first."""
    shape, dtype, fortran = _read_header(fp, what=what)
    nbytes = _nbytes(shape, dtype)
    if nbytes > size:
        raise StateFileError(
            what,
            f"declares shape {shape} of {dtype} ({nbytes} bytes) but its member holds {size} bytes",
        )
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    filled = 0
    while filled < nbytes:
        got = fp.readinto(view[filled:])  # type: ignore[attr-defined]
        if not got:
            raise StateFileError(what, f"is truncated: {filled} of {nbytes} bytes of data")
        filled += got
    if fp.read(1):
        raise StateFileError(what, f"holds more bytes than its shape {shape} of {dtype}")
    array = np.frombuffer(buffer, dtype=dtype, count=math.prod(shape))
    array = array.reshape(shape, order="F" if fortran else "C")
    if not dtype.isnative:  # same values in this machine's order (torch reads no other)
        array = array.astype(dtype.newbyteorder("="))
    return array


def read_npz(source: bytes | Path, *, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """Read every array of an ``.npz``, bounding each size before reading or allocating it.

    The sizes each zip member declares (after decompression) must add up to at most
    ``max_bytes``, and each member's ``.npy`` header must declare no more data
    than the member holds; only then is it read. Objects, structured records and
    pickles are refused.

    Parameters
    ----------
    source : bytes or pathlib.Path
        The file's bytes, or its path.
    max_bytes : int, optional
        Most bytes the arrays may hold once read; by default the file's own size
        (``np.savez`` stores members uncompressed, so a file written that way
        always fits, and a compressed one cannot expand).

    Returns
    -------
    dict[str, numpy.ndarray]
        The arrays by name (``np.load``'s names: the member name without ``.npy``),
        in this machine's byte order (an array stored in the other is converted,
        losslessly).

    Raises
    ------
    StateFileError
        If the file is not a readable ``.npz`` of numeric or string arrays, or a
        size exceeds its bound.
    """
    arrays: dict[str, np.ndarray] = {}
    try:
        size = len(source) if isinstance(source, bytes) else source.stat().st_size
        budget = size if max_bytes is None else max_bytes
        handle: IO[bytes] = io.BytesIO(source) if isinstance(source, bytes) else source.open("rb")
        with handle, zipfile.ZipFile(handle) as archive:
            members = archive.infolist()
            counts = Counter(m.filename for m in members)
            declared = sum(m.file_size for m in members)
            if declared > budget:
                raise StateFileError(
                    "",
                    f"the file's {len(members)} member(s) declare {declared} bytes once read, "
                    f"more than the {budget} allowed for a file of {size} bytes",
                )
            for member in members:
                name = member.filename
                if not name.endswith(".npy") or counts[name] > 1:
                    raise StateFileError(
                        name, "is not a single .npy array (the file was not written by np.savez)"
                    )
                with archive.open(member) as fp:
                    arrays[name.removesuffix(".npy")] = _read_member(
                        fp, member.file_size, what=name.removesuffix(".npy")
                    )
    except StateFileError:
        raise
    except (
        zipfile.BadZipFile,  # truncated or not a zip
        zipfile.LargeZipFile,
        OSError,
        EOFError,
        ValueError,
        NotImplementedError,  # an unsupported compression
        RuntimeError,  # an encrypted member
        zlib.error,  # a corrupt compressed member
    ) as err:
        raise StateFileError(
            "", f"the file is not a readable .npz ({type(err).__name__}: {err})"
        ) from err
    return arrays


# -------------------------------------------------------------------- JSON fields
def _get(tree: Mapping[str, Any], key: str, default: Any) -> Any:
    if key in tree:
        return tree[key]
    if default is _MISSING:
        raise KeyError(key)
    return default


def _field(where: str, key: str) -> str:
    if not key:
        return where
    return f"{where}.{key}" if where else key


def get_int(
    tree: Mapping[str, Any], key: str, *, where: str = "", minimum: int = 0, default: Any = _MISSING
) -> int:
    """Return integer field ``key`` of ``tree`` (``where`` is the tree's own field name).

    Raises
    ------
    StateFileError
        If it is missing (and has no default), not an integer, or below ``minimum``.
    """
    try:
        value = _get(tree, key, default)
    except KeyError:
        raise StateFileError(_field(where, key), "is missing") from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise StateFileError(
            _field(where, key),
            f"is {_shown(value)} ({_kind(value)}); expected an integer >= {minimum}",
        )
    return int(value)


def get_str(tree: Mapping[str, Any], key: str, *, where: str = "", default: Any = _MISSING) -> str:
    """Return string field ``key`` of ``tree``.

    Raises
    ------
    StateFileError
        If it is missing (and has no default) or not a string.
    """
    try:
        value = _get(tree, key, default)
    except KeyError:
        raise StateFileError(_field(where, key), "is missing") from None
    if not isinstance(value, str):
        raise StateFileError(
            _field(where, key), f"is {_shown(value)} ({_kind(value)}); expected a string"
        )
    return value


def get_mapping(
    tree: Mapping[str, Any], key: str, *, where: str = "", default: Any = _MISSING
) -> Mapping[str, Any]:
    """Return mapping field ``key`` of ``tree`` (string keys).

    Raises
    ------
    StateFileError
        If it is missing (and has no default) or not a mapping with string keys.
    """
    try:
        value = _get(tree, key, default)
    except KeyError:
        raise StateFileError(_field(where, key), "is missing") from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise StateFileError(
            _field(where, key), f"is {_shown(value)} ({_kind(value)}); expected a mapping"
        )
    return value


def get_list(
    tree: Mapping[str, Any], key: str, *, where: str = "", default: Any = _MISSING
) -> list[Any]:
    """Return list field ``key`` of ``tree``.

    Raises
    ------
    StateFileError
        If it is missing (and has no default) or not a list.
    """
    try:
        value = _get(tree, key, default)
    except KeyError:
        raise StateFileError(_field(where, key), "is missing") from None
    if not isinstance(value, list):
        raise StateFileError(
            _field(where, key), f"is {_shown(value)} ({_kind(value)}); expected a list"
        )
    return value


def int_list(values: list[Any], *, where: str, minimum: int = 0) -> list[int]:
    """Return ``values`` if every item is an integer >= ``minimum``.

    Raises
    ------
    StateFileError
        Naming the first item that is not.
    """
    return [
        get_int({"": value}, "", where=f"{where}[{i}]", minimum=minimum)
        for i, value in enumerate(values)
    ]


def positive_float(value: Any, *, where: str, maximum: float = math.inf) -> float:
    """Return ``value`` as a float if it is a finite number in ``(0, maximum]``.

    Raises
    ------
    StateFileError
        If it is not a number, not finite, not positive or above ``maximum``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise StateFileError(where, f"is {_shown(value)} ({_kind(value)}); expected a number")
    number = float(value)
    if not (math.isfinite(number) and 0.0 < number <= maximum):
        raise StateFileError(
            where, f"is {number!r}; expected a finite number > 0 and <= {maximum:.4g}"
        )
    return number


# ------------------------------------------------------------------------ arrays
def arrays_problem(
    arrays: Any, expected: Mapping[str, Any], *, where: str = ""
) -> StateFileError | None:
    """Compare decoded arrays with a model's own (names, shapes, dtypes) and check finiteness.

    An array in the other byte order is a problem too (numpy names ``>f4``
    ``float32``, but ``torch.from_numpy`` refuses it); :func:`read_npz` never
    returns one.

    Parameters
    ----------
    arrays : Any
        What the file holds: it must be a mapping of name to numpy array.
    expected : Mapping[str, Any]
        The arrays it must match: numpy arrays or torch tensors (their ``shape``
        and ``dtype`` are used; meta tensors do).
    where : str
        The field that holds ``arrays``, for the message.

    Returns
    -------
    StateFileError or None
        The first problem found, or ``None`` when the arrays match and are finite.
    """
    if not isinstance(arrays, Mapping):
        return StateFileError(where, f"is {_kind(arrays)}; expected a mapping of arrays")
    missing = sorted(set(expected) - set(arrays))
    unexpected = sorted(str(k) for k in set(arrays) - set(expected))
    if missing or unexpected:
        return StateFileError(
            where,
            f"does not have the model's entries: missing {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
            f"{' ...' if len(unexpected) > 3 else ''}",
        )
    for name, want in expected.items():
        value = arrays[name]
        field = _field(where, name)
        if not isinstance(value, np.ndarray):
            return StateFileError(field, f"is {_kind(value)}; expected an array")
        shape, dtype = tuple(int(d) for d in want.shape), dtype_name(want.dtype)
        if tuple(value.shape) != shape or value.dtype.name != dtype:
            return StateFileError(
                field,
                f"is {value.dtype.name} {tuple(value.shape)} but the model has {dtype} {shape}",
            )
        order = byte_order_problem(value.dtype)
        if order is not None:
            return StateFileError(field, order)
        if value.dtype.kind in "fc" and not bool(np.isfinite(value).all()):
            return StateFileError(field, "holds NaN or infinite values")
    return None
