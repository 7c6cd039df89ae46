"""The message schema shared by every scheme, and byte accounting.

Record names and metric keys are kebab-case on the wire, as in Flower. A scheme adds
its own records next to these (its payload schema lives in its own module).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

# Record names
CONFIG = "config"
ARRAYS = "arrays"
METRICS = "metrics"
PROFILE = "profile"

# Metric keys every train reply carries
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"
TEST_ACCURACY = "test-accuracy"
TEST_LOSS = "test-loss"
NUM_TEST_EXAMPLES = "num-test-examples"
TRAIN_SECONDS = "train-seconds"
SHARED_ACCURACY = "shared-accuracy"
"""Optional train metric (run-config ``personalise`` ``finetune``/``ditto``): the sent
model's accuracy on the node's test split, beside the personal one's ``test-accuracy``."""
REQUIRED_TRAIN_METRICS = (
    NUM_EXAMPLES,
    TRAIN_LOSS,
    TEST_ACCURACY,
    TEST_LOSS,
    NUM_TEST_EXAMPLES,
    TRAIN_SECONDS,
)

# Query types (``query.<name>``)
HANDSHAKE = "query.handshake"


def payload_bytes(content: RecordDict) -> int:
    """Return the serialised size of a message's records in bytes.

    This is the protobuf encoding Flower sends over gRPC (arrays included), so it
    measures what actually crosses the network for the payload, without transport
    framing.

    Parameters
    ----------
    content : RecordDict
        The records of a message.

    Returns
    -------
    int
        Number of bytes.
    """
    return int(recorddict_to_proto(content).ByteSize())


def _signature(content: RecordDict) -> Hashable:
    """Return what determines a message's payload size, cheaply.

    Array records are taken by identity (messages built from one shared record have
    the same one); config and metric records, small, by value.
    """
    parts: list[Hashable] = []
    for name, record in sorted(content.items(), key=lambda item: item[0]):
        if isinstance(record, (ConfigRecord, MetricRecord)):
            parts.append((name, type(record).__name__, repr(sorted(record.items()))))
        else:
            parts.append((name, type(record).__name__, id(record)))
    return tuple(parts)


def payload_sizes(contents: Sequence[RecordDict]) -> list[int]:
    """Return :func:`payload_bytes` of each content, serialising each distinct one once.

    A round sends the same records to many nodes (one global model per architecture,
    shared between their messages, as Flower's own strategies do); measuring every
    message would serialise the model once per node. Contents with the same records
    (array records by identity, config and metric records by value) have the same
    size and are measured once.

    Parameters
    ----------
    contents : Sequence[RecordDict]
        The messages' records.

    Returns
    -------
    list[int]
        Bytes of each, in order.
    """
    sizes: dict[Hashable, int] = {}
    out: list[int] = []
    for content in contents:
        key = _signature(content)
        if key not in sizes:
            sizes[key] = payload_bytes(content)
        out.append(sizes[key])
    return out


LOCAL_ONLY_SUFFIXES = ("num_batches_tracked",)
"""State entries that never travel: batch-norm step counters are local bookkeeping
(averaging them means nothing), and identical counters in several nodes' replies are
identical objects in Flower 1.30's content-addressed object store, where a reply
that shares an object with one the server is deleting can be lost (an SQLite
``FOREIGN KEY constraint failed`` in the SuperLink log)."""


def is_exchanged(name: str) -> bool:
    """Whether a ``state_dict`` entry is sent over the wire."""
    return not name.endswith(LOCAL_ONLY_SUFFIXES)


def exchanged_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return the entries of a ``state_dict`` that are exchanged (CPU copies)."""
    return {k: v.detach().cpu() for k, v in state.items() if is_exchanged(k)}


def state_to_record(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Convert the exchanged entries of a ``state_dict`` to an :class:`ArrayRecord`."""
    return ArrayRecord(exchanged_state(state))


def record_to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Convert an :class:`ArrayRecord` to a dict of numpy arrays, in key order."""
    return {key: record[key].numpy() for key in record}


def numpy_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Convert a dict of numpy arrays to an :class:`ArrayRecord`."""
    return ArrayRecord(
        {k: torch.from_numpy(np.array(v, order="C", copy=True)) for k, v in arrays.items()}
    )


def int_value(record: Mapping[str, object], key: str) -> int:
    """Return ``record[key]`` as an ``int``: an integer or a whole float, never a bool.

    A message value is untrusted: ``int()`` alone would accept ``True``, truncate
    ``2.7`` and parse text. Raises ``KeyError`` when the key is missing and
    ``ValueError`` naming the key and the value otherwise.
    """
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'{key}' is {value!r}, not a whole number")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"'{key}' is {value!r}, not a whole number")
    return int(value)


def float_value(record: Mapping[str, object], key: str) -> float:
    """Return ``record[key]`` as a ``float``: a number, never a bool or text.

    Raises ``KeyError`` when the key is missing and ``ValueError`` naming the key and
    the value otherwise (a non-finite value is returned; callers that need a finite
    one check it).
    """
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'{key}' is {value!r}, not a number")
    return float(value)


def int_list_value(record: Mapping[str, object], key: str) -> tuple[int, ...]:
    """Return ``record[key]`` as a tuple of ``int`` (each as :func:`int_value` reads it).

    Raises ``KeyError`` when the key is missing and ``ValueError`` naming the key and
    the value otherwise.
    """
    value = record[key]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"'{key}' is {value!r}, not a list of whole numbers")
    return tuple(int_value({key: v}, key) for v in value)
