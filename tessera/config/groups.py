"""The groups of a run config that every run reads: scheme, data, training, deployment.

Each field maps to one kebab-case run-config key (:class:`Group`).
"""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, cast

from tessera.config.choices import (
    FLAT_INPUTS,
    NORMS,
    PARTITIONERS,
    PERSONALISE_MODES,
    SIM_DEVICE_PROFILES,
    SIM_ENGINES,
    FlatInput,
    Partitioner,
    Personalise,
    SimEngine,
)
from tessera.config.reader import (
    ConfigReader,
    parse_csv,
    require,
)

__all__ = [
    "DataConfig",
    "DeploymentConfig",
    "PersonaliseConfig",
    "SchemeConfig",
    "TrainingConfig",
]


MAX_NAME_BYTES = 255
"""Longest file or folder name most file systems take (``NAME_MAX``): a longer
``run-name``, or part of ``output-dir``, fails only when the results are written."""


def run_name_problem(name: str) -> str | None:
    """Return why ``name`` cannot be a run's results folder inside ``output-dir``, or ``None``.

    A run name is one folder name: no path separator (``a/../../x`` would write
    outside ``output-dir``), not ``.`` or ``..``, no NUL, at most
    :data:`MAX_NAME_BYTES` bytes.

    >>> run_name_problem("fedavg-seed0") is None
    True
    >>> run_name_problem("a/../../escape")
    'use one folder name, without a path separator'
    >>> run_name_problem("x" * 300)
    'use at most 255 bytes'
    """
    if any(sep in name for sep in ("/", chr(92))):
        return "use one folder name, without a path separator"
    if name.strip() in {".", ".."} or chr(0) in name:
        return "use a folder name other than . or .., without NUL"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"use at most {MAX_NAME_BYTES} bytes"
    return None


def _key(group: type[Group], f: Field[Any]) -> str:
    """Return the run-config key of field ``f`` of ``group``."""
    return str(f.metadata.get("key", group.KEY_PREFIX + f.name.replace("_", "-")))


@dataclass(frozen=True)
class Group:
    """A group of run-config keys.

    A field's key is :attr:`KEY_PREFIX` plus its name in kebab case, or the
    ``"key"`` of its metadata where the two differ (``attack-lambda``).
    """

    KEY_PREFIX: ClassVar[str] = ""

    def items(self) -> list[tuple[str, Any]]:
        """Return ``(key, value)`` of every field, tuples as lists (JSON-safe)."""
        return [(_key(type(self), f), _plain(getattr(self, f.name))) for f in fields(self)]

    def validate(self) -> None:
        """Check the values a range cannot express; raise naming the key and the fix."""


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class SchemeConfig(Group):
    """Which scheme runs, for how long, and the model family and form it uses.

    Attributes
    ----------
    strategy : str
        The scheme (``strategy``), a name in :func:`strategies.list_strategies`.
    num_server_rounds : int
        Rounds of federation.
    model_family : str or None
        The family or cross-family set nodes choose from; None for the scheme's.
    norm : str
        Normalisation layers; an empty key means the scheme's own default.
    flat_input : FlatInput
        How convolutional models read flat samples.
    scheme_defaults : bool
        Whether keys left at their declared value take the scheme's own default
        (:attr:`strategies.core.registry.Scheme.config_defaults`).
    """

    strategy: str
    num_server_rounds: int
    model_family: str | None
    norm: str
    flat_input: FlatInput
    scheme_defaults: bool = True

    @classmethod
    def read(cls, r: ConfigReader, *, default_norm: str) -> SchemeConfig:
        """Read the group from ``r``; an empty ``norm`` becomes ``default_norm``."""
        return cls(
            strategy=r.get("strategy", str),
            num_server_rounds=r.get("num-server-rounds", int),
            model_family=r.optional_str("model-family"),
            norm=r.get("norm", str).strip() or default_norm,
            flat_input=cast("FlatInput", r.get("flat-input", str).strip().lower()),
            scheme_defaults=r.get("scheme-defaults", bool),
        )

    def validate(self) -> None:
        """Check the round count, the normalisation and the input form."""
        require(
            self.num_server_rounds >= 1,
            "num-server-rounds",
            self.num_server_rounds,
            "use 1 or more rounds",
        )
        require(
            self.norm in NORMS,
            "norm",
            self.norm,
            f"use one of {', '.join(NORMS)}, or leave it empty for the scheme's own",
        )
        require(
            self.flat_input in FLAT_INPUTS,
            "flat-input",
            self.flat_input,
            f"use one of {', '.join(FLAT_INPUTS)} (signal: 1-d convolutions over the vector; "
            "square: zero-padded into a square image for 2-d convolutions)",
        )


@dataclass(frozen=True)
class DataConfig(Group):
    """The data set and how it is partitioned among nodes and split.

    Attributes
    ----------
    dataset : str
        The data set's name (:mod:`tessera.data`).
    partitioner : Partitioner
        ``iid``, ``dirichlet`` or ``pathological``.
    dirichlet_alpha : float
        Concentration of the Dirichlet partitioner.
    classes_per_client : int
        Classes each node holds under the pathological partitioner.
    server_pool_fraction : float
        Share of the data the server keeps (RAD, server-side training, test set).
    local_test_fraction : float
        Share of each node's partition held out as its local test set.
    """

    dataset: str
    partitioner: Partitioner
    dirichlet_alpha: float
    classes_per_client: int
    server_pool_fraction: float
    local_test_fraction: float

    @classmethod
    def read(cls, r: ConfigReader) -> DataConfig:
        """Read the group from ``r``."""
        return cls(
            dataset=r.get("dataset", str),
            partitioner=cast("Partitioner", r.get("partitioner", str).lower()),
            dirichlet_alpha=r.get("dirichlet-alpha", float),
            classes_per_client=r.get("classes-per-client", int),
            server_pool_fraction=r.get("server-pool-fraction", float),
            local_test_fraction=r.get("local-test-fraction", float),
        )

    def validate(self) -> None:
        """Check the partitioner and the fractions."""
        require(
            self.partitioner in PARTITIONERS,
            "partitioner",
            self.partitioner,
            f"use one of {', '.join(PARTITIONERS)}",
        )
        require(
            self.dirichlet_alpha > 0,
            "dirichlet-alpha",
            self.dirichlet_alpha,
            "use a positive concentration, e.g. 0.5",
        )
        require(
            self.classes_per_client >= 1,
            "classes-per-client",
            self.classes_per_client,
            "use 1 or more classes per client",
        )
        require(
            0.0 < self.server_pool_fraction < 0.9,
            "server-pool-fraction",
            self.server_pool_fraction,
            "use a fraction in (0, 0.9), e.g. 0.1",
        )
        require(
            0.0 <= self.local_test_fraction < 0.9,
            "local-test-fraction",
            self.local_test_fraction,
            "use a fraction in [0, 0.9), e.g. 0.2",
        )


@dataclass(frozen=True)
class TrainingConfig(Group):
    """The local optimiser and what a node may spend on a round.

    Attributes
    ----------
    local_epochs, batch_size : int
        Epochs over the local data per round, and the minibatch size.
    learning_rate, momentum, weight_decay : float
        SGD's parameters.
    train_time_budget : float
        Seconds a round's local training may take on the node (architecture choice).
    memory_fraction : float
        Share of the node's memory a model may use (architecture choice).
    """

    local_epochs: int
    batch_size: int
    learning_rate: float
    momentum: float
    weight_decay: float
    train_time_budget: float
    memory_fraction: float

    @classmethod
    def read(cls, r: ConfigReader) -> TrainingConfig:
        """Read the group from ``r``."""
        return cls(
            local_epochs=r.get("local-epochs", int),
            batch_size=r.get("batch-size", int),
            learning_rate=r.get("learning-rate", float),
            momentum=r.get("momentum", float),
            weight_decay=r.get("weight-decay", float),
            train_time_budget=r.get("train-time-budget", float),
            memory_fraction=r.get("memory-fraction", float),
        )

    def validate(self) -> None:
        """Check the optimiser's values and the budgets."""
        require(
            self.local_epochs >= 1, "local-epochs", self.local_epochs, "use 1 or more local epochs"
        )
        require(self.batch_size >= 1, "batch-size", self.batch_size, "use a positive batch size")
        require(
            self.learning_rate > 0,
            "learning-rate",
            self.learning_rate,
            "use a positive learning rate, e.g. 0.05",
        )
        require(0.0 <= self.momentum < 1.0, "momentum", self.momentum, "use a momentum in [0, 1)")
        require(
            self.weight_decay >= 0,
            "weight-decay",
            self.weight_decay,
            "use a non-negative weight decay",
        )
        require(
            self.train_time_budget > 0,
            "train-time-budget",
            self.train_time_budget,
            "use a positive number of seconds",
        )
        require(
            0.0 < self.memory_fraction <= 1.0,
            "memory-fraction",
            self.memory_fraction,
            "use a fraction in (0, 1]",
        )


@dataclass(frozen=True)
class DeploymentConfig(Group):
    """Who takes part in a round, how long the server waits, and where results go.

    Attributes
    ----------
    fraction_train : float
        Share of the connected nodes sampled each round.
    min_train_nodes, min_replies, min_nodes : int
        Nodes sampled at least, replies a round needs, nodes the first round waits for.
    max_failed_rounds : int
        Consecutive skipped rounds before the run stops.
    round_timeout, node_wait_timeout, superlink_retry_timeout : float
        Seconds to wait for replies, for the first nodes, and for the SuperLink.
    sim_device_profiles : tuple[str, ...]
        Device profiles the simulated nodes take, in turn.
    output_dir : str
        Folder of the results.
    run_name : str or None
        Name of the run's results folder; None for a time stamp.
    checkpoint_every : int
        Write a checkpoint every k rounds; 0 never.
    resume : str or None
        The checkpoint to continue from.
    sim_engine : SimEngine
        In simulation, how the server's messages reach Flower's engine
        (:mod:`tessera.sim_engine`): ``direct`` (each handed over as it is stored),
        ``indexed`` (at the engine's next sweep) or ``flower`` (Flower's own code).
    """

    fraction_train: float
    min_train_nodes: int
    min_replies: int
    min_nodes: int
    max_failed_rounds: int
    round_timeout: float
    node_wait_timeout: float
    superlink_retry_timeout: float
    sim_device_profiles: tuple[str, ...]
    output_dir: str
    run_name: str | None
    checkpoint_every: int
    resume: str | None
    sim_engine: SimEngine = "direct"

    @classmethod
    def read(cls, r: ConfigReader) -> DeploymentConfig:
        """Read the group from ``r``."""
        return cls(
            fraction_train=r.get("fraction-train", float),
            min_train_nodes=r.get("min-train-nodes", int),
            min_replies=r.get("min-replies", int),
            min_nodes=r.get("min-nodes", int),
            max_failed_rounds=r.get("max-failed-rounds", int),
            round_timeout=r.get("round-timeout", float),
            node_wait_timeout=r.get("node-wait-timeout", float),
            superlink_retry_timeout=r.get("superlink-retry-timeout", float),
            sim_device_profiles=parse_csv(
                r.optional_str("sim-device-profiles"), key="sim-device-profiles"
            ),
            output_dir=r.get("output-dir", str),
            run_name=r.optional_str("run-name"),
            checkpoint_every=r.get("checkpoint-every", int),
            resume=r.optional_str("resume"),
            sim_engine=cast("SimEngine", r.get("sim-engine", str).strip().lower()),
        )

    def validate(self) -> None:
        """Check the counts, the timeouts, the output folder and the engine."""
        require(
            self.round_timeout > 0,
            "round-timeout",
            self.round_timeout,
            "use a positive number of seconds",
        )
        require(self.min_nodes >= 1, "min-nodes", self.min_nodes, "use 1 or more nodes")
        require(
            self.node_wait_timeout > 0,
            "node-wait-timeout",
            self.node_wait_timeout,
            "use a positive number of seconds",
        )
        require(
            0.0 < self.fraction_train <= 1.0,
            "fraction-train",
            self.fraction_train,
            "use a fraction in (0, 1], e.g. 0.5 to train half of the nodes each round",
        )
        require(
            self.min_train_nodes >= 1,
            "min-train-nodes",
            self.min_train_nodes,
            "use 1 or more nodes",
        )
        require(self.min_replies >= 1, "min-replies", self.min_replies, "use 1 or more replies")
        require(
            self.max_failed_rounds >= 1,
            "max-failed-rounds",
            self.max_failed_rounds,
            "use 1 or more consecutive skipped rounds before the run stops",
        )
        require(
            self.checkpoint_every >= 0,
            "checkpoint-every",
            self.checkpoint_every,
            "use 0 (never) or write a checkpoint every k >= 1 rounds",
        )
        require(
            self.superlink_retry_timeout >= 0,
            "superlink-retry-timeout",
            self.superlink_retry_timeout,
            "use a non-negative number of seconds",
        )
        require(
            bool(self.output_dir.strip()),
            "output-dir",
            self.output_dir,
            "name a folder, e.g. results",
        )
        require(
            max(len(part.encode()) for part in self.output_dir.split("/")) <= MAX_NAME_BYTES,
            "output-dir",
            self.output_dir,
            f"name a folder whose every part is at most {MAX_NAME_BYTES} bytes long",
        )
        problem = None if self.run_name is None else run_name_problem(self.run_name)
        require(
            problem is None, "run-name", self.run_name, f"{problem}, e.g. 'fedavg-dirichlet-seed0'"
        )
        unknown = [p for p in self.sim_device_profiles if p not in SIM_DEVICE_PROFILES]
        require(
            not unknown,
            "sim-device-profiles",
            ",".join(self.sim_device_profiles),
            f"name profiles among {', '.join(SIM_DEVICE_PROFILES)} ({', '.join(unknown)} "
            "is not one), or leave it empty",
        )
        require(
            self.sim_engine in SIM_ENGINES,
            "sim-engine",
            self.sim_engine,
            f"use one of {', '.join(SIM_ENGINES)}",
        )


@dataclass(frozen=True)
class PersonaliseConfig(Group):
    """How a node of a weight-sharing scheme personalises (:mod:`client_app.personalise`).

    Attributes
    ----------
    mode : Personalise
        ``none``: the node's model is the one it trained and sent; ``finetune``:
        a copy of the received model trained :attr:`epochs` epochs; ``ditto``: a
        personal model kept in node state, trained towards the received weights with
        :attr:`ditto_lambda`; ``rep``: the received body under a personal head kept
        in node state (the head trained :attr:`epochs` epochs first, the body then).
    epochs : int
        ``finetune``'s epochs and ``rep``'s head epochs.
    ditto_lambda : float
        Ditto's weight of ``lambda/2 * ||v - w||^2`` (``ditto-lambda``).
    """

    KEY_PREFIX: ClassVar[str] = "personalise-"

    mode: Personalise = field(metadata={"key": "personalise"})
    epochs: int
    ditto_lambda: float = field(metadata={"key": "ditto-lambda"})

    @classmethod
    def read(cls, r: ConfigReader) -> PersonaliseConfig:
        """Read the group from ``r``."""
        return cls(
            mode=cast("Personalise", r.get("personalise", str).strip().lower()),
            epochs=r.get("personalise-epochs", int),
            ditto_lambda=r.get("ditto-lambda", float),
        )

    def validate(self) -> None:
        """Check the mode, the epochs and Ditto's lambda."""
        require(
            self.mode in PERSONALISE_MODES,
            "personalise",
            self.mode,
            f"use one of {', '.join(PERSONALISE_MODES)}",
        )
        require(self.epochs >= 1, "personalise-epochs", self.epochs, "use 1 or more epochs")
        require(
            math.isfinite(self.ditto_lambda) and self.ditto_lambda >= 0,
            "ditto-lambda",
            self.ditto_lambda,
            "use a non-negative weight, e.g. 0.1 (0: the personal model trains alone)",
        )
