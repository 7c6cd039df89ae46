"""What the family's schemes share in their options, and the model they train.

Every scheme reads ``feature-dim`` (the common feature space, shared with Felo and
Velo): :class:`FeatureOptions` holds it, and FedGH's and LG-FedAvg's options derive
from it. FedProto and FedTGP also read ``proto-lambda`` (the weight of the
prototype term in the client's objective): :class:`PrototypeOptions`
(:class:`~strategies.prototypes.fedproto.FedProtoOptions`,
:class:`~strategies.prototypes.fedtgp.FedTGPOptions`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from models.base import TesseraModel
from models.projection import ProjectedModel
from models.spec import ModelRef
from tessera.config import ConfigError, ConfigReader, FlatInput

__all__ = [
    "FeatureOptions",
    "FeatureOptionsT",
    "Key",
    "PrototypeOptions",
    "PrototypeOptionsT",
    "build_prototype_model",
    "read_keys",
]

FeatureOptionsT = TypeVar("FeatureOptionsT", bound="FeatureOptions")
"""The options type of one scheme of the family (a :class:`FeatureOptions`)."""
PrototypeOptionsT = TypeVar("PrototypeOptionsT", bound="PrototypeOptions")
"""The options type of one prototype scheme (a :class:`PrototypeOptions`)."""


@dataclass(frozen=True)
class FeatureOptions:
    """Options every scheme of the family reads from the run config.

    Attributes
    ----------
    feature_dim : int
        Size of the common feature space the prototypes (and the head's input) live
        in (``feature-dim``).
    """

    feature_dim: int = 128

    @classmethod
    def read(cls, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """Read and check the shared keys; return them as constructor arguments.

        Raises
        ------
        ConfigError
            If a value is out of range; the message names the key and the fix.
        """
        return read_keys(
            run_config,
            {"feature_dim": Key("feature-dim", int, 128, 1, "use a positive size, e.g. 128")},
        )


@dataclass(frozen=True)
class PrototypeOptions(FeatureOptions):
    """Options FedProto and FedTGP read: ``feature-dim`` and ``proto-lambda``.

    Attributes
    ----------
    proto_lambda : float
        Weight of the prototype term ``lambda * MSE(f(x), p[y])`` in the client's
        objective (``proto-lambda``; HtFLlib's default 1.0).
    """

    proto_lambda: float = 1.0

    @classmethod
    def read(cls, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """Read ``feature-dim`` and ``proto-lambda`` (a :class:`ConfigError` names a bad one)."""
        own = {"proto_lambda": Key("proto-lambda", float, 1.0, 0, "use a weight >= 0, e.g. 1")}
        return {**super().read(run_config), **read_keys(run_config, own)}


@dataclass(frozen=True)
class Key:
    """A run-config key of a scheme of the family: its type, default and smallest value.

    ``low`` itself is allowed unless ``above`` (a learning rate must be above 0).
    """

    name: str
    kind: type[int] | type[float]
    default: float
    low: float
    fix: str
    above: bool = False


def read_keys(run_config: Mapping[str, Any], keys: Mapping[str, Key]) -> dict[str, Any]:
    """Read each key (:class:`ConfigReader`, its :data:`LIMITS` included), refuse one below its low.

    Returns
    -------
    dict[str, Any]
        The values under the mapping's names (the options' field names).

    Raises
    ------
    ConfigError
        Naming the first key out of range, its value and the fix.
    """
    reader = ConfigReader(run_config, "run-config")
    values: dict[str, Any] = {}
    for field, key in keys.items():
        value = reader.get(key.name, key.kind, key.kind(key.default))
        if value < key.low or (key.above and value == key.low):
            raise ConfigError(f"run-config key '{key.name}' has invalid value {value!r}: {key.fix}")
        values[field] = value
    return values


def build_prototype_model(
    ref: str | ModelRef,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm: str,
    flat_input: FlatInput,
    feature_dim: int,
) -> TesseraModel:
    """Build the zoo model of ``ref`` with its features projected to ``feature_dim``.

    Every architecture then produces prototypes of one size
    (:class:`~models.projection.ProjectedModel`; nothing is added when the native
    size already equals ``feature_dim``).
    """
    from models import get_model

    model = get_model(
        ref, input_shape=input_shape, num_classes=num_classes, norm=norm, flat_input=flat_input
    )
    return ProjectedModel(model, feature_dim=feature_dim)
