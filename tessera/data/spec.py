"""Dataset references and partitioning settings (parsed and validated, nothing loaded)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tessera.data.arrays import DataError

SCHEMES = ("iid", "dirichlet", "pathological")
CLASS_ASSIGNMENT_MODES = ("deterministic", "random", "first-deterministic")
HF_ALIASES: Mapping[str, str] = {
    "cifar10": "uoft-cs/cifar10",
    "cifar100": "uoft-cs/cifar100",
    "fashion_mnist": "zalando-datasets/fashion_mnist",
    "mnist": "ylecun/mnist",
}
SPEC_FORMS = (
    "'digits', 'npz:<path to .npz>', 'hf:<hub dataset id>', a hub id "
    f"'owner/name', or one of {sorted(HF_ALIASES)}"
)


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed dataset reference.

    Parameters
    ----------
    kind : str
        ``"digits"``, ``"npz"`` or ``"hf"``.
    target : str
        The npz path or the hub dataset id; empty for ``digits``.
    """

    kind: str
    target: str = ""

    def __post_init__(self) -> None:
        """Check the kind and that npz/hf specs carry a target."""
        if self.kind not in ("digits", "npz", "hf"):
            raise DataError(f"dataset kind {self.kind!r} is unknown; use 'digits', 'npz' or 'hf'")
        if self.kind != "digits" and not self.target:
            raise DataError(
                f"dataset spec '{self.kind}:' has no {self.kind} target; write "
                f"'{self.kind}:<{'path' if self.kind == 'npz' else 'name'}>'"
            )

    def __str__(self) -> str:
        """Return the canonical spec string, e.g. ``hf:uoft-cs/cifar10``."""
        return self.kind if self.kind == "digits" else f"{self.kind}:{self.target}"


@dataclass(frozen=True)
class PartitionConfig:
    """How the client pool is split across clients.

    Parameters
    ----------
    scheme : str
        ``"iid"``, ``"dirichlet"`` or ``"pathological"``.
    alpha : float
        Dirichlet concentration (smaller is more skewed); dirichlet only.
    classes_per_client : int
        Number of classes each client holds; pathological only.
    seed : int
        Seed of the server-pool split, the partitioner and the local splits.
    min_partition_size : int
        Fewest samples any partition may have. Dirichlet redraws (up to 10
        times, as flwr-datasets does) until it holds; other schemes raise.
    self_balancing : bool
        Dirichlet only: stop giving samples to partitions that already exceed
        the average size (flwr-datasets ``self_balancing``).
    class_assignment : str
        Pathological only: ``"deterministic"`` (partition ``i`` gets classes
        ``i, i+1, ..., i+k-1`` modulo the class count), ``"random"`` or
        ``"first-deterministic"`` (flwr-datasets ``class_assignment_mode``).

    Raises
    ------
    DataError
        If a field is out of range.
    """

    scheme: str
    alpha: float = 0.5
    classes_per_client: int = 2
    seed: int = 42
    min_partition_size: int = 1
    self_balancing: bool = False
    class_assignment: str = "deterministic"

    def __post_init__(self) -> None:
        """Validate every field."""
        if self.scheme not in SCHEMES:
            raise DataError(f"partition scheme {self.scheme!r} is unknown; use one of {SCHEMES}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise DataError(
                f"dirichlet alpha={self.alpha!r} must be a finite number > 0; "
                "e.g. 0.1 (very skewed) to 100 (close to iid)"
            )
        if self.classes_per_client < 1:
            raise DataError(f"classes_per_client={self.classes_per_client} must be >= 1")
        if self.seed < 0:
            raise DataError(f"seed={self.seed} must be >= 0")
        if self.min_partition_size < 1:
            raise DataError(
                f"min_partition_size={self.min_partition_size} must be >= 1 so that "
                "every client has data"
            )
        if self.class_assignment not in CLASS_ASSIGNMENT_MODES:
            raise DataError(
                f"class_assignment={self.class_assignment!r} is unknown; use one of "
                f"{CLASS_ASSIGNMENT_MODES}"
            )


def parse_dataset_spec(spec: str) -> DatasetSpec:
    """Parse a dataset reference.

    Parameters
    ----------
    spec : str
        ``"digits"``, ``"npz:<path>"``, ``"hf:<hub id>"``, a hub id ``owner/name``,
        or a short name (``cifar10``, ``cifar100``, ``fashion_mnist``, ``mnist``).

    Returns
    -------
    DatasetSpec
        The parsed spec; short names resolve to their hub ids.

    Raises
    ------
    DataError
        If ``spec`` matches none of the forms.
    """
    text = spec.strip()
    if text.lower() == "digits":
        return DatasetSpec(kind="digits")
    prefix, sep, rest = text.partition(":")
    if sep and prefix.lower() in ("npz", "hf"):
        kind = prefix.lower()
        target = rest.strip()
        if kind == "hf":
            target = HF_ALIASES.get(target.lower(), target)
        return DatasetSpec(kind=kind, target=target)
    if text.lower() in HF_ALIASES:
        return DatasetSpec(kind="hf", target=HF_ALIASES[text.lower()])
    if not sep and text.count("/") == 1 and all(text.split("/")):
        return DatasetSpec(kind="hf", target=text)
    raise DataError(f"dataset spec {spec!r} is not recognised; use {SPEC_FORMS}")


@dataclass(frozen=True)
class KnownTask:
    """The sample shape and class count of a dataset, known without loading it.

    Parameters
    ----------
    input_shape : tuple of int
        Shape of one sample as :func:`~tessera.data.loaders.load_bundle` returns it.
    num_classes : int
        The dataset's class count.
    """

    input_shape: tuple[int, ...]
    num_classes: int


KNOWN_TASKS: Mapping[str, KnownTask] = {
    "digits": KnownTask((1, 8, 8), 10),
    "hf:uoft-cs/cifar10": KnownTask((3, 32, 32), 10),
    "hf:uoft-cs/cifar100": KnownTask((3, 32, 32), 100),  # fine labels
    "hf:zalando-datasets/fashion_mnist": KnownTask((1, 28, 28), 10),
    "hf:ylecun/mnist": KnownTask((1, 28, 28), 10),
}
"""The task of each dataset whose shape and classes are fixed, by canonical spec
(``str(DatasetSpec)``): the bundled digits and the hub datasets of the short names.
A node checks what it cached against it before the server has announced the task
(at the handshake)."""


def known_task(spec: DatasetSpec | str) -> KnownTask | None:
    """Return the task of a dataset known without loading it (:data:`KNOWN_TASKS`).

    Parameters
    ----------
    spec : DatasetSpec or str
        The dataset.

    Returns
    -------
    KnownTask or None
        Its sample shape and class count; ``None`` for a dataset that must be
        loaded to know them (an ``.npz`` file, another hub dataset).

    Raises
    ------
    DataError
        If ``spec`` is a string that is not a dataset spec.
    """
    parsed = parse_dataset_spec(spec) if isinstance(spec, str) else spec
    return KNOWN_TASKS.get(str(parsed))
