"""Atomic, pickle-free files for nested state: JSON for the structure, npz for arrays.

A state is a nested structure of dicts (string keys), lists, JSON scalars and numpy
arrays. :func:`save_state` writes it to one ``.npz`` file whose entry ``__tree__``
holds the structure as JSON, with every array replaced by a reference to an entry
``a<k>``. The file is written to a temporary name, flushed to disk and renamed over
the old one, so a crash leaves either the previous file or the new one, never a
mixture. :func:`load_state` reads it back with ``allow_pickle=False``.

Used by the server's checkpoints (:mod:`strategies.base`) and by node state that
must survive a device restart (:mod:`tessera.node_state`).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

TREE = "__tree__"
ARRAY_TAG = "__array__"
FORMAT = 1


class CheckpointError(ValueError):
    """A state file is missing, unreadable or of another format."""


def _flatten(value: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(value, np.ndarray):
        arrays.append(value)
        return {ARRAY_TAG: len(arrays) - 1}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"state keys must be strings, got {key!r}")
            if key == ARRAY_TAG:
                raise TypeError(f"'{ARRAY_TAG}' is reserved in state keys")
            out[key] = _flatten(item, arrays)
        return out
    if isinstance(value, (list, tuple)):
        return [_flatten(item, arrays) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} in a state file")


def _inflate(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(value, dict):
        if set(value) == {ARRAY_TAG}:
            return arrays[f"a{value[ARRAY_TAG]}"]
        return {k: _inflate(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_inflate(v, arrays) for v in value]
    return value


def state_to_bytes(state: Mapping[str, Any]) -> bytes:
    """Serialise a nested state to the bytes of an ``.npz`` file (no pickles)."""
    arrays: list[np.ndarray] = []
    tree = _flatten(dict(state), arrays)
    document = json.dumps({"format": FORMAT, "tree": tree}, allow_nan=True)
    entries: dict[str, np.ndarray] = {TREE: np.frombuffer(document.encode("utf-8"), dtype=np.uint8)}
    for i, array in enumerate(arrays):
        if array.dtype.hasobject:
            raise TypeError("object arrays cannot be stored in a state file")
        entries[f"a{i}"] = np.ascontiguousarray(array)
    buffer = io.BytesIO()
    np.savez(buffer, **entries)  # type: ignore[arg-type]
    return buffer.getvalue()


def state_from_bytes(data: bytes, *, what: str = "state") -> dict[str, Any]:
    """Inverse of :func:`state_to_bytes`.

    Raises
    ------
    CheckpointError
        If the bytes are not a state file of this format.
    """
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        document = json.loads(bytes(arrays.pop(TREE)).decode("utf-8"))
    except Exception as err:
        raise CheckpointError(f"{what} cannot be read ({type(err).__name__}: {err})") from err
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(
            f"{what} has format {document.get('format') if isinstance(document, dict) else '?'}"
            f", this version reads format {FORMAT}"
        )
    tree = _inflate(document["tree"], arrays)
    if not isinstance(tree, dict):
        raise CheckpointError(f"{what} does not hold a mapping")
    return tree


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_state(path: Path, state: Mapping[str, Any]) -> int:
    """Write ``state`` to ``path`` atomically; return the file size in bytes."""
    data = state_to_bytes(state)
    write_atomic(path, data)
    return len(data)


def load_state(path: Path) -> dict[str, Any]:
    """Read a state written by :func:`save_state`.

    Raises
    ------
    CheckpointError
        If the file is missing or unreadable; the message names the path.
    """
    if not path.is_file():
        raise CheckpointError(f"no state file at {path}")
    return state_from_bytes(path.read_bytes(), what=str(path))
