"""The global head FedGH and LG-FedAvg share: its arrays, its checks, how a node takes it.

Every node's model is a :class:`~models.projection.ProjectedModel`: its own zoo body
projected to ``feature-dim``, then one linear head ``Linear(feature-dim, classes)``
of the same shape on every node, whose ``state_dict`` entries are ``head.weight``
(float32 ``(classes, feature-dim)``) and ``head.bias`` (float32 ``(classes,)``)
(:data:`HEAD_KEYS`). Those two arrays are all that FedGH's server sends and all
that LG-FedAvg's nodes and server exchange, in the usual weights record
(``arrays``), so the attack harness measures and tampers with them as with any
weights.

:func:`head_spec` is what a reply's (or a checkpoint's) head must match;
:func:`load_global_head` puts the server's head into a node's personal model after
checking it with the core's own check of weight records
(:func:`~strategies.core.validation.check_arrays`: names, shapes, dtypes, decoded
bytes, finite values).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from models.base import TesseraModel
from strategies.core.validation import ArraySpec, check_arrays
from tessera import wire
from tessera.config import ConfigError

__all__ = [
    "HEAD_BIAS",
    "HEAD_KEYS",
    "HEAD_WEIGHT",
    "head_arrays",
    "head_record",
    "head_spec",
    "initial_head",
    "linear_head",
    "load_global_head",
]

HEAD_WEIGHT = "head.weight"
HEAD_BIAS = "head.bias"
HEAD_KEYS = (HEAD_WEIGHT, HEAD_BIAS)
"""The head's entries in a projected model's ``state_dict``: all that is exchanged."""


def head_spec(*, num_classes: int, feature_dim: int) -> ArraySpec:
    """Return the names, shapes and dtypes of the head's arrays."""
    return {
        HEAD_WEIGHT: ((num_classes, feature_dim), "float32"),
        HEAD_BIAS: ((num_classes,), "float32"),
    }


def linear_head(arrays: Mapping[str, np.ndarray]) -> nn.Linear:
    """Return an ``nn.Linear`` holding (copies of) the head ``arrays``."""
    weight = np.asarray(arrays[HEAD_WEIGHT], dtype=np.float32)
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight.copy()))
        layer.bias.copy_(torch.from_numpy(np.asarray(arrays[HEAD_BIAS], dtype=np.float32).copy()))
    return layer


def head_arrays(head: nn.Linear) -> dict[str, np.ndarray]:
    """Return ``head``'s weights as the exchanged arrays (float32 copies)."""
    return {
        HEAD_WEIGHT: head.weight.detach().cpu().numpy().astype(np.float32, copy=True),
        HEAD_BIAS: head.bias.detach().cpu().numpy().astype(np.float32, copy=True),
    }


def initial_head(*, num_classes: int, feature_dim: int, seed: int) -> dict[str, np.ndarray]:
    """Return a freshly initialised head (PyTorch's ``nn.Linear`` init, seeded by ``seed``).

    The global head before any round: the same in every process of one run, and
    drawn without touching the global random state.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return head_arrays(nn.Linear(feature_dim, num_classes))


def load_global_head(model: TesseraModel, record: ArrayRecord) -> None:
    """Replace ``model``'s head weights by the server's head in ``record``.

    Raises
    ------
    ConfigError
        If the record is not exactly a finite head of this model's shape: server
        and client disagree on run-config ``feature-dim``, the task or the scheme.
    """
    spec = head_spec(num_classes=model.num_classes, feature_dim=model.feature_dim)
    checked = check_arrays(record, spec)
    if isinstance(checked, str):
        raise ConfigError(
            f"the server's global head is unusable ({checked}); server and client "
            "disagree on run-config 'feature-dim', the task or the scheme"
        )
    head = model.get_classifier()
    with torch.no_grad():
        for name, param in (("weight", head.weight), ("bias", head.bias)):
            value = torch.from_numpy(checked[f"head.{name}"].copy())
            param.copy_(value.to(device=param.device, dtype=param.dtype))


def head_record(model: TesseraModel) -> ArrayRecord:
    """Return ``model``'s head as the exchanged weights record (its :data:`HEAD_KEYS` only)."""
    return wire.numpy_to_record(head_arrays(model.get_classifier()))
