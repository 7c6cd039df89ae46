"""The ``ensemble`` scheme: FedAvg per architecture group, a tuned weighted ensemble on top.

Training is ``fedavg-groups`` unchanged (this scheme subclasses it): each
architecture group averages its own model through the injected aggregator. After
round ``ensemble-tune-every`` (and its multiples) and after the last round, the
server tunes the ensemble ``y_j = sum_i alpha[i, j] m_i(x)_j`` of the group models:

1. the server pool (never client data, never the test set) is split, stratified and
   seeded, into a tuning split and a validation split (``ensemble-validation-fraction``);
2. every group model's softmax outputs on the tuning, validation and test sets are
   computed once (``cache_seconds``); each trial is then a small product;
3. each optimiser of ``ensemble-optimizer`` (:mod:`strategies.ensemble.optimizers`)
   searches ``alpha`` on the tuning split with ``ensemble-trials`` trials, seeded
   (the ``gradient`` fit takes up to ``ensemble-gradient-steps`` Adam steps instead,
   early-stopped on the validation split);
4. the ensemble kept is the one with the best validation accuracy among uniform
   weights and every optimiser's (ties keep the earlier, uniform first).

Only sound group models are tuned: a model whose weights are not finite, or whose
outputs on the tuning, validation or test data are not (its logits overflowed),
is left out with the reason logged and recorded (the ``ensemble`` entry's
``excluded``), so one node alone in its architecture group cannot end the run. The
artifact holds the sound models; when none is sound no ensemble is tuned or
exported, and the log and the round record (``ensemble.error``) say why.

The federation's candidate set is the architectures of run-config ``model-family``
(``mixed`` by default, one model per family): a node that names an architecture
outside it (another family) is refused at the handshake
(:meth:`EnsembleStrategy.refuse_node`).

The round record's ``ensemble`` entry holds, per optimiser: trials, seconds and
tuning/validation/test accuracy; the same for uniform weights and each group model
alone, and the group models left out with why (``excluded``); ``ensemble_accuracy``
is the kept ensemble's test accuracy. At the end of the run the kept ensemble is
exported (``ensemble.npz``, :mod:`strategies.ensemble.artifact`) with a heat map of
its ``alpha`` (``ensemble_alpha.png``, models x classes, as the paper's Figure 2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from strategies.baselines.fedavg_groups import FedAvgGroupsStrategy
from strategies.core.client import ClientAlgorithm
from strategies.core.context import RoundContext
from strategies.core.groups import non_finite_entries
from strategies.core.nodes import NodeInfo
from strategies.core.registry import Scheme, register_scheme
from strategies.ensemble.optimizers import OPTIMIZERS, Split, tune
from strategies.ensemble.weights import output_problem, uniform_weights
from tessera.config import ConfigError, ConfigReader
from tessera.data import ArrayDataset

log = logging.getLogger("flwr.tessera")

__all__ = ["EnsembleOptions", "EnsembleStrategy"]

ARTIFACT = "ensemble.npz"
HEATMAP = "ensemble_alpha.png"


@dataclass(frozen=True)
class EnsembleOptions:
    """Run-config ``ensemble-*`` options.

    Attributes
    ----------
    optimizers : tuple[str, ...]
        Optimisers to run at each tuning (``ensemble-optimizer``, comma list).
    trials : int
        Trials per search (``ensemble-trials``, the paper's 50).
    tune_every : int
        Tune after every ``tune_every``-th round too; 0: only after the last.
    validation_fraction : float
        Share of the server pool held out for validation (the rest tunes).
    gradient_steps : int
        Most Adam steps of the ``gradient`` fit (``ensemble-gradient-steps``); it
        stops earlier when the validation log-loss stops improving.
    """

    optimizers: tuple[str, ...] = ("tpe", "gradient")
    trials: int = 50
    tune_every: int = 0
    validation_fraction: float = 0.3
    gradient_steps: int = 500

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> EnsembleOptions:
        """Read and check the options."""
        r = ConfigReader(run_config, "run-config")
        text = r.get("ensemble-optimizer", str, ",".join(cls.optimizers))
        names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
        unknown = [n for n in names if n not in OPTIMIZERS]
        if not names or unknown:
            raise ConfigError(
                f"run-config 'ensemble-optimizer' is {text!r}; give one or more of "
                f"{', '.join(OPTIMIZERS)} separated by commas"
            )
        trials = r.get("ensemble-trials", int, cls.trials)
        if trials < 1:
            raise ConfigError(f"run-config 'ensemble-trials' is {trials}; give 1 or more (50)")
        every = r.get("ensemble-tune-every", int, cls.tune_every)
        if every < 0:
            raise ConfigError(
                f"run-config 'ensemble-tune-every' is {every}; give 0 (after the last round "
                "only) or a positive number of rounds"
            )
        fraction = r.get("ensemble-validation-fraction", float, cls.validation_fraction)
        if not 0 < fraction < 1:
            raise ConfigError(
                f"run-config 'ensemble-validation-fraction' is {fraction}; give a share of "
                "the server pool in (0, 1), e.g. 0.3"
            )
        steps = r.get("ensemble-gradient-steps", int, cls.gradient_steps)
        if steps < 1:
            raise ConfigError(
                f"run-config 'ensemble-gradient-steps' is {steps}; give 1 or more (500)"
            )
        return cls(names, trials, every, fraction, steps)


class EnsembleStrategy(FedAvgGroupsStrategy[EnsembleOptions]):
    """``fedavg-groups`` plus the tuned weighted ensemble of the group models."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        import importlib.util

        from strategies.ensemble.optimizers import PACKAGES
        from tessera.data import server_pool_indices

        missing = {
            n: PACKAGES[n]
            for n in self.options.optimizers
            if importlib.util.find_spec(PACKAGES[n]) is None
        }
        if missing:
            raise ConfigError(
                f"run-config 'ensemble-optimizer' names {', '.join(missing)}, whose "
                f"package(s) {', '.join(sorted(set(missing.values())))} this server lacks; "
                "pip install 'tessera[ensemble]', or use ensemble-optimizer='gradient'"
            )
        pool = self.env.server_pool
        if len(pool) < 2:
            raise ConfigError(
                f"the ensemble is tuned on the server pool, which holds {len(pool)} sample(s); "
                "raise run-config 'server-pool-fraction' (e.g. 0.1)"
            )
        tuning, validation = server_pool_indices(
            pool.y, pool_fraction=self.options.validation_fraction, seed=self.env.run.seed
        )
        self.tuning_set: ArrayDataset = pool.subset(tuning)
        self.validation_set: ArrayDataset = pool.subset(validation)
        self.kept: dict[str, Any] | None = None
        """The last tuning's kept ensemble: round, archs, optimizer, alpha."""

    # --------------------------------------------------------------- handshake
    def refuse_node(self, info: NodeInfo) -> str | None:
        """Refuse a node whose architecture is not in the federation's candidate set.

        The candidates are run-config ``model-family``'s architectures (for
        ``mixed``, its one model per family), the set every device of the
        federation picks from; an architecture of another family would be tuned
        into the ensemble as if it were one of them.
        """
        from models import list_models, model_entry

        candidates = list_models(self.env.family)
        if info.arch in candidates:
            return None
        families = sorted({model_entry(a).family for a in candidates})
        where = (
            f"family '{self.env.family}'"
            if families == [self.env.family]
            else f"'{self.env.family}' (families {', '.join(families)}: {', '.join(candidates)})"
        )
        return (
            f"architecture '{info.arch}' of family '{info.family}' is not a candidate of this "
            f"ensemble federation, whose architectures are those of {where}; run the node "
            "with the federation's run-config 'model-family' (and no node-config 'arch' "
            "outside it)"
        )

    # ------------------------------------------------------------------ tuning
    def members(self) -> list[str]:
        """Return the group models in the ensemble, by architecture (``alpha``'s rows)."""
        return sorted(self.models.arrays)

    def _probabilities(
        self, archs: list[str]
    ) -> tuple[list[str], dict[str, str], tuple[Split, Split, Split] | None]:
        """Return the sound members, why the others were left out, and their cached outputs.

        A member is left out when its weights are not finite or its outputs on the
        tuning, validation or test data are not (:func:`output_problem`); the splits
        are ``None`` when no member is sound.
        """
        from strategies.ensemble.artifact import class_probabilities

        data = (self.tuning_set, self.validation_set, self.env.global_test)
        names = ("tuning", "validation", "test")
        sound: list[str] = []
        excluded: dict[str, str] = {}
        splits: list[list[np.ndarray]] = [[], [], []]
        for arch in archs:
            arrays = self.models.get(arch)
            bad = non_finite_entries(arrays)
            if bad:
                excluded[arch] = f"its weights hold non-finite values in {bad[:3]}"
                continue
            model = self.build_model(arch)
            model.load_state_dict(
                {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, strict=False
            )
            outputs = [class_probabilities(model, d.x) for d in data]
            problems = [
                problem
                for out, name in zip(outputs, names, strict=True)
                if (problem := output_problem(out, name)) is not None
            ]
            if problems:
                excluded[arch] = problems[0]
                continue
            sound.append(arch)
            for split, out in zip(splits, outputs, strict=True):
                split.append(out)
        for arch, reason in excluded.items():
            log.warning("ensemble: group model '%s' is left out of the ensemble: %s", arch, reason)
        if not sound:
            return sound, excluded, None
        tuning, validation, test = (
            Split(np.stack(p), d.y) for p, d in zip(splits, data, strict=True)
        )
        return sound, excluded, (tuning, validation, test)

    def tune_ensemble(self, server_round: int) -> dict[str, Any]:
        """Tune, keep the best on validation (module docstring); return the record entry.

        Group models that are not sound are left out (``excluded``); with none
        sound nothing is tuned or kept, and the entry says so (``error``).
        """
        started = time.perf_counter()
        archs, excluded, cached_splits = self._probabilities(self.members())
        cached = time.perf_counter() - started
        if cached_splits is None:
            error = (
                f"no group model is sound after round {server_round} "
                f"({'; '.join(f'{a}: {r}' for a, r in excluded.items())}); no ensemble is "
                "tuned or exported"
            )
            log.error("ensemble: %s", error)
            self.kept = None
            return {"members": [], "excluded": excluded, "error": error}
        tuning, validation, test = cached_splits

        def scores(alpha: np.ndarray) -> dict[str, float]:
            return {
                "tuning_accuracy": tuning.accuracy(alpha),
                "validation_accuracy": validation.accuracy(alpha),
                "test_accuracy": test.accuracy(alpha),
            }

        n, c = tuning.shape
        uniform = uniform_weights(n, c)
        results: dict[str, dict[str, Any]] = {"uniform": scores(uniform)}
        alphas = {"uniform": uniform}
        for name in self.options.optimizers:
            found = tune(
                name,
                tuning,
                validation,
                trials=self.options.gradient_steps if name == "gradient" else self.options.trials,
                seed=self.env.run.seed + server_round,
            )
            alphas[name] = found.alpha
            results[name] = {
                **scores(found.alpha),
                "trials": found.trials,
                "seconds": round(found.seconds, 4),
            }
            log.info(
                "ensemble: %s, %d trials in %.2fs: tuning %.3f, validation %.3f",
                name,
                found.trials,
                found.seconds,
                results[name]["tuning_accuracy"],
                results[name]["validation_accuracy"],
            )
        chosen = max(results, key=lambda k: results[k]["validation_accuracy"])
        alone = {}
        for i, arch in enumerate(archs):
            only = np.zeros((n, c))
            only[i] = 1.0
            alone[arch] = scores(only)
        self.kept = {
            "round": server_round,
            "archs": archs,
            "optimizer": chosen,
            "alpha": alphas[chosen].tolist(),
        }
        log.info(
            "ensemble of %d group model(s) after round %d: kept %s (validation %.3f, test "
            "%.3f; uniform test %.3f)",
            n,
            server_round,
            chosen,
            results[chosen]["validation_accuracy"],
            results[chosen]["test_accuracy"],
            results["uniform"]["test_accuracy"],
        )
        return {
            "members": archs,
            "excluded": excluded,
            "tuning_size": len(tuning.labels),
            "validation_size": len(validation.labels),
            "cache_seconds": round(cached, 4),
            "optimizers": results,
            "groups": alone,
            "chosen": chosen,
            "alpha": self.kept["alpha"],
        }

    # ------------------------------------------------------------------- hooks
    def evaluate(self, ctx: RoundContext) -> dict[str, Any]:
        """Group models' accuracy; the tuned ensemble when this round tunes."""
        out = super().evaluate(ctx)
        every = self.options.tune_every
        last = ctx.server_round == ctx.num_rounds
        if self.models.arrays and (last or (every > 0 and ctx.server_round % every == 0)):
            entry = self.tune_ensemble(ctx.server_round)
            out["ensemble"] = entry
            if "chosen" in entry:
                out["ensemble_accuracy"] = entry["optimizers"][entry["chosen"]]["test_accuracy"]
        return out

    def end_of_run(self, ctx: RoundContext) -> dict[str, Any]:
        """Tune if the last round did not; export the kept ensemble and its heat map.

        When no group model is sound there is nothing to export: the summary gets
        ``ensemble_error`` instead, and the run ends normally.
        """
        if not self.models.arrays:
            return {}
        entry: dict[str, Any] = {}
        if self.kept is None or self.kept["round"] != self.completed_round:
            entry = self.tune_ensemble(self.completed_round)
        if self.kept is None:
            return {"ensemble_error": entry.get("error", "no ensemble was kept")}
        out: dict[str, Any] = {
            "ensemble_optimizer": self.kept["optimizer"],
            "ensemble_members": self.kept["archs"],
        }
        if self.results is not None:
            out["ensemble_artifact"] = str(self.export(self.results.directory / ARTIFACT))
            out["ensemble_heatmap"] = str(self.plot_alpha(self.results.directory / HEATMAP))
        return out

    # ------------------------------------------------------------------ export
    def export(self, path: Path) -> Path:
        """Write the kept ensemble as one artifact (:mod:`strategies.ensemble.artifact`)."""
        from strategies.ensemble.artifact import save_ensemble

        assert self.kept is not None
        archs = list(self.kept["archs"])
        return save_ensemble(
            path,
            archs=archs,
            weights=[self.models.get(a) for a in archs],
            alpha=np.asarray(self.kept["alpha"]),
            input_shape=self.env.input_shape,
            class_names=[str(j) for j in range(self.env.num_classes)],
            norm=self.env.run.scheme.norm,
            extra={
                "optimizer": self.kept["optimizer"],
                "round": self.kept["round"],
                "dataset": self.env.run.data.dataset,
                "federation": self.federation,
                "model_kwargs": {"flat_input": self.env.run.scheme.flat_input},
            },
        )

    def plot_alpha(self, path: Path) -> Path:
        """Draw the kept ``alpha`` as a models x classes heat map."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        assert self.kept is not None
        alpha = np.asarray(self.kept["alpha"])
        archs = list(self.kept["archs"])
        fig, ax = plt.subplots(figsize=(1.0 + 0.5 * alpha.shape[1], 1.2 + 0.45 * len(archs)))
        image = ax.imshow(alpha, cmap="viridis", aspect="auto", vmin=0.0)
        ax.set_xticks(range(alpha.shape[1]))
        ax.set_yticks(range(len(archs)), labels=archs, fontsize=8)
        ax.set_xlabel("class")
        ax.set_title(f"ensemble weights ({self.kept['optimizer']}, round {self.kept['round']})")
        fig.colorbar(image, ax=ax, fraction=0.04)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    # -------------------------------------------------------------- checkpoint
    def describe(self) -> dict[str, Any]:
        """Return the base description plus the ensemble settings and split sizes."""
        return {
            **super().describe(),
            "ensemble_optimizers": list(self.options.optimizers),
            "ensemble_trials": self.options.trials,
            "ensemble_tune_every": self.options.tune_every,
            "tuning_size": len(self.tuning_set),
            "validation_size": len(self.validation_set),
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the group models plus the last kept ensemble."""
        return {**super().state_dict(), "ensemble": self.kept}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the group models and the kept ensemble, checked.

        Entry ``ensemble`` is ``None`` (nothing kept yet) or the kept ensemble
        (:func:`checked_kept`): a round no later than the checkpoint's, distinct
        members whose weights the restored group models hold, the optimiser that
        chose it and a finite ``alpha`` of one row per member and one column per
        class, so what :meth:`end_of_run` exports is an artifact
        :func:`~strategies.ensemble.artifact.load_ensemble` reads.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        from tessera.checkpoint import refusal
        from tessera.state_checks import StateFileError

        super().load_state_dict(state)
        try:
            kept = checked_kept(
                state,
                completed_round=self.completed_round,
                members=self.models.arrays,
                num_classes=self.env.num_classes,
            )
        except StateFileError as err:
            raise refusal(state, err) from err
        self.kept = kept


def checked_kept(
    state: Mapping[str, Any],
    *,
    completed_round: int,
    members: Collection[str],
    num_classes: int,
) -> dict[str, Any] | None:
    """Return checkpoint entry ``ensemble`` (the kept ensemble), checked.

    Parameters
    ----------
    state : Mapping[str, Any]
        The checkpoint.
    completed_round : int
        Its round: the ensemble was kept after a round from 1 to this one.
    members : Collection[str]
        The architectures whose group models were restored.
    num_classes : int
        The task's classes (``alpha``'s columns).

    Returns
    -------
    dict[str, Any] or None
        ``round``, ``archs``, ``optimizer`` and ``alpha`` (a list of rows), or
        ``None`` when the entry is absent or ``None``.

    Raises
    ------
    StateFileError
        Naming the first field that fails.
    """
    from tessera.state_checks import StateFileError, get_int, get_list, get_mapping, get_str

    if state.get("ensemble") is None:
        return None
    kept = get_mapping(state, "ensemble")
    where = "ensemble"
    kept_round = get_int(kept, "round", where=where, minimum=1)
    if kept_round > completed_round:
        raise StateFileError(
            f"{where}.round", f"is {kept_round}, after the checkpoint's round {completed_round}"
        )
    archs = get_list(kept, "archs", where=where)
    for i, arch in enumerate(archs):
        if not isinstance(arch, str) or arch not in members:
            raise StateFileError(
                f"{where}.archs[{i}]",
                f"is {arch!r}; expected an architecture whose weights field "
                f"'group_models.arrays' holds ({sorted(members)})",
            )
    if not archs or len(set(archs)) != len(archs):
        raise StateFileError(
            f"{where}.archs", f"is {archs!r}; expected one or more distinct architectures"
        )
    optimizer = get_str(kept, "optimizer", where=where)
    if optimizer not in ("uniform", *OPTIMIZERS):
        raise StateFileError(
            f"{where}.optimizer",
            f"is {optimizer!r}; expected 'uniform' or one of {', '.join(OPTIMIZERS)}",
        )
    want = (len(archs), num_classes)
    raw = kept.get("alpha")
    try:
        alpha = np.asarray(raw)
        numeric = alpha.dtype.kind in "iuf"
    except (ValueError, TypeError):  # ragged rows
        numeric = False
    if not numeric or alpha.shape != want or not bool(np.isfinite(alpha).all()):
        if not numeric:
            shown = repr(raw) if len(repr(raw)) <= 60 else f"{repr(raw)[:60]}..."
        else:
            finite = bool(np.isfinite(alpha).all())
            shown = f"{alpha.dtype} {alpha.shape}{'' if finite else ' holding NaN or infinities'}"
        raise StateFileError(
            f"{where}.alpha",
            f"is {shown}; expected finite numbers of shape {want} (members x classes)",
        )
    return {
        "round": kept_round,
        "archs": [str(a) for a in archs],
        "optimizer": optimizer,
        "alpha": alpha.astype(np.float64).tolist(),
    }


SCHEME = register_scheme(
    Scheme(
        name="ensemble",
        server=EnsembleStrategy,
        client=ClientAlgorithm,
        parse_options=EnsembleOptions.parse,
        default_family="mixed",
        description="Heterogeneous ensemble: FedAvg per architecture group, then a "
        "per-model, per-class weighted ensemble tuned on the server",
        personalise=True,
    )
)
