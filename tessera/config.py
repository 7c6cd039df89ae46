"""Run configuration, parsed once from Flower's run config into typed objects.

Flower hands the ServerApp and every ClientApp the same flat ``run_config``
mapping (kebab-case keys). It is read here, at the edge, into :class:`RunConfig`;
nothing else in the project touches the raw dict. Scheme-specific keys
(``proximal-mu``, ...) are read by the scheme's own ``parse_options`` from the same
mapping through :class:`ConfigReader`.

Each run-config key is declared once, with its default and a comment, in
``[tool.flwr.app.config]`` of ``pyproject.toml``: Flower sends every key of that
table with every run, so the parsers here carry no second copy of the defaults (a
missing key is an error naming it). Which keys the code reads is not listed by hand
either: :func:`recording_reads` collects the keys every :class:`ConfigReader` reads,
and a test checks that they are exactly the declared ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar, cast, get_args

T = TypeVar("T", int, float, str, bool)

Partitioner = Literal["iid", "dirichlet", "pathological"]
PARTITIONERS: tuple[Partitioner, ...] = get_args(Partitioner)
FlatInput = Literal["signal", "square"]
FLAT_INPUTS: tuple[FlatInput, ...] = ("signal", "square")
"""How convolutional models read flat ``(D,)`` samples (run-config ``flat-input``):
as a one-channel signal of length ``D`` (1-d convolutions) or zero-padded and reshaped
into a square one-channel image (2-d convolutions)."""
KnowledgeMerge = Literal["mean", "median", "trimmed-mean"]
KNOWLEDGE_MERGES: tuple[KnowledgeMerge, ...] = get_args(KnowledgeMerge)
"""How per-client knowledge (class features/logits, kernels) is merged: run-config
``knowledge-merge``."""
ATTACKS = (
    "label-flip",
    "backdoor",
    "boost",
    "sign-flip",
    "noise",
    "free-rider",
    "alie",
    "ipm",
    "min-max",
    "min-sum",
    "mimic",
    "dense-scale",
    "bound-riding",
    "ratchet",
    "inflate",
)
"""Hostile behaviours of the attack harness (run-config/node-config ``attack``)."""
OMNISCIENT_ATTACKS = ("alie", "ipm", "min-max", "min-sum", "mimic")
"""Attacks that forge their update from the honest updates of the round (as in the
papers): only the in-process grid can show them those (:mod:`client_app.attacks`),
so a real simulation or deployment refuses them. ``bound-riding`` is omniscient in
the in-process grid and uses its own update elsewhere."""
AttackPerturbation = Literal["std", "sign", "unit"]
ATTACK_PERTURBATIONS: tuple[AttackPerturbation, ...] = get_args(AttackPerturbation)
"""Min-max/min-sum perturbation directions (run-config ``attack-perturbation``)."""

MAX_ROUNDS = 100_000
"""Largest number of rounds any round-counting key accepts."""
MAX_NODES = 100_000
"""Largest number of nodes any node-counting key accepts (a fleet of 1e5 nodes)."""
MAX_FLOAT32 = 1e38
"""Largest magnitude a float32 weight holds with room to spare (float32 max 3.4e38)."""


@dataclass(frozen=True)
class Limit:
    """The range a numeric run-config key, or each item of a comma-separated list, lies in.

    Attributes
    ----------
    high : float
        Largest accepted value.
    fix : str
        What to do instead, for the error message.
    low : float or None
        Smallest accepted value; ``None`` where the key's own check (in
        :meth:`RunConfig.validate` or the scheme's options) gives the lower bound.
    """

    high: float
    fix: str
    low: float | None = None

    def check(self, key: str, raw: object, value: float) -> None:
        """Raise :class:`ConfigError` naming ``key``, ``raw`` and the fix if out of range."""
        if self.low is not None and not self.low <= value <= self.high:
            raise ConfigError(
                f"run-config key '{key}' has value {raw!r}, outside "
                f"[{_number(self.low)}, {_number(self.high)}]: {self.fix}"
            )
        if value > self.high:
            raise ConfigError(
                f"run-config key '{key}' has value {raw!r}, above the largest accepted "
                f"{_number(self.high)}: {self.fix}"
            )


def _number(value: float) -> str:
    """Print a bound as people write it: whole numbers in full, others in short form."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else f"{value:g}"


LIMITS: dict[str, Limit] = {
    # rounds and round counts
    "num-server-rounds": Limit(MAX_ROUNDS, f"use 1 to {MAX_ROUNDS} rounds"),
    "max-failed-rounds": Limit(MAX_ROUNDS, f"use 1 to {MAX_ROUNDS} skipped rounds"),
    "checkpoint-every": Limit(MAX_ROUNDS, f"use 0 (never) to {MAX_ROUNDS} rounds"),
    "align-every": Limit(MAX_ROUNDS, f"use 1 to {MAX_ROUNDS} rounds"),
    "cvae-interval": Limit(MAX_ROUNDS, f"use 1 to {MAX_ROUNDS} rounds"),
    "cvae-history": Limit(MAX_ROUNDS, f"use 0 (all rounds) to {MAX_ROUNDS} rounds"),
    "ensemble-tune-every": Limit(MAX_ROUNDS, f"use 0 (last round only) to {MAX_ROUNDS}"),
    # node counts
    "min-nodes": Limit(MAX_NODES, f"use 1 to {MAX_NODES} nodes"),
    "min-train-nodes": Limit(MAX_NODES, f"use 1 to {MAX_NODES} nodes"),
    "min-replies": Limit(MAX_NODES, f"use 1 to {MAX_NODES} replies"),
    "krum-byzantine": Limit(MAX_NODES, f"use 0 to {MAX_NODES} hostile nodes to tolerate"),
    # data and model sizes
    "classes-per-client": Limit(100_000, "use 1 to 100000 classes"),
    "local-epochs": Limit(1_000, "use 1 to 1000 local epochs"),
    "batch-size": Limit(65_536, "use a batch size of 1 to 65536"),
    "rad-size": Limit(1_000_000, "use at most 1000000 samples (capped at the server pool)"),
    "rad-batch": Limit(1_000_000, "use 0 (the whole RAD) or at most 1000000 rows"),
    "feature-dim": Limit(65_536, "use a feature size of 1 to 65536"),
    "cvae-latent-dim": Limit(65_536, "use a size of 1 to 65536"),
    "cvae-hidden-dim": Limit(65_536, "use a width of 1 to 65536"),
    "cvae-epochs": Limit(100_000, "use 1 to 100000 epochs"),
    "cvae-samples": Limit(100_000, "use 1 to 100000 samples per class"),
    # optimiser budgets
    "ensemble-trials": Limit(100_000, "use 1 to 100000 trials per search, e.g. 50"),
    "ensemble-gradient-steps": Limit(10_000_000, "use 1 to 10000000 steps, e.g. 500"),
    # attack harness
    "attack-inflate": Limit(10**9, "use a factor of 1 to 1000000000, e.g. 1000"),
    # fractions of a distribution and sub-model widths
    "fedfa-percentile": Limit(
        100.0, "use a percentile in [50, 100] (the share of values kept), e.g. 95", low=50.0
    ),
    "submodel-widths": Limit(
        1.0,
        "give width ratios in [1/64, 1] separated by commas, e.g. '1,0.5,0.25,0.125' "
        "(a slice narrower than 1/64 has no channel left in most layers)",
        low=1 / 64,
    ),
}
"""The range each bounded run-config key accepts, declared once: every
:class:`ConfigReader` applies it when it reads the key, whichever module reads it.
Every integer key has an upper bound (``seed`` has its own two-sided range); a
string key listed here is a comma-separated list whose every item is a number in
the range."""


class ConfigError(ValueError):
    """A run-config or node-config value is missing, of the wrong type or invalid."""


_READS: ContextVar[set[tuple[str, str]] | None] = ContextVar("tessera_config_reads", default=None)


@contextmanager
def recording_reads() -> Iterator[set[tuple[str, str]]]:
    """Collect ``(source, key)`` for every key a :class:`ConfigReader` reads inside.

    Yields
    ------
    set[tuple[str, str]]
        Filled while the block runs: ``("run-config", "proximal-mu")``, ...
    """
    reads: set[tuple[str, str]] = set()
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)


class ConfigReader:
    """Typed access to a flat Flower config mapping.

    Parameters
    ----------
    values : Mapping[str, Any]
        The raw ``run_config`` or ``node_config``.
    source : str
        Where the values come from, used in error messages (``"run-config"``).
    """

    def __init__(self, values: Mapping[str, Any], source: str) -> None:
        self._values = dict(values)
        self._source = source

    def _note(self, key: str) -> None:
        reads = _READS.get()
        if reads is not None:
            reads.add((self._source, key))

    def get(self, key: str, kind: type[T], default: T | None = None) -> T:
        """Return ``key`` converted to ``kind``; raise :class:`ConfigError` if bad.

        Parameters
        ----------
        key : str
            The kebab-case key.
        kind : type
            One of ``int``, ``float``, ``str``, ``bool``.
        default : optional
            Returned when the key is absent; without it a missing key raises. Run-
            config keys have none: their defaults live in ``pyproject.toml``.

        Returns
        -------
        int | float | str | bool
            The converted value.
        """
        self._note(key)
        if key not in self._values:
            if default is None:
                declared = (
                    " (it is declared in [tool.flwr.app.config] of pyproject.toml, which "
                    "Flower sends with every run: pass the whole table)"
                    if self._source == "run-config"
                    else ""
                )
                raise ConfigError(
                    f"{self._source} key '{key}' is missing; set it, e.g. "
                    f'--{self._source} "{key}=..."{declared}'
                )
            return default
        raw = self._values[key]
        try:
            value = _convert(raw, kind)
        except (TypeError, ValueError) as err:
            raise ConfigError(
                f"{self._source} key '{key}' has value {raw!r}, which is not a valid "
                f"{kind.__name__}; {err}"
            ) from err
        limit = LIMITS.get(key) if self._source == "run-config" else None
        if limit is not None:
            _check_limit(key, raw, value, limit)
        return value

    def optional_str(self, key: str) -> str | None:
        """Return a string value, or ``None`` when absent or empty."""
        self._note(key)
        if key not in self._values:
            return None
        value = str(self._values[key]).strip()
        return value or None

    def keys(self) -> set[str]:
        """Return the keys present."""
        return set(self._values)


def _convert(raw: Any, kind: type[T]) -> T:
    if kind is bool:
        if isinstance(raw, bool):
            return raw  # type: ignore[return-value]
        if isinstance(raw, str) and raw.lower() in {"true", "false", "1", "0"}:
            return (raw.lower() in {"true", "1"}) is True  # type: ignore[return-value]
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)  # type: ignore[return-value]
        raise ValueError("use true or false")
    if kind is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError("use a whole number")
        return int(raw)  # type: ignore[return-value]
    if kind is float:
        if isinstance(raw, bool):
            raise ValueError("use a number")
        value = float(raw)
        if not math.isfinite(value):
            raise ValueError("use a finite number")
        return value  # type: ignore[return-value]
    return str(raw)  # type: ignore[return-value]


def _check_limit(key: str, raw: object, value: object, limit: Limit) -> None:
    """Apply ``limit`` to a number, or to each item of a comma-separated list."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        limit.check(key, raw, value)
        return
    items = parse_csv(str(value), key=key)
    for item in items:
        try:
            number = float(item)
        except ValueError:
            raise ConfigError(
                f"run-config key '{key}' has value {raw!r}: item {item!r} is not a number; "
                f"{limit.fix}"
            ) from None
        if not math.isfinite(number):
            raise ConfigError(
                f"run-config key '{key}' has value {raw!r}: item {item!r} is not finite; "
                f"{limit.fix}"
            )
        limit.check(key, raw, number)


def _require(condition: bool, key: str, value: object, fix: str) -> None:
    if not condition:
        raise ConfigError(f"run-config key '{key}' has invalid value {value!r}: {fix}")


def parse_csv(value: str | None, *, key: str = "value") -> tuple[str, ...]:
    """Split a comma-separated config value into stripped items.

    Parameters
    ----------
    value : str or None
        The raw text; ``None`` or blank gives ``()``.
    key : str, optional
        The run-config key, for the error message.

    Returns
    -------
    tuple[str, ...]
        The items, stripped.

    Raises
    ------
    ConfigError
        If an item is empty (``"a,,b"``, ``",,,"``, a trailing comma): a list with a
        hole is a typo, not "nothing".
    """
    if value is None or not value.strip():
        return ()
    items = tuple(item.strip() for item in value.split(","))
    if not all(items):
        raise ConfigError(
            f"run-config key '{key}' has value {value!r}, which has an empty name; "
            "separate names with single commas, e.g. 'a,b', or leave it empty"
        )
    return items


@dataclass(frozen=True)
class RunConfig:
    """The common run configuration shared by the ServerApp and ClientApps.

    Attributes mirror the kebab-case keys of ``[tool.flwr.app.config]``.
    """

    strategy: str
    num_server_rounds: int
    dataset: str
    partitioner: Partitioner
    dirichlet_alpha: float
    classes_per_client: int
    server_pool_fraction: float
    local_test_fraction: float
    seed: int
    model_family: str | None
    norm: str
    flat_input: FlatInput
    local_epochs: int
    batch_size: int
    learning_rate: float
    momentum: float
    weight_decay: float
    round_timeout: float
    min_nodes: int
    node_wait_timeout: float
    train_time_budget: float
    memory_fraction: float
    sim_device_profiles: tuple[str, ...]
    output_dir: str
    run_name: str | None
    fraction_train: float
    min_train_nodes: int
    min_replies: int
    max_failed_rounds: int
    checkpoint_every: int
    resume: str | None
    aggregator: str
    superlink_retry_timeout: float
    trim_fraction: float
    krum_byzantine: int
    clip_norm: float
    clip_factor: float
    knowledge_merge: KnowledgeMerge
    attack: tuple[str, ...]
    attack_fraction: float
    attack_lambda: float
    attack_scale: float
    attack_noise: float
    attack_z: float
    attack_epsilon: float
    attack_perturbation: AttackPerturbation
    attack_magnitude: float
    attack_inflate: int
    weight_cap: float
    bound_growth: float
    clip_ceiling: float
    server_trust: bool
    trust_threshold: float
    knowledge_clip_factor: float

    @staticmethod
    def strategy_of(run_config: Mapping[str, Any]) -> str:
        """Return run-config ``strategy`` (the scheme to look up before parsing the rest).

        Raises
        ------
        ConfigError
            If the key is missing or not a string.
        """
        return ConfigReader(run_config, "run-config").get("strategy", str)

    @classmethod
    def from_flower(
        cls, run_config: Mapping[str, Any], *, default_norm: str = "batch"
    ) -> RunConfig:
        """Parse and validate Flower's ``context.run_config``.

        Parameters
        ----------
        run_config : Mapping[str, Any]
            The raw run config.
        default_norm : str
            What an empty ``norm`` means: the scheme's own default
            (:func:`strategies.core.registry.resolve_run` passes it; the sub-model
            schemes use ``"static-batch"``, every other ``"batch"``).

        Returns
        -------
        RunConfig
            The validated configuration.

        Raises
        ------
        ConfigError
            If a value is missing, mistyped or out of range; the message names the
            key, the value and the fix.
        """
        r = ConfigReader(run_config, "run-config")
        seed = r.get("seed", int)
        _require(
            0 <= seed <= 2**32 - 1,
            "seed",
            seed,
            "use an integer in [0, 2**32 - 1] (the range numpy and scikit-learn accept)",
        )
        cfg = cls(
            strategy=r.get("strategy", str),
            num_server_rounds=r.get("num-server-rounds", int),
            dataset=r.get("dataset", str),
            partitioner=cast("Partitioner", r.get("partitioner", str).lower()),
            dirichlet_alpha=r.get("dirichlet-alpha", float),
            classes_per_client=r.get("classes-per-client", int),
            server_pool_fraction=r.get("server-pool-fraction", float),
            local_test_fraction=r.get("local-test-fraction", float),
            seed=seed,
            model_family=r.optional_str("model-family"),
            norm=r.get("norm", str).strip() or default_norm,
            flat_input=cast("FlatInput", r.get("flat-input", str).strip().lower()),
            local_epochs=r.get("local-epochs", int),
            batch_size=r.get("batch-size", int),
            learning_rate=r.get("learning-rate", float),
            momentum=r.get("momentum", float),
            weight_decay=r.get("weight-decay", float),
            round_timeout=r.get("round-timeout", float),
            min_nodes=r.get("min-nodes", int),
            node_wait_timeout=r.get("node-wait-timeout", float),
            train_time_budget=r.get("train-time-budget", float),
            memory_fraction=r.get("memory-fraction", float),
            sim_device_profiles=parse_csv(
                r.optional_str("sim-device-profiles"), key="sim-device-profiles"
            ),
            output_dir=r.get("output-dir", str),
            run_name=r.optional_str("run-name"),
            fraction_train=r.get("fraction-train", float),
            min_train_nodes=r.get("min-train-nodes", int),
            min_replies=r.get("min-replies", int),
            max_failed_rounds=r.get("max-failed-rounds", int),
            checkpoint_every=r.get("checkpoint-every", int),
            resume=r.optional_str("resume"),
            aggregator=r.get("aggregator", str).strip().lower(),
            superlink_retry_timeout=r.get("superlink-retry-timeout", float),
            trim_fraction=r.get("trim-fraction", float),
            krum_byzantine=r.get("krum-byzantine", int),
            clip_norm=r.get("clip-norm", float),
            clip_factor=r.get("clip-factor", float),
            knowledge_merge=cast("KnowledgeMerge", r.get("knowledge-merge", str).strip().lower()),
            attack=tuple(a.lower() for a in parse_csv(r.optional_str("attack"), key="attack")),
            attack_fraction=r.get("attack-fraction", float),
            attack_lambda=r.get("attack-lambda", float),
            attack_scale=r.get("attack-scale", float),
            attack_noise=r.get("attack-noise", float),
            attack_z=r.get("attack-z", float),
            attack_epsilon=r.get("attack-epsilon", float),
            attack_perturbation=cast(
                "AttackPerturbation", r.get("attack-perturbation", str).strip().lower()
            ),
            attack_magnitude=r.get("attack-magnitude", float),
            attack_inflate=r.get("attack-inflate", int),
            weight_cap=r.get("weight-cap", float),
            bound_growth=r.get("bound-growth", float),
            clip_ceiling=r.get("clip-ceiling", float),
            server_trust=r.get("server-trust", bool),
            trust_threshold=r.get("trust-threshold", float),
            knowledge_clip_factor=r.get("knowledge-clip-factor", float),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check ranges; raise :class:`ConfigError` naming the key and the fix."""
        for key, value in self.to_dict().items():
            if key in LIMITS and isinstance(value, (int, float)):
                _check_limit(key, value, value, LIMITS[key])
        _require(
            self.num_server_rounds >= 1,
            "num-server-rounds",
            self.num_server_rounds,
            "use 1 or more rounds",
        )
        _require(
            self.partitioner in PARTITIONERS,
            "partitioner",
            self.partitioner,
            f"use one of {', '.join(PARTITIONERS)}",
        )
        _require(
            self.dirichlet_alpha > 0,
            "dirichlet-alpha",
            self.dirichlet_alpha,
            "use a positive concentration, e.g. 0.5",
        )
        _require(
            self.classes_per_client >= 1,
            "classes-per-client",
            self.classes_per_client,
            "use 1 or more classes per client",
        )
        _require(
            0.0 < self.server_pool_fraction < 0.9,
            "server-pool-fraction",
            self.server_pool_fraction,
            "use a fraction in (0, 0.9), e.g. 0.1",
        )
        _require(
            0.0 <= self.local_test_fraction < 0.9,
            "local-test-fraction",
            self.local_test_fraction,
            "use a fraction in [0, 0.9), e.g. 0.2",
        )
        _require(
            self.flat_input in FLAT_INPUTS,
            "flat-input",
            self.flat_input,
            f"use one of {', '.join(FLAT_INPUTS)} (signal: 1-d convolutions over the vector; "
            "square: zero-padded into a square image for 2-d convolutions)",
        )
        _require(
            self.local_epochs >= 1, "local-epochs", self.local_epochs, "use 1 or more local epochs"
        )
        _require(self.batch_size >= 1, "batch-size", self.batch_size, "use a positive batch size")
        _require(
            self.learning_rate > 0,
            "learning-rate",
            self.learning_rate,
            "use a positive learning rate, e.g. 0.05",
        )
        _require(0.0 <= self.momentum < 1.0, "momentum", self.momentum, "use a momentum in [0, 1)")
        _require(
            self.weight_decay >= 0,
            "weight-decay",
            self.weight_decay,
            "use a non-negative weight decay",
        )
        _require(
            self.round_timeout > 0,
            "round-timeout",
            self.round_timeout,
            "use a positive number of seconds",
        )
        _require(self.min_nodes >= 1, "min-nodes", self.min_nodes, "use 1 or more nodes")
        _require(
            self.node_wait_timeout > 0,
            "node-wait-timeout",
            self.node_wait_timeout,
            "use a positive number of seconds",
        )
        _require(
            self.train_time_budget > 0,
            "train-time-budget",
            self.train_time_budget,
            "use a positive number of seconds",
        )
        _require(
            0.0 < self.memory_fraction <= 1.0,
            "memory-fraction",
            self.memory_fraction,
            "use a fraction in (0, 1]",
        )
        _require(
            0.0 < self.fraction_train <= 1.0,
            "fraction-train",
            self.fraction_train,
            "use a fraction in (0, 1], e.g. 0.5 to train half of the nodes each round",
        )
        _require(
            self.min_train_nodes >= 1,
            "min-train-nodes",
            self.min_train_nodes,
            "use 1 or more nodes",
        )
        _require(self.min_replies >= 1, "min-replies", self.min_replies, "use 1 or more replies")
        _require(
            self.max_failed_rounds >= 1,
            "max-failed-rounds",
            self.max_failed_rounds,
            "use 1 or more consecutive skipped rounds before the run stops",
        )
        _require(
            self.checkpoint_every >= 0,
            "checkpoint-every",
            self.checkpoint_every,
            "use 0 (never) or write a checkpoint every k >= 1 rounds",
        )
        _require(
            self.superlink_retry_timeout >= 0,
            "superlink-retry-timeout",
            self.superlink_retry_timeout,
            "use a non-negative number of seconds",
        )
        _require(
            0.0 <= self.trim_fraction < 0.5,
            "trim-fraction",
            self.trim_fraction,
            "use a fraction in [0, 0.5), e.g. 0.1",
        )
        _require(
            self.krum_byzantine >= 0,
            "krum-byzantine",
            self.krum_byzantine,
            "use the number of hostile nodes to tolerate, 0 or more",
        )
        _require(self.clip_norm > 0, "clip-norm", self.clip_norm, "use a positive L2 norm")
        _require(
            self.clip_factor == 0 or self.clip_factor >= 1,
            "clip-factor",
            self.clip_factor,
            "use 0 (no bound) or a multiple >= 1 of the cohort's median distance, e.g. 3",
        )
        _require(
            self.knowledge_merge in KNOWLEDGE_MERGES,
            "knowledge-merge",
            self.knowledge_merge,
            f"use one of {', '.join(KNOWLEDGE_MERGES)}",
        )
        unknown = [a for a in self.attack if a not in ATTACKS]
        _require(
            not unknown,
            "attack",
            ",".join(self.attack),
            f"name attacks among {', '.join(ATTACKS)} (comma-separated), or leave it empty",
        )
        _require(
            0.0 <= self.attack_fraction <= 1.0,
            "attack-fraction",
            self.attack_fraction,
            "use the share of partitions that attack, in [0, 1]",
        )
        _require(
            math.isfinite(self.attack_lambda) and self.attack_lambda >= 0,
            "attack-lambda",
            self.attack_lambda,
            "use a non-negative intensity, e.g. 1.0",
        )
        _require(
            math.isfinite(self.attack_scale) and self.attack_scale > 0,
            "attack-scale",
            self.attack_scale,
            "use a positive factor, e.g. 10",
        )
        _require(
            math.isfinite(self.attack_noise) and self.attack_noise >= 0,
            "attack-noise",
            self.attack_noise,
            "use a non-negative standard deviation, e.g. 1.0",
        )
        _require(
            self.attack_z >= 0,
            "attack-z",
            self.attack_z,
            "use 0 (ALIE's z from the paper's formula) or a positive z, e.g. 1.5",
        )
        _require(
            self.attack_epsilon > 0,
            "attack-epsilon",
            self.attack_epsilon,
            "use a positive IPM factor, e.g. 0.5 (0.1 to 100 in the paper)",
        )
        _require(
            self.attack_perturbation in ATTACK_PERTURBATIONS,
            "attack-perturbation",
            self.attack_perturbation,
            f"use one of {', '.join(ATTACK_PERTURBATIONS)} (min-max/min-sum direction)",
        )
        _require(
            0 < self.attack_magnitude <= MAX_FLOAT32,
            "attack-magnitude",
            self.attack_magnitude,
            f"use a positive magnitude of at most {MAX_FLOAT32:g} (float32 weights stay "
            "finite), e.g. 1e30",
        )
        _require(
            1 <= self.attack_inflate <= LIMITS["attack-inflate"].high,
            "attack-inflate",
            self.attack_inflate,
            LIMITS["attack-inflate"].fix,
        )
        _require(
            self.weight_cap == 0 or self.weight_cap >= 1,
            "weight-cap",
            self.weight_cap,
            "use 0 (no cap) or a multiple >= 1 of the cohort's median claimed training-set "
            "size, e.g. 2",
        )
        _require(
            self.bound_growth > 1,
            "bound-growth",
            self.bound_growth,
            "use a factor > 1 by which the clip bound may move per round, e.g. 2",
        )
        _require(
            self.clip_ceiling >= 0,
            "clip-ceiling",
            self.clip_ceiling,
            "use 0 (off) or a non-negative multiple of the global model's norm, e.g. 4",
        )
        _require(
            self.knowledge_clip_factor == 0 or self.knowledge_clip_factor >= 1,
            "knowledge-clip-factor",
            self.knowledge_clip_factor,
            "use 0 (no bound) or a multiple >= 1 of the cohort's median row norm, e.g. 3",
        )
        _require(
            -1 <= self.trust_threshold < 1,
            "trust-threshold",
            self.trust_threshold,
            "use a cosine in [-1, 1), e.g. 0 (drop updates that point away from the "
            "server's own update); switch the check off with server-trust=false",
        )
        _require(
            bool(self.output_dir.strip()),
            "output-dir",
            self.output_dir,
            "name a folder, e.g. results",
        )

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict with the kebab-case keys."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            out[key.replace("_", "-")] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class NodeConfig:
    """What a SuperNode's ``--node-config`` (or simulation) says about this node.

    Attributes
    ----------
    partition_id, num_partitions : int | None
        The node's data partition (simulation, or deployment on shared data).
    arch : str | None
        Forces an architecture instead of the device-aware choice.
    device_profile : str | None
        Names a predefined device profile instead of probing.
    data_path : str | None
        A local ``.npz`` file the device trains on instead of a partition.
    state_dir : str | None
        A folder where the node keeps its state across restarts (profile,
        personal model, scheme state); ``None`` keeps it in memory only.
    attack : str | None
        Makes this node hostile (the attack harness, :mod:`client_app.attacks`):
        one of :data:`ATTACKS` but the :data:`OMNISCIENT_ATTACKS`, which need the
        round's honest updates and so the in-process grid.
    """

    partition_id: int | None
    num_partitions: int | None
    arch: str | None
    device_profile: str | None
    data_path: str | None
    state_dir: str | None = None
    attack: str | None = None

    @property
    def owner(self) -> str:
        """Which data this node trains on, as stored with its state."""
        if self.data_path is not None:
            return f"data:{self.data_path}"
        return f"partition:{self.partition_id}/{self.num_partitions}"

    @classmethod
    def from_flower(cls, node_config: Mapping[str, Any]) -> NodeConfig:
        """Parse Flower's ``context.node_config``.

        Raises
        ------
        ConfigError
            If the partition keys are inconsistent or neither data source is given.
        """
        r = ConfigReader(node_config, "node-config")
        keys = r.keys()
        pid = r.get("partition-id", int) if "partition-id" in keys else None
        nparts = r.get("num-partitions", int) if "num-partitions" in keys else None
        data_path = r.optional_str("data-path")
        if data_path is None:
            if pid is None or nparts is None:
                raise ConfigError(
                    "node-config needs either 'partition-id' and 'num-partitions' "
                    "or 'data-path'; start the SuperNode with e.g. --node-config "
                    '"partition-id=0 num-partitions=3"'
                )
            if nparts < 1 or not 0 <= pid < nparts:
                raise ConfigError(
                    f"node-config partition-id={pid} num-partitions={nparts} is "
                    "invalid: partition-id must be in [0, num-partitions)"
                )
        return cls(
            partition_id=pid,
            num_partitions=nparts,
            arch=r.optional_str("arch"),
            device_profile=r.optional_str("device-profile"),
            data_path=data_path,
            state_dir=r.optional_str("state-dir"),
            attack=_node_attack(r.optional_str("attack")),
        )


def _node_attack(value: str | None) -> str | None:
    if value is None:
        return None
    name = value.strip().lower()
    client_side = [a for a in ATTACKS if a not in OMNISCIENT_ATTACKS]
    if name in OMNISCIENT_ATTACKS:
        raise ConfigError(
            f"node-config 'attack' is '{value}', which forges its update from the honest "
            "updates of the round: only the in-process harness (benchmarks/robustness.py) "
            f"can run it; a node alone can run {', '.join(client_side)}"
        )
    if name not in ATTACKS:
        raise ConfigError(
            f"node-config 'attack' is '{value}'; use one of {', '.join(client_side)} or "
            "leave it out"
        )
    return name
