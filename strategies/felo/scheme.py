"""Felo, Velo and FedHe: heterogeneous models that share per-class features and logits.

Paper: "Felo and Velo: data-free heterogeneous federated learning with mid-level
features and logits" (sections 3 and 4). One room for three related schemes:

``felo``
    Each client trains, then sends the per-class means of its features (in the common
    feature space, see :mod:`models.projection`) and logits with the class counts.
    The server averages them per class, weighted by counts, and sends the averages
    back as the next round's targets. With ``felo-share-weights=true`` (the default,
    as in the paper) the weights are also averaged within each architecture group
    (exactly ``fedavg-groups``); with ``false`` only knowledge crosses the network
    and every client keeps its personal model in its state.
``velo``
    Felo whose server keeps a dataset of every per-class feature vector it received,
    trains a conditional VAE (:mod:`strategies.felo.cvae`) on it every
    ``cvae-interval`` rounds, and sends the decoder's synthetic per-class features
    (the mean of ``cvae-samples`` decoded samples) instead of plain averages; logits
    are averaged as in Felo. Training time and loss go to the round metrics
    (``cvae_seconds``, ``cvae_loss``).
``fedhe``
    The FedHe baseline (Chan and Ngai, 2021): logits only, no features, no weights,
    plain zoo models (no projection); personal models persist on the clients.

Local objective, the paper's equation (1), per minibatch of ``N`` samples::

    L = 1/N sum_i [ CE(z_i, y_i) + alpha * m_i * ( MSE(f_i, F[y_i]) + KL_T(Z[y_i] || z_i) ) ]

with ``f_i``/``z_i`` the sample's features/logits, ``F[c]``/``Z[c]`` the server's
targets of class ``c``, ``m_i = 1`` when the server has knowledge of ``y_i`` and 0
otherwise (no target term; round 1 is plain cross-entropy), ``MSE`` the mean over the
feature entries and ``KL_T(a || b) = T^2 * KL(softmax(a/T) || softmax(b/T))``, the
distillation KL of Hinton et al. with the server's logits as the teacher. FedHe drops
the MSE term.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from flwr.app import RecordDict
from torch import nn

from models.base import TesseraModel
from models.projection import ProjectedModel
from strategies.core.client import ClientAlgorithm, Record, RoundInput, RoundOutcome
from strategies.core.context import RoundContext
from strategies.core.groups import GroupModels, NonFiniteStateError, fold_weights
from strategies.core.registry import Scheme, register_scheme
from strategies.core.strategy import HeteroStrategy
from strategies.core.validation import ClientReply, ReplySchema
from strategies.felo.cvae import CVAE, CVAEConfig, CVAETrainResult, train_cvae
from strategies.felo.knowledge import (
    CLASS_TARGETS,
    KNOWLEDGE,
    ClassKnowledge,
    bound_knowledge,
    cap_counts,
    check_knowledge_record,
    collect_knowledge,
    knowledge_to_record,
    merge_knowledge,
    record_to_knowledge,
)
from tessera import wire
from tessera.config import ConfigError, ConfigReader, FlatInput, RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import LossFn

log = logging.getLogger("flwr.tessera")


# ------------------------------------------------------------------------- options
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
    arch: str,
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


# ------------------------------------------------------------------- client maths
@dataclass(frozen=True)
class ClassTargets:
    """The server's per-class targets as lookup tables indexed by class id.

    Attributes
    ----------
    known : torch.Tensor
        bool ``(num_classes,)``: whether the server sent a target for the class.
    logits : torch.Tensor
        ``(num_classes, num_classes)`` target logits (zero rows where unknown).
    features : torch.Tensor | None
        ``(num_classes, feature_dim)`` target features, or ``None`` (logits only).
    """

    known: torch.Tensor
    logits: torch.Tensor
    features: torch.Tensor | None

    @classmethod
    def from_knowledge(cls, knowledge: ClassKnowledge, num_classes: int) -> ClassTargets:
        """Scatter per-class knowledge into tables of ``num_classes`` rows."""
        ids = torch.from_numpy(knowledge.class_ids.astype(np.int64))
        known = torch.zeros(num_classes, dtype=torch.bool)
        known[ids] = True
        logits = torch.zeros((num_classes, knowledge.logits.shape[1]))
        logits[ids] = torch.from_numpy(knowledge.logits.astype(np.float32))
        features = None
        if knowledge.features is not None:
            features = torch.zeros((num_classes, knowledge.features.shape[1]))
            features[ids] = torch.from_numpy(knowledge.features.astype(np.float32))
        return cls(known, logits, features)

    def to(self, device: torch.device) -> ClassTargets:
        """Move the tables to ``device``."""
        feats = None if self.features is None else self.features.to(device)
        return ClassTargets(self.known.to(device), self.logits.to(device), feats)


@dataclass(frozen=True)
class LossTerms:
    """The three terms of equation (1) for one minibatch (each a batch mean)."""

    ce: torch.Tensor
    mse: torch.Tensor
    kl: torch.Tensor

    def total(self, alpha: float) -> torch.Tensor:
        """``ce + alpha * (mse + kl)``."""
        out: torch.Tensor = self.ce + alpha * (self.mse + self.kl)
        return out


def loss_terms(
    model: TesseraModel,
    x: torch.Tensor,
    y: torch.Tensor,
    targets: ClassTargets | None,
    *,
    temperature: float,
) -> LossTerms:
    """Compute the terms of equation (1) (see the module docstring).

    Samples whose class has no target contribute 0 to ``mse`` and ``kl``; the sums
    are divided by the full batch size, as in the equation's ``1/|D|``.

    Parameters
    ----------
    model : TesseraModel
        The client model (``forward_features``, ``forward_head``).
    x, y : torch.Tensor
        A minibatch and its labels.
    targets : ClassTargets | None
        The server's targets on ``x``'s device, or ``None`` (plain cross-entropy).
    temperature : float
        Distillation temperature ``T``.

    Returns
    -------
    LossTerms
        Cross-entropy, feature MSE and logit KL, each a scalar.
    """
    features = model.forward_features(x)
    logits = model.forward_head(features)
    ce = F.cross_entropy(logits, y)
    zero = torch.zeros((), device=logits.device, dtype=logits.dtype)
    if targets is None:
        return LossTerms(ce, zero, zero)
    mask = targets.known[y].to(logits.dtype)
    n = float(y.shape[0])
    teacher = F.softmax(targets.logits[y] / temperature, dim=1)
    student = F.log_softmax(logits / temperature, dim=1)
    kl_each = F.kl_div(student, teacher, reduction="none").sum(dim=1) * temperature**2
    kl = (kl_each * mask).sum() / n
    mse = zero
    if targets.features is not None:
        mse_each = ((features - targets.features[y]) ** 2).mean(dim=1)
        mse = (mse_each * mask).sum() / n
    return LossTerms(ce, mse, kl)


# --------------------------------------------------------------------- client side
class FeloClient(ClientAlgorithm):
    """Client of ``felo``/``velo``/``fedhe``: equation (1), then per-class knowledge.

    With ``share_weights`` (Felo's default) it sends its weights for FedAvg within
    its architecture group; without (``felo-share-weights=false``, FedHe) it sends
    knowledge only and keeps a personal model in the node's state. Both are decided
    here, from the options.
    """

    def __init__(self, *, run: RunConfig, options: FeloOptions) -> None:
        super().__init__(run=run, options=options)
        self.sends_weights = options.share_weights
        self.keeps_personal_model = not options.share_weights
        self.targets: ClassTargets | None = None

    @property
    def felo(self) -> FeloOptions:
        """The typed options."""
        opts: FeloOptions = self.options
        return opts

    def build_model(
        self, arch: str, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Build the zoo model, projected to ``feature-dim`` when features are exchanged."""
        return build_scheme_model(
            arch,
            input_shape=input_shape,
            num_classes=num_classes,
            norm=self.run.norm,
            flat_input=self.run.flat_input,
            options=self.felo,
        )

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Read the server's per-class targets, if it sent any (none in round 1)."""
        self.targets = None
        content = rnd.content
        if CLASS_TARGETS not in content.array_records:
            return
        num_classes = rnd.num_classes
        knowledge = record_to_knowledge(content.array_records[CLASS_TARGETS])
        width = None if knowledge.features is None else knowledge.features.shape[1]
        expected = self.felo.feature_dim if self.felo.exchange_features else None
        if width != expected or knowledge.logits.shape[1] != num_classes:
            raise ConfigError(
                f"the server's class targets have feature width {width} and "
                f"{knowledge.logits.shape[1]} logits but this client expects {expected} "
                f"and {num_classes}; server and client disagree on run-config "
                "'feature-dim' or the scheme"
            )
        device = next(model.parameters()).device
        self.targets = ClassTargets.from_knowledge(knowledge, num_classes).to(device)

    def loss_fn(self) -> LossFn:
        """Equation (1): ``CE + alpha * (MSE + KL)`` against the server's targets."""
        targets = self.targets
        alpha, temperature = self.felo.alpha, self.felo.temperature

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            assert isinstance(model, TesseraModel)
            return loss_terms(model, x, y, targets, temperature=temperature).total(alpha)

        return loss

    def finish_round(
        self, model: nn.Module, rnd: RoundInput, outcome: RoundOutcome, state: NodeState
    ) -> dict[str, Record]:
        """Return the base records plus the per-class means of the training data."""
        records = super().finish_round(model, rnd, outcome, state)
        records[KNOWLEDGE] = self.knowledge_record(model, outcome.train, outcome.device)
        return records

    def knowledge_record(
        self, model: nn.Module, train: ArrayDataset, device: torch.device
    ) -> Record:
        """Per-class mean features (if exchanged) and logits of ``train``."""
        assert isinstance(model, TesseraModel)
        knowledge = collect_knowledge(
            model,
            train,
            num_classes=model.num_classes,
            with_features=self.felo.exchange_features,
            device=device,
        )
        return knowledge_to_record(knowledge)


# --------------------------------------------------------------------- server side
class FeloStrategy(HeteroStrategy):
    """Felo's server: per-class averages of knowledge, FedAvg within architecture groups."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.models = GroupModels(self.aggregator, self.initial_arrays, self.pool_direction)
        self.targets: ClassKnowledge | None = None

    @property
    def felo(self) -> FeloOptions:
        """The typed options."""
        opts: FeloOptions = self.options
        return opts

    @property
    def group_arrays(self) -> dict[str, dict[str, np.ndarray]]:
        """The current global weights per architecture (empty without weight sharing)."""
        return self.models.arrays

    def build_model(self, arch: str) -> nn.Module:
        """Build the scheme's model of ``arch`` (projected if features are exchanged), seeded."""
        torch.manual_seed(self.env.run.seed)
        return build_scheme_model(
            arch,
            input_shape=self.env.input_shape,
            num_classes=self.env.num_classes,
            norm=self.env.run.norm,
            flat_input=self.env.run.flat_input,
            options=self.felo,
        )

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Config, the group's weights (when shared) and the per-class targets (if any)."""
        content = super().node_content(ctx, node_id, arch)
        if self.felo.share_weights:
            content[wire.ARRAYS] = ctx.share(
                (wire.ARRAYS, arch), lambda: wire.numpy_to_record(self.models.get(arch))
            )
        if self.targets is not None:
            targets = self.targets
            content[CLASS_TARGETS] = ctx.share(CLASS_TARGETS, lambda: knowledge_to_record(targets))
        return content

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """Weights when shared, and a valid ``knowledge`` record."""
        check = functools.partial(
            check_knowledge_record,
            num_classes=self.env.num_classes,
            feature_dim=self.felo.feature_dim if self.felo.exchange_features else None,
        )
        arrays = self.array_spec(arch) if self.felo.share_weights else None
        return ReplySchema(arrays=arrays, extra=check)

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Fold the weights (when shared) into the group's accumulator."""
        return fold_weights(self.models, reply) if self.felo.share_weights else reply

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Bound and merge the class knowledge, make the targets, commit the group models.

        Nothing changes unless everything is finite: non-finite targets or weights
        raise :class:`~strategies.core.groups.NonFiniteStateError` (the round is skipped).
        """
        run = self.env.run
        extra: dict[str, Any] = {}
        # a node's counts weigh at most what the round lets it weigh (weight-cap)
        received = [
            cap_counts(record_to_knowledge(r.content.array_records[KNOWLEDGE]), r.weight)
            for r in replies
        ]
        parts, clips = bound_knowledge(received, run.knowledge_clip_factor)
        for i, kind, norm, bound in clips:
            log.info(
                "round %d: node %d's %s clipped from norm %.4g to %.4g (knowledge-clip-factor %g)",
                ctx.server_round,
                replies[i].node_id,
                kind,
                norm,
                bound,
                run.knowledge_clip_factor,
            )
        merged = merge_knowledge(
            parts, self.env.num_classes, rule=run.knowledge_merge, trim_fraction=run.trim_fraction
        )
        saved = self.target_state()
        try:
            targets, target_metrics = self.make_targets(ctx.server_round, parts, merged)
            bad = [
                name
                for name, values in (("logits", targets.logits), ("features", targets.features))
                if values is not None and not bool(np.all(np.isfinite(values)))
            ]
            if bad:
                raise NonFiniteStateError(f"the class targets' {' and '.join(bad)} are not finite")
            if self.felo.share_weights:
                extra["group_sizes"] = self.models.commit()
                extra["clipped"] = self.models.last_clips
        except (ValueError, ArithmeticError):
            self.restore_target_state(saved)
            self.models.discard()
            raise
        self.targets = targets
        extra["knowledge_clipped"] = [
            {"node": replies[i].node_id, "kind": kind, "norm": norm, "bound": bound}
            for i, kind, norm, bound in clips
        ]
        extra["knowledge_classes"] = merged.num_classes_present
        extra.update(target_metrics)
        return extra

    def target_state(self) -> Any:
        """Return what :meth:`make_targets` changes, to restore on refusal (Felo: nothing)."""
        return None

    def restore_target_state(self, saved: Any) -> None:
        """Undo :meth:`make_targets` (see :meth:`target_state`)."""

    def discard(self, ctx: RoundContext) -> None:
        """Keep the previous group models and targets."""
        self.models.discard()

    def make_targets(
        self, server_round: int, parts: Sequence[ClassKnowledge], merged: ClassKnowledge
    ) -> tuple[ClassKnowledge, dict[str, Any]]:
        """Return the next round's targets and round metrics (Felo: the averages)."""
        return merged, {}

    def global_models(self) -> Mapping[str, dict[str, np.ndarray]]:
        """One model per architecture group when weights are shared, else none."""
        return dict(self.models.arrays) if self.felo.share_weights else {}

    def describe(self) -> dict[str, Any]:
        """Return the options (kebab-case keys)."""
        return {k.replace("_", "-"): v for k, v in asdict(self.felo).items()}

    def state_dict(self) -> dict[str, Any]:
        """Return the base state, the group models and the current targets."""
        return {
            **super().state_dict(),
            "group_models": self.models.state_dict(),
            "targets": None if self.targets is None else knowledge_state(self.targets),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, all of the scheme's part checked first.

        The base part is restored first (it refuses a checkpoint of another scheme
        or another experiment); then the scheme's own entries are checked
        (:meth:`checked_scheme_state`) and the group models are checked and
        restored (:meth:`~strategies.core.groups.GroupModels.load_state_dict`); only when
        both pass are the scheme's entries assigned.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix, if an entry fails
            its check.
        """
        from tessera.checkpoint import refusal
        from tessera.state_checks import StateFileError, get_mapping

        super().load_state_dict(state)
        restore = self.checked_scheme_state(state)
        try:
            group_models = get_mapping(state, "group_models", default={})
        except StateFileError as err:
            raise refusal(state, err) from err
        self.models.load_state_dict(group_models)
        restore()

    def checked_scheme_state(self, state: Mapping[str, Any]) -> Callable[[], None]:
        """Check the scheme's own checkpoint entries; return what assigns them.

        Felo's entry is ``targets``: ``None`` (before the first aggregation) or the
        per-class knowledge of :func:`knowledge_from_state`, with features of width
        ``feature-dim`` when the scheme exchanges features and none otherwise.
        Subclasses extend it (``super().checked_scheme_state(state)`` first).

        Parameters
        ----------
        state : Mapping[str, Any]
            The checkpoint (:meth:`state_dict`, read back).

        Returns
        -------
        Callable[[], None]
            Assigns the checked entries; called once everything has passed.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        from tessera.checkpoint import refusal
        from tessera.state_checks import StateFileError, get_mapping

        targets: ClassKnowledge | None = None
        if state.get("targets") is not None:
            try:
                tree = get_mapping(state, "targets")
            except StateFileError as err:
                raise refusal(state, err) from err
            targets = knowledge_from_state(
                tree,
                num_classes=self.env.num_classes,
                feature_dim=self.felo.feature_dim if self.felo.exchange_features else None,
            )

        def restore() -> None:
            self.targets = targets

        return restore


def knowledge_state(knowledge: ClassKnowledge) -> dict[str, Any]:
    """Convert a :class:`ClassKnowledge` to checkpoint entries."""
    return {
        "class_ids": knowledge.class_ids,
        "counts": knowledge.counts,
        "logits": knowledge.logits,
        "features": knowledge.features,
    }


def knowledge_from_state(
    state: Mapping[str, Any], *, num_classes: int, feature_dim: int | None
) -> ClassKnowledge:
    """Inverse of :func:`knowledge_state`, every entry checked before use.

    ``class_ids`` must be a non-empty 1-d integer array of distinct ids in
    ``[0, num_classes)``; ``counts`` one positive integer per class; ``logits``
    finite floats ``(K, num_classes)``; ``features`` finite floats
    ``(K, feature_dim)``, or ``None`` when ``feature_dim`` is ``None``.

    Parameters
    ----------
    state : Mapping[str, Any]
        The entries (a :class:`~tessera.checkpoint.StateTree` names its file and
        field in the error).
    num_classes : int
        Number of classes of the task.
    feature_dim : int | None
        Width of the features, or ``None`` for a scheme that exchanges logits only.

    Returns
    -------
    ClassKnowledge
        The knowledge (int64 ids and counts, float32 logits and features).

    Raises
    ------
    CheckpointError
        Naming the checkpoint file, the field and the fix.
    """
    from tessera.checkpoint import checked_array, field_of, refusal
    from tessera.state_checks import StateFileError

    where = field_of(state)

    def field(key: str) -> str:
        return f"{where}.{key}" if where else key

    ids = checked_array(state, "class_ids", shape=(None,), kinds="iu")
    k = int(ids.shape[0])
    counts = checked_array(state, "counts", shape=(k,), kinds="iu")
    logits = checked_array(state, "logits", shape=(k, num_classes))
    try:
        if k == 0:
            raise StateFileError(field("class_ids"), "is empty; targets cover at least one class")
        outside = ids[(ids < 0) | (ids >= num_classes)]
        if outside.size:
            raise StateFileError(
                field("class_ids"),
                f"holds {outside[:5].tolist()}, outside the task's classes [0, {num_classes})",
            )
        if np.unique(ids).size != k:
            raise StateFileError(field("class_ids"), f"repeats a class: {ids.tolist()[:20]}")
        if np.any(counts <= 0):
            raise StateFileError(
                field("counts"), "holds a count <= 0; every class a target covers has samples"
            )
        if feature_dim is None and state.get("features") is not None:
            raise StateFileError(
                field("features"), "holds features, but this scheme exchanges logits only"
            )
    except StateFileError as err:
        raise refusal(state, err) from err
    features = None
    if feature_dim is not None:
        features = checked_array(state, "features", shape=(k, feature_dim)).astype(np.float32)
    return ClassKnowledge(
        class_ids=ids.astype(np.int64),
        counts=counts.astype(np.int64),
        logits=logits.astype(np.float32),
        features=features,
    )


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
        """Store the received features, train the CVAE when due, decode class features."""
        for part in parts:
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


class FedHeStrategy(FeloStrategy):
    """FedHe's server: per-class averages of logits only, no weights."""


FELO = register_scheme(
    Scheme(
        name="felo",
        server=FeloStrategy,
        client=FeloClient,
        parse_options=FeloOptions.parse,
        default_family="cnn",
        description="Felo: per-class features and logits, FedAvg within architecture groups",
    )
)
VELO = register_scheme(
    Scheme(
        name="velo",
        server=VeloStrategy,
        client=FeloClient,
        parse_options=FeloOptions.parse,
        default_family="cnn",
        description="Velo: Felo with CVAE-generated per-class features on the server",
    )
)
FEDHE = register_scheme(
    Scheme(
        name="fedhe",
        server=FedHeStrategy,
        client=FeloClient,
        parse_options=FeloOptions.parse_fedhe,
        default_family="cnn",
        description="FedHe: per-class logits only, personal models, no weights shared",
    )
)
