"""Felo's server and FedHe's.

Felo: count-weighted per-class averages, weights by architecture group. FedHe:
logits only. Under the default ``knowledge-merge=mean`` both fold each reply's rows
that cannot be clipped as it arrives (:mod:`strategies.felo.fold`); Velo keeps every
row.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from flwr.app import RecordDict
from torch import nn

from strategies.core.context import RoundContext
from strategies.core.groups import GroupModels, GroupRound, NonFiniteStateError, fold_weights
from strategies.core.strategy import HeteroStrategy
from strategies.core.validation import ClientReply, ReplySchema
from strategies.felo.fold import (
    KNOWLEDGE_SCALES,
    FoldResult,
    KnowledgeRound,
    round_fold,
    scales_from_state,
    within_declared,
)
from strategies.felo.knowledge import (
    CLASS_TARGETS,
    KNOWLEDGE,
    ClassKnowledge,
    bound_knowledge,
    cap_counts,
    check_knowledge_record,
    knowledge_to_record,
    merge_knowledge,
    record_to_knowledge,
)
from strategies.felo.options import FeloOptions, build_scheme_model
from tessera import wire

log = logging.getLogger("flwr.tessera")


class RoundMerge(NamedTuple):
    """A round's knowledge merge (:meth:`FeloStrategy.merge_round`)."""

    parts: list[ClassKnowledge]
    """The bounded parts, or none when folded (their rows are gone)."""
    merged: ClassKnowledge
    clips: list[tuple[int, str, float, float]]
    """``(node id, kind, largest row norm, bound)`` per reply and kind clipped."""
    folded: FoldResult | None
    """The fold's result (the next scales), or ``None`` when merged here."""


class FeloStrategy(HeteroStrategy[FeloOptions]):
    """Felo's server: per-class averages of knowledge, FedAvg within architecture groups.

    Under ``knowledge-merge=mean`` (the default) each reply's rows that cannot be
    clipped are folded as it arrives and dropped, the others kept to the round's end
    (:mod:`strategies.felo.fold`), unless the scheme keeps every row
    (:attr:`keeps_rows`: Velo trains its CVAE on them).
    """

    keeps_rows: ClassVar[bool] = False
    """Whether :meth:`make_targets` needs every reply's rows (then nothing is folded)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.models = GroupModels(
            self.aggregator, self.initial_arrays, self.pool_direction, self.reference_mix
        )
        self.targets: ClassKnowledge | None = None
        self.knowledge_scales: dict[str, float] = {}
        """The last committed round's median row norm per kind (:mod:`strategies.felo.fold`)."""

    @property
    def felo(self) -> FeloOptions:
        """The options (a shorter name for :attr:`options`)."""
        return self.options

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
            norm=self.env.run.scheme.norm,
            flat_input=self.env.run.scheme.flat_input,
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

    def streams_knowledge(self) -> bool:
        """Whether the knowledge is folded as it arrives (``mean`` merge, rows not kept)."""
        return not self.keeps_rows and self.env.run.aggregation.knowledge_merge == "mean"

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Fold the knowledge (see :meth:`streams_knowledge`) and the shared weights.

        The knowledge is first cut to the node's handshake label counts
        (:func:`~strategies.felo.fold.within_declared`; a reply of none is refused). It
        is checked before the weights are folded and added after, so a reply refused
        by either leaves nothing behind. A buffered reply keeps its knowledge record,
        rewritten when it was cut.
        """
        sent = record_to_knowledge(reply.content.array_records[KNOWLEDGE])
        knowledge = within_declared(ctx, sent, reply.node_id, self.declared_labels(reply.node_id))
        if self.streams_knowledge():
            fold = round_fold(ctx, self.env, self.knowledge_scales)
            # a node's counts weigh at most what the round lets it weigh (weight-cap)
            knowledge = cap_counts(knowledge, reply.weight)
            fold.check(knowledge)
            if self.felo.share_weights:
                reply = fold_weights(self.models, ctx.state(GroupRound), reply)
            fold.add(knowledge, reply.node_id)
            content = RecordDict({k: v for k, v in reply.content.items() if k != KNOWLEDGE})
            return replace(reply, content=content)
        if knowledge is not sent:
            reply = reply.with_record(KNOWLEDGE, knowledge_to_record(knowledge))
        if not self.felo.share_weights:
            return reply
        return fold_weights(self.models, ctx.state(GroupRound), reply)

    def merge_round(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> RoundMerge:
        """Return the round's merge: folded (:meth:`fold`), or bounded and merged here."""
        run = self.env.run
        folded = ctx.scheme_state.get(KnowledgeRound)
        if isinstance(folded, KnowledgeRound):
            result = folded.fold.result()
            return RoundMerge([], result.merged, result.clips, result)
        # a node's counts weigh at most what the round lets it weigh (weight-cap)
        received = [
            cap_counts(record_to_knowledge(r.content.array_records[KNOWLEDGE]), r.weight)
            for r in replies
        ]
        parts, clips = bound_knowledge(received, run.aggregation.knowledge_clip_factor)
        merged = merge_knowledge(
            parts,
            self.env.num_classes,
            rule=run.aggregation.knowledge_merge,
            trim_fraction=run.aggregation.trim_fraction,
        )
        clips = [(replies[i].node_id, k, n, b) for i, k, n, b in clips]
        return RoundMerge(parts, merged, clips, None)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Bound and merge the class knowledge, make the targets, commit the group models.

        Nothing changes unless everything is finite: non-finite targets or weights
        raise :class:`~strategies.core.groups.NonFiniteStateError` (the round is skipped).
        """
        run = self.env.run
        extra: dict[str, Any] = {}
        parts, merged, clips, folded = self.merge_round(ctx, replies)
        for node, kind, norm, bound in clips:
            log.info(
                "round %d: node %d's %s clipped from norm %.4g to %.4g (knowledge-clip-factor %g)",
                ctx.server_round,
                node,
                kind,
                norm,
                bound,
                run.aggregation.knowledge_clip_factor,
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
                done = self.models.commit(ctx.state(GroupRound))
                extra["group_sizes"] = done.sizes
                extra["clipped"] = done.clips
        except (ValueError, ArithmeticError):
            self.restore_target_state(saved)
            raise
        self.targets = targets
        if folded is not None:
            self.knowledge_scales = folded.scales
            extra["knowledge_kept"] = folded.kept
            extra["knowledge_rows"] = folded.rows
        extra["knowledge_clipped"] = [
            {"node": node, "kind": kind, "norm": norm, "bound": bound}
            for node, kind, norm, bound in clips
        ]
        extra["knowledge_classes"] = merged.num_classes_present
        extra.update(target_metrics)
        return extra

    def target_state(self) -> Any:
        """Return what :meth:`make_targets` changes, to restore on refusal (Felo: nothing)."""
        return None

    def restore_target_state(self, saved: Any) -> None:
        """Undo :meth:`make_targets` (see :meth:`target_state`)."""

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
            KNOWLEDGE_SCALES: dict(self.knowledge_scales),
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

        Felo's entries are ``targets``: ``None`` (before the first aggregation) or the
        per-class knowledge of :func:`knowledge_from_state`, with features of width
        ``feature-dim`` when the scheme exchanges features and none otherwise; and
        ``knowledge_scales`` (:func:`~strategies.felo.fold.scales_from_state`; an
        older checkpoint without it bounds its next round by that round's own rows).
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
        try:
            scales = scales_from_state(state)
        except StateFileError as err:
            raise refusal(state, err) from err
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
            self.knowledge_scales = scales

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


class FedHeStrategy(FeloStrategy):
    """FedHe's server: per-class averages of logits only, no weights."""
