"""The run configuration: :class:`RunConfig`, grouped into nested frozen configs.

Flower sends every ClientApp and the ServerApp one flat mapping of kebab-case keys.
:meth:`RunConfig.from_flower` reads it once into seven groups, each one concern:

========================  =====================================================
``run.scheme``            which scheme, how many rounds, the model family and form
``run.data``              the data set and how it is partitioned and split
``run.training``          the local optimiser and a node's budgets
``run.aggregation``       the server's merge and its bounds
``run.deployment``        who takes part, timeouts, results and checkpoints
``run.attack``            the attack harness (research only)
``run.personalise``       how a weight-sharing scheme's nodes personalise
========================  =====================================================

``run.seed`` stays at the top: it seeds the data, the models and the sampling alike.
Every field maps to one key (:meth:`RunConfig.to_dict` gives them back flat, as the
results' ``config.json`` and the resume check record them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.config.groups import (
    DataConfig,
    DeploymentConfig,
    Group,
    PersonaliseConfig,
    SchemeConfig,
    TrainingConfig,
)
from tessera.config.reader import (
    LIMITS,
    ConfigReader,
    check_limit,
    require,
)
from tessera.config.robustness import AggregationConfig, AttackConfig

__all__ = ["RunConfig"]


@dataclass(frozen=True)
class RunConfig:
    """The run configuration shared by the ServerApp and the ClientApps.

    Attributes
    ----------
    seed : int
        Seeds the partitions, the models and the sampling.
    scheme : SchemeConfig
        Scheme, rounds, model family and form.
    data : DataConfig
        Data set, partitioning and splits.
    training : TrainingConfig
        Local optimiser and budgets.
    aggregation : AggregationConfig
        The server's merge and its bounds.
    deployment : DeploymentConfig
        Participation, timeouts, results and checkpoints.
    attack : AttackConfig
        The attack harness.
    personalise : PersonaliseConfig
        How the nodes of a weight-sharing scheme personalise.
    """

    seed: int
    scheme: SchemeConfig
    data: DataConfig
    training: TrainingConfig
    aggregation: AggregationConfig
    deployment: DeploymentConfig
    attack: AttackConfig
    personalise: PersonaliseConfig

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
        require(
            0 <= seed <= 2**32 - 1,
            "seed",
            seed,
            "use an integer in [0, 2**32 - 1] (the range numpy and scikit-learn accept)",
        )
        cfg = cls(
            seed=seed,
            scheme=SchemeConfig.read(r, default_norm=default_norm),
            data=DataConfig.read(r),
            training=TrainingConfig.read(r),
            aggregation=AggregationConfig.read(r),
            deployment=DeploymentConfig.read(r),
            attack=AttackConfig.read(r),
            personalise=PersonaliseConfig.read(r),
        )
        cfg.validate()
        return cfg

    @property
    def groups(self) -> tuple[Group, ...]:
        """The nested configs, in the order :meth:`to_dict` lists their keys."""
        return (
            self.scheme,
            self.data,
            self.training,
            self.aggregation,
            self.deployment,
            self.attack,
            self.personalise,
        )

    def validate(self) -> None:
        """Check ranges; raise :class:`~tessera.config.ConfigError` naming the key and fix."""
        for key, value in self.to_dict().items():
            if key in LIMITS and isinstance(value, (int, float)):
                check_limit(key, value, value, LIMITS[key])
        for group in self.groups:
            group.validate()

    def to_dict(self) -> dict[str, Any]:
        """Return a flat JSON-safe dict with the kebab-case keys."""
        out: dict[str, Any] = {"seed": self.seed}
        for group in self.groups:
            out.update(group.items())
        return out
