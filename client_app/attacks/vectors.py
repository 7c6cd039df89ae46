"""Replies as flat vectors: the update an attack reads and the arrays it writes back.

:func:`flatten` and :func:`unflatten` turn named arrays into one float64 vector and
back; :func:`weight_keys`, :func:`weight_start` and :func:`weight_update` read a
node's learned parameters, the weights it started from and its update ``w - w0``
out of an exchange of the in-process grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Message

from tessera import wire

if TYPE_CHECKING:
    from tessera.local_grid import Exchange


def flatten(arrays: Mapping[str, np.ndarray], keys: Sequence[str]) -> np.ndarray:
    """Concatenate ``arrays[k]`` for ``k`` in ``keys`` into one float64 vector."""
    if not keys:
        return np.zeros(0)
    return np.concatenate([np.asarray(arrays[k], np.float64).ravel() for k in keys])


def unflatten(
    vector: np.ndarray, like: Mapping[str, np.ndarray], keys: Sequence[str]
) -> dict[str, np.ndarray]:
    """Split ``vector`` into arrays shaped and typed as ``like[k]`` for ``k`` in ``keys``.

    Raises
    ------
    ValueError
        If the vector's length is not the total size of those arrays.
    """
    total = sum(int(np.asarray(like[k]).size) for k in keys)
    if vector.shape != (total,):
        raise ValueError(
            f"a vector of shape {vector.shape} cannot fill arrays of {total} values; "
            "flatten and unflatten with the same keys"
        )
    out: dict[str, np.ndarray] = {}
    offset = 0
    for key in keys:
        ref = np.asarray(like[key])
        part = vector[offset : offset + ref.size].reshape(ref.shape)
        with np.errstate(over="ignore"):
            out[key] = part.astype(ref.dtype)
        offset += ref.size
    return out


def message_arrays(message: Message, name: str) -> dict[str, np.ndarray] | None:
    """Return the arrays of ``message``'s array record ``name`` (``None`` if it has none)."""
    records = message.content.array_records
    if name not in records:
        return None
    return wire.record_to_numpy(records[name])


def shapes_of(arrays: Mapping[str, np.ndarray], keys: Sequence[str]) -> list[tuple[Any, ...]]:
    """Return ``(key, shape)`` of ``arrays[k]`` for ``k`` in ``keys``."""
    return [(k, np.asarray(arrays[k]).shape) for k in keys]


def weight_keys(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Return the floating entries of a weights record that are learned parameters."""
    from strategies.core.aggregators import entry_kind

    return [
        k
        for k, v in arrays.items()
        if np.issubdtype(np.asarray(v).dtype, np.floating) and entry_kind(k) == "parameters"
    ]


def weight_start(exchange: Exchange, keys: Sequence[str]) -> np.ndarray:
    """Return the flat ``w0`` a node's update over ``keys`` is measured from.

    Each entry is the same entry of the weights the server sent the node, or zero
    where it sent none of that name and shape (the node's ``arrays`` record has them).
    """
    sent = message_arrays(exchange.instruction, wire.ARRAYS) or {}
    replied = message_arrays(exchange.reply, wire.ARRAYS) or {}
    start = {
        k: sent[k]
        if k in sent and np.asarray(sent[k]).shape == np.asarray(replied[k]).shape
        else np.zeros(np.asarray(replied[k]).shape)
        for k in keys
    }
    return flatten(start, keys)


def weight_update(exchange: Exchange, keys: Sequence[str]) -> np.ndarray:
    """Return a node's flat update ``w - w0`` over ``keys`` of its ``arrays`` record."""
    replied = message_arrays(exchange.reply, wire.ARRAYS) or {}
    return np.asarray(flatten(replied, keys) - weight_start(exchange, keys))
