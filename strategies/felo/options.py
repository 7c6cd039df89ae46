"""Felo, Velo and FedHe's run-config options (``felo-*``, ``cvae-*``) and their model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from models.base import TesseraModel
from models.projection import ProjectedModel
from models.spec import ModelRef
from strategies.felo.cvae import CVAEConfig
from tessera.config import ConfigError, ConfigReader, FlatInput


@dataclass(frozen=True)
class FeloOptions:
    """Options of ``felo``, ``velo`` and ``fedhe``, read once from the run config.

    Attributes
    ----------
    feature_dim : int
        Size of the common feature space (``feature-dim``).
    alpha : float
        Weight of the target terms in equation (1) (``felo-alpha``).
    temperature : float
        Distillation temperature of the KL term (``felo-temperature``).
    share_weights : bool
        Average weights within architecture groups (``felo-share-weights``);
        always false for ``fedhe``.
    exchange_features : bool
        Whether features are exchanged (``felo``, ``velo``) or logits only
        (``fedhe``); set by the scheme, not by a key.
    cvae_interval : int
        Velo trains its CVAE in rounds 1, 1 + k, 1 + 2k, ... (``cvae-interval``).
    cvae_latent_dim : int
        Latent size of the CVAE (``cvae-latent-dim``).
    cvae_hidden_dim : int
        Hidden width of the CVAE's encoder and decoder (``cvae-hidden-dim``).
    cvae_epochs : int
        Epochs per CVAE training (``cvae-epochs``).
    cvae_learning_rate : float
        Adam learning rate of the CVAE (``cvae-learning-rate``).
    cvae_samples : int
        Decoded samples averaged into each class's synthetic feature
        (``cvae-samples``).
    cvae_history : int
        Rounds of received features the CVAE trains on and the server keeps, 0 for
        all (``cvae-history``; the paper keeps all, so memory grows with the rounds).
    """

    feature_dim: int = 128
    alpha: float = 0.5
    temperature: float = 1.0
    share_weights: bool = True
    exchange_features: bool = True
    cvae_interval: int = 1
    cvae_latent_dim: int = 16
    cvae_hidden_dim: int = 128
    cvae_epochs: int = 100
    cvae_learning_rate: float = 1e-3
    cvae_samples: int = 16
    cvae_history: int = 0

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> FeloOptions:
        """Read and validate the options (as for ``felo``).

        Raises
        ------
        ConfigError
            If a value is out of range; the message names the key and the fix.
        """
        r = ConfigReader(run_config, "run-config")
        d = cls()
        opts = cls(
            feature_dim=r.get("feature-dim", int, d.feature_dim),
            alpha=r.get("felo-alpha", float, d.alpha),
            temperature=r.get("felo-temperature", float, d.temperature),
            share_weights=r.get("felo-share-weights", bool, d.share_weights),
            cvae_interval=r.get("cvae-interval", int, d.cvae_interval),
            cvae_latent_dim=r.get("cvae-latent-dim", int, d.cvae_latent_dim),
            cvae_hidden_dim=r.get("cvae-hidden-dim", int, d.cvae_hidden_dim),
            cvae_epochs=r.get("cvae-epochs", int, d.cvae_epochs),
            cvae_learning_rate=r.get("cvae-learning-rate", float, d.cvae_learning_rate),
            cvae_samples=r.get("cvae-samples", int, d.cvae_samples),
            cvae_history=r.get("cvae-history", int, d.cvae_history),
        )
        checks = (
            (
                "feature-dim",
                opts.feature_dim >= 1,
                "use a positive size, e.g. 128 (512 for resnet)",
            ),
            ("felo-alpha", opts.alpha >= 0, "use a non-negative weight, e.g. 0.5"),
            ("felo-temperature", opts.temperature > 0, "use a positive temperature, e.g. 1.0"),
            ("cvae-interval", opts.cvae_interval >= 1, "train the CVAE every 1 or more rounds"),
            ("cvae-latent-dim", opts.cvae_latent_dim >= 1, "use a positive size, e.g. 16"),
            ("cvae-hidden-dim", opts.cvae_hidden_dim >= 1, "use a positive width, e.g. 128"),
            ("cvae-epochs", opts.cvae_epochs >= 1, "use 1 or more epochs"),
            ("cvae-learning-rate", opts.cvae_learning_rate > 0, "use a positive rate, e.g. 1e-3"),
            ("cvae-samples", opts.cvae_samples >= 1, "average 1 or more samples per class"),
            ("cvae-history", opts.cvae_history >= 0, "use 0 (all rounds) or a round count"),
        )
        for key, ok, fix in checks:
            if not ok:
                value = run_config.get(key)
                raise ConfigError(f"run-config key '{key}' has invalid value {value!r}: {fix}")
        return opts

    @classmethod
    def parse_fedhe(cls, run_config: Mapping[str, Any]) -> FeloOptions:
        """Options for ``fedhe``: logits only, never weights."""
        return replace(cls.parse(run_config), share_weights=False, exchange_features=False)

    def cvae_config(self, num_classes: int) -> CVAEConfig:
        """Return the settings of Velo's CVAE for a task with ``num_classes`` classes."""
        return CVAEConfig(
            feature_dim=self.feature_dim,
            num_classes=num_classes,
            latent_dim=self.cvae_latent_dim,
            hidden_dim=self.cvae_hidden_dim,
            epochs=self.cvae_epochs,
            learning_rate=self.cvae_learning_rate,
        )


def build_scheme_model(
    arch: str | ModelRef,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    norm: str,
    flat_input: FlatInput,
    options: FeloOptions,
) -> TesseraModel:
    """Build the model a scheme trains: the zoo's, projected when features are exchanged."""
    from models import get_model

    model = get_model(
        arch, input_shape=input_shape, num_classes=num_classes, norm=norm, flat_input=flat_input
    )
    if options.exchange_features:
        return ProjectedModel(model, feature_dim=options.feature_dim)
    return model
