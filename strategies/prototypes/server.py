"""The family's servers: prototypes in and global prototypes out, or a global head out.

:class:`PrototypeStrategy` is the server FedProto and FedTGP share (below);
:class:`GlobalHeadStrategy` the one FedGH and LG-FedAvg share: it sends a global
head every round, which its subclass makes (FedGH trains it on the prototypes
merged here by :func:`merge_replies`, LG-FedAvg averages the nodes' heads).

FedProto and FedTGP: no weights.

Each round it sends the current global prototypes (none in round 1), demands a
valid ``class-prototypes`` record in every reply
(:func:`~strategies.prototypes.payload.check_prototype_record`, before any
arithmetic), merges the accepted ones robustly
(:func:`~strategies.prototypes.merge.merge_prototypes`: counts capped, rows
bounded, run-config ``knowledge-merge``; FedProto's default ``mean`` folds the rows
that cannot be clipped as they arrive, :mod:`strategies.felo.fold`) and turns the
result into the next global
prototypes with :meth:`PrototypeStrategy.make_global`: FedProto sends the merge
itself, FedTGP trains its generator on the bounded client prototypes. Nothing is
committed unless every value is finite; otherwise the round is skipped and the
previous prototypes stay.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any, ClassVar

import numpy as np
from flwr.app import RecordDict

from strategies.core.context import RoundContext, ServerEnv
from strategies.core.groups import NonFiniteStateError
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
from strategies.felo.knowledge import ClassKnowledge, cap_counts
from strategies.prototypes.head import initial_head
from strategies.prototypes.merge import (
    PrototypeMerge,
    as_knowledge,
    as_prototypes,
    merge_prototypes,
)
from strategies.prototypes.options import FeatureOptionsT, PrototypeOptionsT
from strategies.prototypes.payload import (
    CLASS_IDS,
    CLASS_PROTOTYPES,
    COUNTS,
    GLOBAL_PROTOTYPES,
    PROTO_ACCURACY,
    PROTOTYPES,
    ClassPrototypes,
    check_prototype_record,
    prototype_problem,
    prototypes_to_record,
    record_to_prototypes,
)
from tessera import wire

log = logging.getLogger("flwr.tessera")

__all__ = [
    "GlobalHeadStrategy",
    "PrototypeStrategy",
    "claimed_prototypes",
    "log_clips",
    "merge_replies",
    "options_document",
    "prototype_schema",
    "prototypes_from_state",
]


class PrototypeStrategy(HeteroStrategy[PrototypeOptionsT]):
    """Server of a prototype scheme (module docstring); subclasses override :meth:`make_global`.

    Under ``knowledge-merge=mean`` (the default) each reply's prototypes that cannot
    be clipped are folded as they arrive and dropped, the others kept to the round's
    end (:mod:`strategies.felo.fold`), unless the scheme trains on every row
    (:attr:`keeps_rows`: FedTGP).
    """

    keeps_rows: ClassVar[bool] = False
    """Whether :meth:`make_global` needs every reply's bounded rows (then nothing is folded)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.global_prototypes: ClassPrototypes | None = None
        """What the next round sends (``None`` before the first aggregation)."""
        self.knowledge_scales: dict[str, float] = {}
        """The last committed round's median row norm (:mod:`strategies.felo.fold`)."""

    def streams_knowledge(self) -> bool:
        """Whether the prototypes are folded as they arrive (``mean`` merge, rows not kept)."""
        return not self.keeps_rows and self.env.run.aggregation.knowledge_merge == "mean"

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Fold the reply's prototypes the bound cannot reach; keep the rest to the end.

        The prototypes are first cut to the node's handshake label counts
        (:func:`claimed_prototypes`). See :meth:`streams_knowledge` and
        :class:`~strategies.felo.fold.KnowledgeFold`.
        """
        reply, knowledge = claimed_prototypes(
            ctx, reply, self.env, self.declared_labels(reply.node_id)
        )
        if not self.streams_knowledge():
            return reply
        fold = round_fold(ctx, self.env, self.knowledge_scales)
        # a node's counts weigh at most what the round lets it weigh (weight-cap)
        fold.add(cap_counts(knowledge, reply.weight), reply.node_id)
        content = RecordDict({k: v for k, v in reply.content.items() if k != CLASS_PROTOTYPES})
        return replace(reply, content=content)

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Config and, after round 1, the global prototypes (one record shared by all)."""
        content = super().node_content(ctx, node_id, arch)
        protos = self.global_prototypes
        if protos is not None:
            content[GLOBAL_PROTOTYPES] = ctx.share(
                GLOBAL_PROTOTYPES, lambda: prototypes_to_record(protos)
            )
        return content

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """No weights; a valid ``class-prototypes`` record."""
        return prototype_schema(self.env.num_classes, self.options.feature_dim)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Merge the prototypes robustly, make the next global ones, commit if finite."""
        folded = ctx.scheme_state.get(KnowledgeRound)
        result: FoldResult | None = None
        if isinstance(folded, KnowledgeRound):
            result = folded.fold.result()
            merge = PrototypeMerge(merged=as_prototypes(result.merged), bounded=[], clips=[])
            clips = [(node, n, b) for node, kind, n, b in result.clips if kind == "features"]
            clipped = log_clips(ctx, clips, self.env)
        else:
            merge, clipped = merge_replies(ctx, replies, self.env)
        protos, metrics = self.make_global(ctx, merge)
        if not np.all(np.isfinite(protos.prototypes)):
            raise NonFiniteStateError("the global prototypes are not finite")
        self.commit_global(ctx, protos)
        extra: dict[str, Any] = {}
        if result is not None:
            self.knowledge_scales = result.scales
            extra["knowledge_kept"] = result.kept
            extra["knowledge_rows"] = result.rows
        accuracies = [r.metrics[PROTO_ACCURACY] for r in replies if PROTO_ACCURACY in r.metrics]
        return {
            **metrics,
            **extra,
            "prototype_classes": int(protos.class_ids.shape[0]),
            "prototypes_clipped": clipped,
            "proto_accuracy_mean": float(np.mean(accuracies)) if accuracies else None,
        }

    def make_global(
        self, ctx: RoundContext, merge: PrototypeMerge
    ) -> tuple[ClassPrototypes, dict[str, Any]]:
        """Return the next global prototypes and round metrics; change no state.

        Default (FedProto): the merged prototypes. :meth:`commit_global` keeps them
        once they are known to be finite.
        """
        return merge.merged, {}

    def commit_global(self, ctx: RoundContext, protos: ClassPrototypes) -> None:
        """Keep ``protos`` as what the next round sends (subclasses commit more)."""
        self.global_prototypes = protos

    def describe(self) -> dict[str, Any]:
        """Return the options (kebab-case keys)."""
        return options_document(self.options)

    def state_dict(self) -> dict[str, Any]:
        """Return the base state and the global prototypes."""
        protos = self.global_prototypes
        return {
            **super().state_dict(),
            "global_prototypes": None
            if protos is None
            else {
                CLASS_IDS: protos.class_ids,
                COUNTS: protos.counts,
                PROTOTYPES: protos.prototypes,
            },
            KNOWLEDGE_SCALES: dict(self.knowledge_scales),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: the base part, then the scheme's, all checked first.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix, if an entry fails
            its check.
        """
        super().load_state_dict(state)
        self.checked_scheme_state(state)()

    def checked_scheme_state(self, state: Mapping[str, Any]) -> Callable[[], None]:
        """Check the scheme's checkpoint entries; return what assigns them.

        The entry ``global_prototypes`` is ``None`` or a valid prototype record
        (:func:`~strategies.prototypes.payload.prototype_problem`). Subclasses
        extend it (``super().checked_scheme_state(state)`` first).
        """
        from tessera.checkpoint import refusal
        from tessera.state_checks import StateFileError

        protos = prototypes_from_state(
            state,
            "global_prototypes",
            num_classes=self.env.num_classes,
            feature_dim=self.options.feature_dim,
        )
        try:
            scales = scales_from_state(state)
        except StateFileError as err:
            raise refusal(state, err) from err

        def restore() -> None:
            self.global_prototypes = protos
            self.knowledge_scales = scales

        return restore


def prototypes_from_state(
    state: Mapping[str, Any], key: str, *, num_classes: int, feature_dim: int
) -> ClassPrototypes | None:
    """Return checkpoint entry ``key`` as prototypes (``None`` if it is ``None``), checked.

    Raises
    ------
    CheckpointError
        Naming the checkpoint file, the field and the fix.
    """
    from tessera.checkpoint import field_of, refusal
    from tessera.state_checks import StateFileError, get_mapping

    if state.get(key) is None:
        return None
    where = f"{field_of(state)}.{key}" if field_of(state) else key
    try:
        tree = get_mapping(state, key)
        arrays = dict(tree.items())
        odd = sorted(k for k, v in arrays.items() if not isinstance(v, np.ndarray))
        problem = (
            f"holds {odd}, which are not arrays"
            if odd
            else prototype_problem(arrays, num_classes=num_classes, feature_dim=feature_dim)
        )
        if problem is not None:
            raise StateFileError(where, problem)
    except StateFileError as err:
        raise refusal(state, err) from err
    return ClassPrototypes(arrays[CLASS_IDS], arrays[COUNTS], arrays[PROTOTYPES])


def options_document(options: Any) -> dict[str, Any]:
    """Return a scheme's options (a dataclass) with kebab-case keys, for ``config.json``."""
    return {k.replace("_", "-"): v for k, v in asdict(options).items()}


def prototype_schema(num_classes: int, feature_dim: int) -> ReplySchema:
    """Return the reply schema of a node that sends prototypes: no weights, a valid record."""
    check = functools.partial(
        check_prototype_record, num_classes=num_classes, feature_dim=feature_dim
    )
    return ReplySchema(arrays=None, extra=check)


def claimed_prototypes(
    ctx: RoundContext, reply: ClientReply, env: ServerEnv, declared: Sequence[int] | None
) -> tuple[ClientReply, ClassKnowledge]:
    """Return a reply's prototypes cut to its node's handshake label counts.

    :func:`~strategies.felo.fold.within_declared` on the prototypes as knowledge; the
    reply comes back with its ``class-prototypes`` record rewritten when they were cut.

    Raises
    ------
    KnowledgeError
        If the node declared none of the classes it reports (the reply is refused).
    """
    sent = as_knowledge(
        record_to_prototypes(reply.content.array_records[CLASS_PROTOTYPES]), env.num_classes
    )
    knowledge = within_declared(ctx, sent, reply.node_id, declared)
    if knowledge is not sent:
        reply = reply.with_record(CLASS_PROTOTYPES, prototypes_to_record(as_prototypes(knowledge)))
    return reply, knowledge


def merge_replies(
    ctx: RoundContext, replies: Sequence[ClientReply], env: ServerEnv
) -> tuple[PrototypeMerge, list[dict[str, Any]]]:
    """Merge the accepted replies' prototypes robustly; log and list the clipped nodes.

    Run-config ``knowledge-merge``, ``trim-fraction`` and ``knowledge-clip-factor``
    choose the merge and the row bound; each reply's counts are capped at its
    (capped) weight (:func:`~strategies.prototypes.merge.merge_prototypes`).

    Returns
    -------
    tuple[PrototypeMerge, list[dict[str, Any]]]
        The merge, and per clipped reply its node, largest row norm and bound (for
        the round record's ``prototypes_clipped``).
    """
    agg = env.run.aggregation
    parts = [record_to_prototypes(r.content.array_records[CLASS_PROTOTYPES]) for r in replies]
    merge = merge_prototypes(
        parts,
        env.num_classes,
        rule=agg.knowledge_merge,
        trim_fraction=agg.trim_fraction,
        clip_factor=agg.knowledge_clip_factor,
        max_weights=[r.weight for r in replies],
    )
    clips = [(replies[i].node_id, norm, bound) for i, norm, bound in merge.clips]
    return merge, log_clips(ctx, clips, env)


def log_clips(
    ctx: RoundContext, clips: Sequence[tuple[int, float, float]], env: ServerEnv
) -> list[dict[str, Any]]:
    """Log each ``(node id, largest row norm, bound)`` clip; return them as round records."""
    for node, norm, bound in clips:
        log.info(
            "round %d: node %d's prototypes clipped from norm %.4g to %.4g "
            "(knowledge-clip-factor %g)",
            ctx.server_round,
            node,
            norm,
            bound,
            env.run.aggregation.knowledge_clip_factor,
        )
    return [{"node": node, "norm": norm, "bound": bound} for node, norm, bound in clips]


class GlobalHeadStrategy(HeteroStrategy[FeatureOptionsT]):
    """Server of a scheme that sends one global head (FedGH, LG-FedAvg).

    Every round it sends :meth:`global_head` to every trainer as the weights record
    (one record shared by all messages); subclasses say how the head is made.
    There is no global model to evaluate: the bodies stay at the nodes.
    """

    def initial_head(self) -> dict[str, np.ndarray]:
        """Return the head before any round (seeded by run-config ``seed``)."""
        return initial_head(
            num_classes=self.env.num_classes,
            feature_dim=self.options.feature_dim,
            seed=self.env.run.seed,
        )

    def global_head(self) -> Mapping[str, np.ndarray]:
        """Return the head the next round sends."""
        raise NotImplementedError

    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Config and the global head (:data:`~strategies.prototypes.head.HEAD_KEYS` only)."""
        content = super().node_content(ctx, node_id, arch)
        content[wire.ARRAYS] = ctx.share(
            wire.ARRAYS, lambda: wire.numpy_to_record(self.global_head())
        )
        return content

    def describe(self) -> dict[str, Any]:
        """Return the options (kebab-case keys)."""
        return options_document(self.options)
