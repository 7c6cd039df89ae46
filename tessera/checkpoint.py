"""Atomic, pickle-free files for nested state: JSON for the structure, npz for arrays.

A state is a nested structure of dicts (string keys), lists, JSON scalars and numpy
arrays. :func:`save_state` writes it to one ``.npz`` file whose entry ``__tree__``
holds the structure as JSON, with every array replaced by a reference to an entry
``a<k>``. The file is written to a temporary name, flushed to disk and renamed over
the old one, so a crash leaves either the previous file or the new one, never a
mixture. :func:`load_state` reads it back with ``allow_pickle=False``, after
bounding every entry's size by the file's own (:func:`tessera.state_checks.read_npz`:
a small file cannot make it decompress or allocate more), and checks that the JSON
structure and its array references are well formed. The mappings it returns are
:class:`StateTree` objects that know their file and field, so the code that checks
a field's value against its schema (``HeteroStrategy.load_state_dict``,
``GroupModels.load_state_dict``) names both in a :class:`CheckpointError`.

Used by the server's checkpoints (:mod:`strategies.core.strategy`) and by node state that
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

from tessera.config import ConfigError
from tessera.state_checks import StateFileError, arrays_problem, read_npz

TREE = "__tree__"
ARRAY_TAG = "__array__"
FORMAT = 1
FIX = (
    "the file is damaged, edited or not a checkpoint of this Tessera version: resume "
    "from the results folder of an intact run, or start afresh without run-config 'resume'"
)
"""What to do about a checkpoint that fails a check (the end of every such message)."""


class CheckpointError(ConfigError):
    """A state file is missing, unreadable, of another format, or fails its schema.

    A :class:`~tessera.config.ConfigError`: the file to resume from is named by
    run-config ``resume``.
    """


class StateTree(dict[str, Any]):
    """A mapping read from a state file that knows where it came from.

    Parameters
    ----------
    items : Mapping[str, Any]
        The entries.
    source : str
        The file (its path, or what the bytes were).
    field : str
        The mapping's own field in the file (``""`` for the root,
        ``"group_models.arrays"`` for a nested one).
    """

    def __init__(self, items: Mapping[str, Any], *, source: str, field: str) -> None:
        super().__init__(items)
        self.source = source
        self.field = field


def source_of(state: Mapping[str, Any], default: str = "the checkpoint") -> str:
    """Return the file ``state`` was read from (``default`` for a mapping built in memory)."""
    return state.source if isinstance(state, StateTree) else default


def field_of(state: Mapping[str, Any], default: str = "") -> str:
    """Return the field ``state`` sits at in its file (``default`` if it was built in memory)."""
    return state.field if isinstance(state, StateTree) else default


def refusal(state: Mapping[str, Any], err: StateFileError) -> CheckpointError:
    """Return the :class:`CheckpointError` for a failed check of (part of) ``state``.

    The message names the file, the field and :data:`FIX`.
    """
    return CheckpointError(f"checkpoint {source_of(state)}: {err}; {FIX}")


def checked_arrays(
    tree: Mapping[str, Any], key: str, expected: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """Return the arrays under ``key`` if they match ``expected`` and are finite.

    For a scheme's own checkpoint entries of model weights (a personal model, a
    generator's weights): ``expected`` is what the model has (numpy arrays or torch
    tensors, e.g. a freshly built module's ``state_dict()``).

    Raises
    ------
    CheckpointError
        Naming the file, the field and the fix, if ``key`` is missing, a name,
        shape or dtype differs, or a value is not finite.
    """
    field = f"{field_of(tree)}.{key}" if field_of(tree) else key
    if key not in tree:
        raise refusal(tree, StateFileError(field, "is missing"))
    problem = arrays_problem(tree[key], expected, where=field)
    if problem is not None:
        raise refusal(tree, problem)
    return {str(k): np.asarray(v) for k, v in tree[key].items()}


def checked_array(
    tree: Mapping[str, Any],
    key: str,
    *,
    shape: tuple[int | None, ...] | None = None,
    kinds: str = "f",
) -> np.ndarray:
    """Return the array under ``key`` if it has the shape, dtype kind and finite values asked.

    ``shape`` may hold ``None`` for a dimension of any size (``None`` alone: any
    shape); ``kinds`` lists numpy kind letters (``"f"`` floats, ``"iu"`` integers).

    Raises
    ------
    CheckpointError
        Naming the file, the field and the fix.
    """
    field = f"{field_of(tree)}.{key}" if field_of(tree) else key
    value = tree.get(key)
    if not isinstance(value, np.ndarray):
        raise refusal(tree, StateFileError(field, f"is {type(value).__name__}; expected an array"))
    fits = shape is None or (
        value.ndim == len(shape)
        and all(want is None or got == want for got, want in zip(value.shape, shape, strict=True))
    )
    if not fits or value.dtype.kind not in kinds:
        wanted = "any" if shape is None else tuple("*" if d is None else d for d in shape)
        raise refusal(
            tree,
            StateFileError(
                field,
                f"is {value.dtype} {value.shape}; expected shape {wanted} of kind {kinds!r}",
            ),
        )
    if value.dtype.kind in "fc" and not bool(np.isfinite(value).all()):
        raise refusal(tree, StateFileError(field, "holds NaN or infinite values"))
    return value


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


def _inflate(
    value: Any, arrays: Mapping[str, np.ndarray], used: set[str], *, source: str, field: str
) -> Any:
    """Replace array references by the arrays; check each reference (raises StateFileError)."""
    if isinstance(value, dict):
        if ARRAY_TAG in value:
            ref = value[ARRAY_TAG]
            name = f"a{ref}" if isinstance(ref, int) and not isinstance(ref, bool) else ""
            if len(value) != 1 or name not in arrays:
                raise StateFileError(
                    field, f"refers to array {ref!r}, which the file does not hold"
                )
            used.add(name)
            return arrays[name]
        return StateTree(
            {
                k: _inflate(v, arrays, used, source=source, field=f"{field}.{k}" if field else k)
                for k, v in value.items()
            },
            source=source,
            field=field,
        )
    if isinstance(value, list):
        return [
            _inflate(v, arrays, used, source=source, field=f"{field}[{i}]")
            for i, v in enumerate(value)
        ]
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


def state_from_bytes(data: bytes, *, what: str = "state") -> StateTree:
    """Inverse of :func:`state_to_bytes`.

    Every entry's size is bounded by ``len(data)`` before it is read; the structure
    must be JSON of this format whose array references all exist, and every array
    must be referenced. The values of the fields are the reader's to check.

    Raises
    ------
    CheckpointError
        If the bytes are not a state file of this format; the message names ``what``.
    """
    try:
        arrays = read_npz(data)
        if TREE not in arrays:
            raise StateFileError(TREE, "is missing: this is not a Tessera state file")
        raw = arrays.pop(TREE)
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise StateFileError(TREE, f"is {raw.dtype} {raw.shape}; expected uint8 bytes")
        document = json.loads(raw.tobytes().decode("utf-8"))
    except StateFileError as err:
        raise CheckpointError(f"{what} cannot be read: {err}; {FIX}") from err
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(
            f"{what} cannot be read: its structure is not JSON ({type(err).__name__}: {err}); {FIX}"
        ) from err
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(
            f"{what} has format {document.get('format') if isinstance(document, dict) else '?'}"
            f", this version reads format {FORMAT}"
        )
    if not isinstance(document.get("tree"), dict):
        raise CheckpointError(f"{what} does not hold a mapping; {FIX}")
    used: set[str] = set()
    try:
        tree = _inflate(document["tree"], arrays, used, source=what, field="")
    except StateFileError as err:
        raise CheckpointError(f"{what}: {err}; {FIX}") from err
    except RecursionError as err:
        raise CheckpointError(f"{what} is nested too deeply to be a checkpoint; {FIX}") from err
    if not isinstance(tree, StateTree):
        raise CheckpointError(f"{what} holds one array, not a mapping; {FIX}")
    unused = sorted(set(arrays) - used)
    if unused:
        raise CheckpointError(f"{what} holds arrays {unused[:3]} that nothing refers to; {FIX}")
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


def load_state(path: Path) -> StateTree:
    """Read a state written by :func:`save_state`.

    Raises
    ------
    CheckpointError
        If the file is missing or unreadable; the message names the path.
    """
    if not path.is_file():
        raise CheckpointError(f"no state file at {path}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err}); check its permissions") from err
    return state_from_bytes(data, what=str(path))
