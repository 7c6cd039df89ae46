"""Velo's server.

Felo whose per-class features come from a conditional VAE trained on every feature
the server received.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch

from strategies.felo.cvae import CVAE, CVAEConfig, CVAETrainResult, train_cvae
from strategies.felo.knowledge import ClassKnowledge, content_order
from strategies.felo.server import FeloStrategy, log


def checked_cvae(state: Mapping[str, Any], key: str, config: CVAEConfig) -> CVAE:
    """Return the CVAE whose weights are checkpoint entry ``key``, checked first.

    The entry must hold exactly the arrays of ``CVAE(config).state_dict()`` (names,
    shapes, dtypes), all finite, and the standardisation ``scale`` must be
    positive (features are divided by it).

    Raises
    ------
    CheckpointError
        Naming the checkpoint file, the field and the fix; a shape that differs
        may also come from other ``feature-dim`` or ``cvae-*`` settings than the
        checkpoint's.
    """
    from tessera.checkpoint import checked_arrays, field_of, refusal
    from tessera.state_checks import StateFileError

    model = CVAE(config)
    weights = checked_arrays(state, key, model.state_dict())
    if np.any(weights["scale"] <= 0):
        where = f"{field_of(state)}.{key}" if field_of(state) else key
        raise refusal(
            state,
            StateFileError(
                f"{where}.scale", "holds a value <= 0; a standardisation scale is positive"
            ),
        )
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})
    return model


class VeloStrategy(FeloStrategy):
    """Velo's server: synthetic per-class features from a conditional VAE."""

    keeps_rows: ClassVar[bool] = True
    """The CVAE trains on every received feature row, so the knowledge is not folded."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.feature_bank: list[tuple[int, np.ndarray, np.ndarray]] = []
        """``(round, class ids, features)`` of every client reply kept."""
        self.cvae: CVAE | None = None
        self.last_training: CVAETrainResult | None = None
        self.cvae_classes: np.ndarray = np.zeros(0, dtype=np.int64)
        """Classes the current CVAE was trained on."""

    def state_dict(self) -> dict[str, Any]:
        """Felo's state plus the feature bank and the CVAE's weights."""
        bank = self.feature_bank
        feature_dim = self.felo.feature_dim
        return {
            **super().state_dict(),
            "bank_rounds": np.array([r for r, _, _ in bank], dtype=np.int64),
            "bank_sizes": np.array([len(i) for _, i, _ in bank], dtype=np.int64),
            "bank_ids": (
                np.concatenate([i for _, i, _ in bank]) if bank else np.zeros(0, np.int64)
            ),
            "bank_features": (
                np.concatenate([f for _, _, f in bank])
                if bank
                else np.zeros((0, feature_dim), np.float32)
            ),
            "cvae": None
            if self.cvae is None
            else {k: v.detach().cpu().numpy() for k, v in self.cvae.state_dict().items()},
            "cvae_classes": self.cvae_classes,
        }

    def checked_scheme_state(self, state: Mapping[str, Any]) -> Callable[[], None]:
        """Check Felo's entries, the feature bank and the CVAE; return what assigns them.

        The bank is ``bank_rounds`` and ``bank_sizes`` (one integer per reply kept:
        its round, in ``[1, round]`` of the checkpoint, and its number of classes,
        >= 1), ``bank_ids`` (the class ids, in ``[0, num_classes)``, as many as the
        sizes add up to) and ``bank_features`` (finite floats, one row of
        ``feature-dim`` per id); ``cvae_classes`` are class ids; ``cvae`` is
        ``None`` or exactly the arrays of this run's CVAE (names, shapes, dtypes),
        finite, its standardisation ``scale`` positive.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        from tessera.checkpoint import checked_array, refusal
        from tessera.state_checks import StateFileError

        restore_felo = super().checked_scheme_state(state)
        num_classes = self.env.num_classes
        rounds = checked_array(state, "bank_rounds", shape=(None,), kinds="iu")
        sizes = checked_array(state, "bank_sizes", shape=rounds.shape, kinds="iu")
        try:
            if rounds.size and (rounds.min() < 1 or rounds.max() > self.completed_round):
                raise StateFileError(
                    "bank_rounds",
                    f"holds rounds {rounds.min()} to {rounds.max()}; expected rounds in "
                    f"[1, {self.completed_round}] (the checkpoint's round)",
                )
            if sizes.size and sizes.min() < 1:
                raise StateFileError(
                    "bank_sizes", f"holds {sizes.min()}; every reply kept has >= 1 class"
                )
        except StateFileError as err:
            raise refusal(state, err) from err
        total = sum(int(n) for n in sizes)  # Python integers: no wrap-around
        ids = checked_array(state, "bank_ids", shape=(total,), kinds="iu")
        features = checked_array(state, "bank_features", shape=(total, self.felo.feature_dim))
        classes = checked_array(state, "cvae_classes", shape=(None,), kinds="iu")
        try:
            for key, values in (("bank_ids", ids), ("cvae_classes", classes)):
                outside = values[(values < 0) | (values >= num_classes)]
                if outside.size:
                    raise StateFileError(
                        key,
                        f"holds {outside[:5].tolist()}, outside the task's classes "
                        f"[0, {num_classes})",
                    )
        except StateFileError as err:
            raise refusal(state, err) from err
        cvae = None
        if state.get("cvae") is not None:
            cvae = checked_cvae(state, "cvae", self.felo.cvae_config(num_classes))
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        bank = [
            (
                int(rnd),
                ids[offsets[k] : offsets[k + 1]].astype(np.int64),
                features[offsets[k] : offsets[k + 1]].astype(np.float32),
            )
            for k, rnd in enumerate(rounds)
        ]

        def restore() -> None:
            restore_felo()
            self.feature_bank = bank
            self.cvae_classes = classes.astype(np.int64)
            self.cvae = cvae

        return restore

    def target_state(self) -> Any:
        """Return the feature bank and the CVAE, which :meth:`make_targets` replaces."""
        return (list(self.feature_bank), self.cvae, self.cvae_classes, self.last_training)

    def restore_target_state(self, saved: Any) -> None:
        """Put back the feature bank and the CVAE of :meth:`target_state`."""
        self.feature_bank, self.cvae, self.cvae_classes, self.last_training = saved

    def bank_arrays(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        """Return the CVAE's training set: features and labels within ``cvae-history``."""
        history = self.felo.cvae_history
        rows = [
            (ids, feats)
            for rnd, ids, feats in self.feature_bank
            if history == 0 or rnd > server_round - history
        ]
        return np.concatenate([f for _, f in rows]), np.concatenate([i for i, _ in rows])

    def make_targets(
        self, server_round: int, parts: Sequence[ClassKnowledge], merged: ClassKnowledge
    ) -> tuple[ClassKnowledge, dict[str, Any]]:
        """Store the received features, train the CVAE when due, decode class features.

        The parts are banked in :func:`~strategies.felo.knowledge.content_order`: the
        CVAE's training depends on the order of its rows, and in arrival order a
        seeded run did not reproduce (Velo's pathological(2) seed 0 read 93.8 % and
        98.1 % at the same settings).
        """
        for part in content_order(parts):
            assert part.features is not None  # checked by the reply schema
            self.feature_bank.append((server_round, part.class_ids, part.features))
        if self.felo.cvae_history > 0:  # bound the bank's memory to the window
            oldest = server_round - self.felo.cvae_history
            self.feature_bank = [row for row in self.feature_bank if row[0] > oldest]
        due = self.cvae is None or (server_round - 1) % self.felo.cvae_interval == 0
        metrics: dict[str, Any] = {"cvae_trained": due, "cvae_seconds": 0.0, "cvae_loss": None}
        if due:
            features, labels = self.bank_arrays(server_round)
            torch.manual_seed(self.env.run.seed)
            self.cvae = CVAE(self.felo.cvae_config(self.env.num_classes))
            with torch.enable_grad():
                result = train_cvae(
                    self.cvae, features, labels, seed=self.env.run.seed + server_round
                )
            self.last_training = result
            self.cvae_classes = np.unique(labels)
            log.info(
                "round %d: CVAE trained on %d feature vectors in %.2fs, loss %.4f -> %.4f "
                "(reconstruction %.4f)",
                server_round,
                result.num_samples,
                result.seconds,
                result.loss_history[0],
                result.final_loss,
                result.reconstruction_history[-1],
            )
            metrics.update(
                cvae_seconds=result.seconds,
                cvae_loss=result.final_loss,
                cvae_reconstruction_loss=result.reconstruction_history[-1],
                cvae_dataset_size=result.num_samples,
            )
        assert self.cvae is not None and merged.features is not None
        gen = torch.Generator().manual_seed(self.env.run.seed * 1000 + server_round)
        synthetic = self.cvae.generate(merged.class_ids, self.felo.cvae_samples, generator=gen)
        features = synthetic.mean(dim=1).numpy().astype(np.float32)
        # A class first seen after the last training (cvae-interval > 1) keeps its average.
        unseen = ~np.isin(merged.class_ids, self.cvae_classes)
        features[unseen] = merged.features[unseen]
        metrics["synthetic_classes"] = int((~unseen).sum())
        return replace(merged, features=features), metrics
