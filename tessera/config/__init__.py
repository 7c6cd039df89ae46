"""Run configuration, parsed once from Flower's run config into typed objects.

Flower hands the ServerApp and every ClientApp the same flat ``run_config``
mapping (kebab-case keys). It is read here, at the edge, into :class:`RunConfig`
(nested frozen groups: :mod:`tessera.config.run`); nothing else in the project
touches the raw dict. Scheme-specific keys (``proximal-mu``, ...) are read by the
scheme's own ``parse_options`` from the same mapping through :class:`ConfigReader`.

Each run-config key is declared once, with its default and a comment, in
``[tool.flwr.app.config]`` of ``pyproject.toml``: Flower sends every key of that
table with every run, so the parsers here carry no second copy of the defaults (a
missing key is an error naming it). Which keys the code reads is not listed by hand
either: :func:`recording_reads` collects the keys every :class:`ConfigReader` reads,
and a test checks that they are exactly the declared ones.

The package, one concern a module: :mod:`~tessera.config.choices` (the closed sets
of values), :mod:`~tessera.config.reader` (typed, range-checked reads),
:mod:`~tessera.config.run` (:class:`RunConfig`), its groups in
:mod:`~tessera.config.groups` and :mod:`~tessera.config.robustness`, and
:mod:`~tessera.config.node` (:class:`NodeConfig`).
"""

from tessera.config.choices import (
    ATTACK_PERTURBATIONS,
    ATTACKS,
    FLAT_INPUTS,
    KNOWLEDGE_MERGES,
    OMNISCIENT_ATTACKS,
    PARTITIONERS,
    AttackPerturbation,
    FlatInput,
    KnowledgeMerge,
    Partitioner,
)
from tessera.config.groups import DataConfig, DeploymentConfig, SchemeConfig, TrainingConfig
from tessera.config.node import NodeConfig
from tessera.config.reader import (
    LIMITS,
    MAX_FLOAT32,
    MAX_NODES,
    MAX_ROUNDS,
    ConfigError,
    ConfigReader,
    Limit,
    parse_csv,
    recording_reads,
)
from tessera.config.robustness import AggregationConfig, AttackConfig
from tessera.config.run import RunConfig

__all__ = [
    "ATTACKS",
    "ATTACK_PERTURBATIONS",
    "FLAT_INPUTS",
    "KNOWLEDGE_MERGES",
    "LIMITS",
    "MAX_FLOAT32",
    "MAX_NODES",
    "MAX_ROUNDS",
    "OMNISCIENT_ATTACKS",
    "PARTITIONERS",
    "AggregationConfig",
    "AttackConfig",
    "AttackPerturbation",
    "ConfigError",
    "ConfigReader",
    "DataConfig",
    "DeploymentConfig",
    "FlatInput",
    "KnowledgeMerge",
    "Limit",
    "NodeConfig",
    "Partitioner",
    "RunConfig",
    "SchemeConfig",
    "TrainingConfig",
    "parse_csv",
    "recording_reads",
]
