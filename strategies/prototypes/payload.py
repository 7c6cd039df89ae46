"""The prototype record: what FedProto and FedTGP exchange, and its untrusted-input checks.

A client's prototypes are the per-class means of its features (the projected
``forward_features``, see :mod:`models.projection`) over its training data, with the
number of samples behind each (:func:`collect_prototypes`). The server answers with
its global prototypes in the same format.

Wire format (one :class:`~flwr.app.ArrayRecord`, kebab-case keys):

``class-ids``
    int64 ``(K,)``, distinct, in ``[0, num_classes)``, at least one;
``counts``
    int64 ``(K,)``, positive; a client's sum to its reply's ``num-examples``;
``prototypes``
    float32 ``(K, feature_dim)``, finite.

The client sends it as record ``class-prototypes``; the server sends record
``global-prototypes`` (counts: the samples behind each global prototype).
:func:`prototype_problem` checks the arrays of either (the server's checkpoint
too); :func:`check_prototype_record` checks a client's reply before any arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from models.base import TesseraModel
from strategies.felo.knowledge import class_means
from tessera import wire
from tessera.data import ArrayDataset

__all__ = [
    "CLASS_IDS",
    "CLASS_PROTOTYPES",
    "COUNTS",
    "GLOBAL_PROTOTYPES",
    "PROTOTYPES",
    "PROTO_ACCURACY",
    "ClassPrototypes",
    "check_prototype_record",
    "collect_prototypes",
    "prototype_problem",
    "prototypes_to_record",
    "record_to_prototypes",
]

CLASS_PROTOTYPES = "class-prototypes"
"""Record name of a client's per-class prototypes in its train reply."""
GLOBAL_PROTOTYPES = "global-prototypes"
"""Record name of the server's global prototypes in a train message."""
CLASS_IDS = "class-ids"
COUNTS = "counts"
PROTOTYPES = "prototypes"
KEYS = (CLASS_IDS, COUNTS, PROTOTYPES)
"""The arrays a prototype record holds, and nothing else."""
PROTO_ACCURACY = "proto-accuracy"
"""Reply metric: nearest-global-prototype accuracy on the node's own test split."""


@dataclass(frozen=True)
class ClassPrototypes:
    """Per-class prototypes with the number of samples behind each.

    Attributes
    ----------
    class_ids : np.ndarray
        int64 ``(K,)``: the classes present, distinct.
    counts : np.ndarray
        int64 ``(K,)``: samples per class, positive.
    prototypes : np.ndarray
        float32 ``(K, feature_dim)``: one prototype per class.
    """

    class_ids: np.ndarray
    counts: np.ndarray
    prototypes: np.ndarray

    @property
    def feature_dim(self) -> int:
        """Width of the prototypes."""
        return int(self.prototypes.shape[1])

    def table(self, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter into ``(known (num_classes,) bool, prototypes (num_classes, D))`` tensors."""
        ids = torch.from_numpy(self.class_ids.astype(np.int64))
        known = torch.zeros(num_classes, dtype=torch.bool)
        known[ids] = True
        table = torch.zeros((num_classes, self.feature_dim))
        table[ids] = torch.from_numpy(self.prototypes.astype(np.float32))
        return known, table


@torch.no_grad()
def features_of(model: TesseraModel, data: ArrayDataset, *, batch_size: int = 256) -> np.ndarray:
    """Return ``model.forward_features`` of every sample of ``data`` (eval mode), ``(N, D)``."""
    model.eval()
    device = next(model.parameters()).device
    chunks = [
        model.forward_features(torch.from_numpy(data.x[i : i + batch_size]).to(device)).cpu()
        for i in range(0, len(data), batch_size)
    ]
    return torch.cat(chunks).numpy() if chunks else np.zeros((0, model.feature_dim), np.float32)


def collect_prototypes(model: TesseraModel, data: ArrayDataset) -> ClassPrototypes:
    """Per-class mean features of ``data`` under ``model`` (after training, eval mode).

    Parameters
    ----------
    model : TesseraModel
        The trained model (projected to the common feature size).
    data : ArrayDataset
        The client's training data.

    Returns
    -------
    ClassPrototypes
        The classes present, their counts and mean features.
    """
    ids, counts, means = class_means(features_of(model, data), data.y, model.num_classes)
    return ClassPrototypes(ids, counts, means)


def prototypes_to_record(protos: ClassPrototypes) -> ArrayRecord:
    """Encode prototypes as an :class:`ArrayRecord` (see the module docstring)."""
    return wire.numpy_to_record(
        {
            CLASS_IDS: protos.class_ids.astype(np.int64),
            COUNTS: protos.counts.astype(np.int64),
            PROTOTYPES: protos.prototypes.astype(np.float32),
        }
    )


def record_to_prototypes(record: ArrayRecord) -> ClassPrototypes:
    """Decode a record that :func:`check_prototype_record` (or the server) vouched for."""
    arrays = wire.record_to_numpy(record)
    return ClassPrototypes(arrays[CLASS_IDS], arrays[COUNTS], arrays[PROTOTYPES])


def prototype_problem(
    arrays: Mapping[str, np.ndarray], *, num_classes: int, feature_dim: int
) -> str | None:
    """Return why ``arrays`` are not a valid prototype record, or ``None``.

    Exactly the keys of :data:`KEYS`; ``class-ids`` a non-empty 1-d int64 array of
    distinct ids in ``[0, num_classes)``; ``counts`` one positive int64 per class;
    ``prototypes`` float32 ``(K, feature_dim)``, every value finite. Shapes and
    dtypes are checked before any value is read.
    """
    if set(arrays) != set(KEYS):
        return f"the record holds {sorted(arrays)}, expected {sorted(KEYS)}"
    ids, counts, protos = (arrays[k] for k in KEYS)
    for key, value, ndim in ((CLASS_IDS, ids, 1), (COUNTS, counts, 1), (PROTOTYPES, protos, 2)):
        dtype = np.float32 if key == PROTOTYPES else np.int64
        if value.ndim != ndim or value.dtype != dtype:
            return f"'{key}' must be {ndim}-d {np.dtype(dtype)}, got {value.dtype}{value.shape}"
    k = ids.shape[0]
    if k == 0:
        return f"'{CLASS_IDS}' is empty; send the prototypes of at least one class"
    outside = ids[(ids < 0) | (ids >= num_classes)]
    if outside.size:
        return f"class id(s) {outside[:5].tolist()} out of range [0, {num_classes})"
    if np.unique(ids).size != k:
        return f"class ids {ids.tolist()[:20]} repeat a class"
    if counts.shape != (k,):
        return f"'{COUNTS}' has shape {counts.shape}, expected ({k},): one count per class"
    if np.any(counts <= 0):
        return f"count {int(counts.min())} is not positive; every class sent has samples"
    if protos.shape != (k, feature_dim):
        return (
            f"'{PROTOTYPES}' has shape {protos.shape}, expected {(k, feature_dim)} "
            f"(feature dimension {protos.shape[1]} vs {feature_dim}: run-config 'feature-dim')"
        )
    if not np.all(np.isfinite(protos)):
        return f"'{PROTOTYPES}' has non-finite values"
    return None


def check_prototype_record(
    content: RecordDict, *, num_classes: int, feature_dim: int
) -> str | None:
    """Validate a client's ``class-prototypes`` record; return a reason to reject, or ``None``.

    Besides :func:`prototype_problem`: the counts, summed as Python integers (no
    wrap-around, whatever the sender put in them), must equal the reply's
    ``num-examples``, which the round has already checked against the node's
    handshake; an optional ``proto-accuracy`` metric must lie in ``[0, 1]``.

    Parameters
    ----------
    content : RecordDict
        The reply's records.
    num_classes : int
        Number of classes of the task.
    feature_dim : int
        Run-config ``feature-dim``.

    Returns
    -------
    str | None
        Why the reply must be rejected, or ``None`` when it is fine.
    """
    if CLASS_PROTOTYPES not in content.array_records:
        return f"record '{CLASS_PROTOTYPES}' missing"
    try:
        arrays = wire.record_to_numpy(content.array_records[CLASS_PROTOTYPES])
    except Exception as err:
        return f"'{CLASS_PROTOTYPES}' cannot be decoded: {err}"
    problem = prototype_problem(arrays, num_classes=num_classes, feature_dim=feature_dim)
    if problem is not None:
        return f"'{CLASS_PROTOTYPES}': {problem}"
    total = sum(int(c) for c in arrays[COUNTS])  # Python ints: no wrap-around
    metrics = content.metric_records.get(wire.METRICS)
    try:
        claimed = None if metrics is None else wire.int_value(metrics, wire.NUM_EXAMPLES)
    except (KeyError, ValueError) as err:
        return f"'{wire.NUM_EXAMPLES}' unusable: {err}"
    if claimed != total:
        return f"counts sum to {total} but the reply reports {wire.NUM_EXAMPLES}={claimed}"
    accuracy = None if metrics is None else metrics.get(PROTO_ACCURACY)
    if accuracy is not None and not (
        isinstance(accuracy, (int, float)) and 0.0 <= float(accuracy) <= 1.0
    ):
        return f"metric '{PROTO_ACCURACY}' is {accuracy!r}, outside [0, 1]"
    return None
