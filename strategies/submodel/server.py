"""What the sub-model schemes share: one global model, each node trains a slice of it.

``heterofl``, ``flexifed``, ``nefl`` and ``fedfa`` differ in which slices a node may
train (width, depth or both) and in how the slices are folded back into the global
model; everything else is here:

- **Options** (:class:`SubModelOptions`, run-config ``submodel-*``): the global
  model (``submodel-global``, default the smallest sectioned model of the family,
  ``preresnet26_025`` for ``preresnet``), the widths a node may train
  (``submodel-widths``, HeteroFL's ``1, 1/2, 1/4, 1/8`` by default), masking of the
  logits of classes a node has no data of (``submodel-mask-classes``) and HeteroFL's
  scaler (``submodel-scaler``).
- **Slices**: :func:`candidate_specs` lists the slices a scheme allows; a slice is
  a :class:`~models.spec.ModelRef` (the global model plus a spec), carried as
  structure in the handshake, the train messages and the round records, and printed
  ``<global>@w<width>-d<depths>`` for people and as the key of its group, so the
  reply schema, the model builders and the results work on it as on any
  registered model. The device picks the largest slice that fits its
  memory and round time (:mod:`client_app.selection`, through
  :meth:`SubModelClient.candidate_archs`); its size rank is derived from its
  measured cost, not declared.
- **Client** (:class:`SubModelClient`): masked cross-entropy and the scaler.
- **Server** (:class:`SubModelStrategy`): sends each node ``extract(global, spec)``,
  demands the slice's arrays back, evaluates the full model and every slice in use
  on the server's test set. With ``norm="static-batch"`` (HeteroFL's sBN) clients
  train without running statistics and the server recomputes them from scratch on
  its own data before each evaluation (:func:`tessera.training.recompute_batch_statistics`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict

from models.spec import Layout, ModelRef, SubModelSpec
from strategies.core.aggregators import Index
from strategies.core.context import RoundContext
from strategies.core.direction import ClassDirections, PoolMix, along_mix
from strategies.core.groups import GroupModels, GroupRound, required_entry, without_arrays
from strategies.core.strategy import HeteroStrategy
from strategies.core.validation import ClientReply, ReplySchema
from strategies.submodel.extract import extract
from strategies.submodel.options import (
    COVERAGE_AGGREGATORS,
    SubModelOptionsT,
    candidate_specs,
    check_aggregator,
    resolve_global,
)
from tessera import wire
from tessera.data import ArrayDataset

log = logging.getLogger("flwr.tessera")

__all__ = [
    "SubModelStrategy",
    "slice_counts",
]


class SubModelStrategy(HeteroStrategy[SubModelOptionsT]):
    """Server side of a sub-model scheme (module docstring).

    Subclasses set ``width_flexible`` / ``depth_flexible`` and override :meth:`fold`
    (default: coverage averaging of the slice into the global model through the
    injected aggregator), and where they keep more than one model, :meth:`sub_state`.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from models.slicing import family_layout, full_spec

        check_aggregator(self.name, self.aggregator.name, COVERAGE_AGGREGATORS)

        self.global_name = resolve_global(self.options.global_model, self.env.family)
        self.layout: Layout = family_layout(self.global_name)
        self.full: SubModelSpec = full_spec(self.global_name)
        width, depth = self.slice_axes()
        self.specs = candidate_specs(
            self.full,
            self.layout.min_depth,
            self.options.widths,
            width=width,
            depth=depth,
        )
        self.refs: dict[str, ModelRef] = {
            ref.name: ref for ref in (ModelRef(self.global_name, s) for s in self.specs)
        }
        """The slices a node may train, by printed name."""
        self.models = GroupModels(
            self.aggregator, self.group_initial, self.group_direction, self.reference_mix
        )
        self._index: dict[str, dict[str, Index]] = {}
        self._directions: tuple[int, dict[str, dict[str, np.ndarray] | None], ClassDirections] = (
            -1,
            {},
            ClassDirections(),
        )
        """``(completed round, {slice: the server's own update of it}, those on some
        label mixes)``, a round's cache."""
        if self.env.run.scheme.norm == "batch":
            log.warning(
                "%s with norm='batch': the server averages the slices' running statistics, "
                "which fit no slice, so the global model may score near chance on the "
                "server's test set; use run-config norm='static-batch' (HeteroFL's sBN: "
                "statistics recomputed on the server pool before each evaluation)",
                self.name,
            )

    # ------------------------------------------------------------------ slices
    def build_model(self, arch: str, *, norm: str | None = None) -> torch.nn.Module:
        """Build a fresh, seeded slice ``arch`` as the nodes do (with the scheme's options).

        ``norm`` overrides the run's normalisation (static batch norm is evaluated
        as batch norm with recomputed statistics).
        """
        from models import get_model

        torch.manual_seed(self.env.run.seed)
        return get_model(
            self.model_ref(arch),
            input_shape=self.env.input_shape,
            num_classes=self.env.num_classes,
            norm=self.env.run.scheme.norm if norm is None else norm,
            flat_input=self.env.run.scheme.flat_input,
            **self.options.model_kwargs(),
        )

    def slice_axes(self) -> tuple[bool, bool]:
        """Return whether nodes may cut their slices in width and in depth."""
        return self.options.width_flexible, self.options.depth_flexible

    def known_archs(self) -> list[str]:
        """Return the slices a node may name in the handshake."""
        return list(self.refs)

    def spec_of(self, arch: str) -> SubModelSpec:
        """Return the spec of slice ``arch`` (the global model's for its own name)."""
        if arch == self.global_name:
            return self.full
        ref = self.refs.get(arch)
        if ref is None or ref.spec is None:
            raise ValueError(f"'{arch}' is not a slice of the global model '{self.global_name}'")
        return ref.spec

    def model_ref(self, arch: str) -> ModelRef:
        """Return slice ``arch`` (or the global model) as a structured reference."""
        if arch == self.global_name:
            return ModelRef(self.global_name)
        return ModelRef(self.global_name, self.spec_of(arch))

    @property
    def global_state(self) -> dict[str, np.ndarray]:
        """The current global weights."""
        return self.models.get(self.global_name)

    def group_initial(self, group: str) -> dict[str, np.ndarray]:
        """Return a group's initial weights: the seeded global model or a slice of it."""
        initial = self.initial_arrays(self.global_name)
        if group == self.global_name:
            return initial
        return extract(initial, self.spec_of(group), self.layout)[0]

    def index_of(self, arch: str) -> dict[str, Index]:
        """Where each entry of slice ``arch`` sits in the global model (cached)."""
        if arch not in self._index:
            self._index[arch] = extract(self.global_state, self.spec_of(arch), self.layout)[1]
        return self._index[arch]

    @property
    def full_arch(self) -> str:
        """The architecture name of the full-size slice (the global model itself)."""
        return ModelRef(self.global_name, self.full).name

    def group_direction(
        self,
        group: str,
        weights: Mapping[str, np.ndarray],
        mix: PoolMix | None = None,
    ) -> dict[str, np.ndarray] | None:
        """Return the server's own update of a group of :attr:`models` (its direction).

        The global model's: :meth:`pool_direction` of ``weights``. A slice's group holds
        only its :meth:`private_keys` (the rest of it stays at the initial slice), so
        its direction is the slice's own training from the slice a node receives
        (:meth:`slice_direction`, the full-size slice's too), not a training of that
        mostly initial model: that one pointed nowhere in particular and NeFL's
        normalisation updates were dropped at cosines of -0.14 to 0 (2 to 5 of 8 a
        round, pathological(2)).
        """
        if group in self.refs:
            return self.slice_direction(group, mix, whole=True)
        return self.pool_direction(group, weights, mix)

    def slice_direction(
        self, arch: str, mix: PoolMix | None = None, *, whole: bool = False
    ) -> dict[str, np.ndarray] | None:
        """Return the server's own update of slice ``arch`` on its pool (once a round).

        A narrow slice learns differently from the same part of the whole model, so
        its update is compared with the slice's own training on the server pool
        (:meth:`~strategies.core.strategy.HeteroStrategy.pool_direction`, from the slice the
        node received), not with a cut of the whole model's. With ``mix`` (a
        label-skewed node's, :meth:`reference_mix`), on that mix of the pool, the
        full-size slice's too (once per mix and round, a bounded number of them: past
        it, the nearest made). ``None`` for the
        full-size slice without ``mix`` (the accumulator's own direction is
        that; ``whole`` makes it anyway, for the slice's private entries) or when the
        direction check is off.
        """
        done, cache, restricted = self._directions
        if done != self.completed_round:
            cache, restricted = {}, ClassDirections()
            self._directions = (self.completed_round, cache, restricted)
        if mix is not None:

            def make() -> dict[str, np.ndarray] | None:
                own = self.pool_direction(arch, self.sub_state(arch), mix)
                return None if own is None else self.fold_view(own)

            found = restricted.get(arch, mix, make)
            if found is not None:
                return found
        if arch == self.full_arch and not whole:
            return None
        if arch not in cache:
            own = self.pool_direction(arch, self.sub_state(arch))
            cache[arch] = None if own is None else self.fold_view(own)
        return cache[arch]

    def reply_direction(
        self,
        arch: str,
        node_id: int,
        update: Mapping[str, np.ndarray],
        index: Mapping[str, Index],
    ) -> dict[str, np.ndarray] | None:
        """Return the direction a node's slice update is compared with.

        The slice's training on the node's label mix (:meth:`slice_direction`), or on
        the whole pool when the mix is drawn and the update does not point along its
        training (:func:`~strategies.core.direction.along_mix`).
        """
        mix = self.reference_mix(node_id)
        own = self.slice_direction(arch, mix)
        threshold = self.env.run.aggregation.trust_threshold
        if (
            mix is not None
            and own is not None
            and not along_mix(update, self.global_state, mix, own, threshold, index)
        ):
            own = self.slice_direction(arch)  # the whole pool's (see along_mix)
        return own

    def fold_view(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return a slice's arrays as :meth:`fold` hands them on (default: as they are).

        FedFA grafts them to the global depth; :meth:`slice_direction` caches the
        direction in that form, once a round.
        """
        return arrays

    def private_keys(self, arch: str) -> frozenset[str]:
        """Entries of slice ``arch`` averaged only among the nodes training that slice.

        Default: none, every entry is shared by coverage. NeFL keeps each slice's
        normalisation layers apart, FlexiFed's Basic-Common the layers that not every
        architecture in the federation has.
        """
        return frozenset()

    def sub_state(self, arch: str) -> dict[str, np.ndarray]:
        """Return the weights a node training ``arch`` starts from.

        The slice cut from the global model, with its :meth:`private_keys` taken from
        the slice's own model.
        """
        state = extract(self.global_state, self.spec_of(arch), self.layout)[0]
        private = self.private_keys(arch)
        if private:
            own = self.models.get(arch)
            state.update({k: own[k].copy() for k in private})
        return state

    # ------------------------------------------------------------------- hooks
    def node_content(self, ctx: RoundContext, node_id: int, arch: str) -> RecordDict:
        """Config plus the node's slice of the global model (one record per slice and round)."""
        content = super().node_content(ctx, node_id, arch)
        content[wire.ARRAYS] = ctx.share(
            (wire.ARRAYS, arch), lambda: wire.numpy_to_record(self.sub_state(arch))
        )
        return content

    def reply_schema(self, ctx: RoundContext, node_id: int, arch: str) -> ReplySchema:
        """Demand the slice's arrays, exactly."""
        return ReplySchema(arrays=self.array_spec(arch))

    def fold(self, ctx: RoundContext, reply: ClientReply) -> ClientReply:
        """Fold the slice into the global model by coverage (example-weighted).

        Its :meth:`private_keys` go to the slice's own model instead.
        """
        if reply.arrays is None:
            raise ValueError(f"node {reply.node_id} sent no weights")
        private = self.private_keys(reply.arch)
        index = self.index_of(reply.arch)
        shared = {k: v for k, v in reply.arrays.items() if k not in private}
        weight = reply.weight
        if private:  # folded whole or not at all: check the second part before the first
            self.models.check(reply.arch, {k: v for k, v in reply.arrays.items() if k in private})
        own = self.reply_direction(reply.arch, reply.node_id, shared, index)
        rnd = ctx.state(GroupRound)
        self.models.fold(
            rnd,
            self.global_name,
            shared,
            weight,
            index={k: index[k] for k in shared},
            node=reply.node_id,
            direction=None if own is None else {k: v for k, v in own.items() if k in shared},
            stretch=reply.stretch,
        )
        if private:
            own = {k: v for k, v in reply.arrays.items() if k in private}
            self.models.fold(
                rnd, reply.arch, own, weight, node=reply.node_id, stretch=reply.stretch
            )
        return without_arrays(reply)

    def aggregate(self, ctx: RoundContext, replies: Sequence[ClientReply]) -> dict[str, Any]:
        """Commit this round's aggregate; record how many slices of each kind were folded."""
        done = self.models.commit(ctx.state(GroupRound))
        return {"slices": slice_counts(replies), "clipped": done.clips}

    # -------------------------------------------------------------- evaluation
    def evaluated_models(self) -> dict[str, dict[str, np.ndarray]]:
        """Return the full global model and every slice assigned to a node, by architecture."""
        out = {self.global_name: self.sub_state(self.full_arch)}
        for arch in sorted(set(self.assignment.values())):
            if self.spec_of(arch) != self.full:
                out[arch] = self.sub_state(arch)
        return out

    def global_models(self) -> Mapping[str, dict[str, np.ndarray]]:
        """Return the full global model."""
        return {self.global_name: self.sub_state(self.full_arch)}

    def evaluate(self, ctx: RoundContext) -> dict[str, Any]:
        """Accuracy of the full model (``global_accuracy``) and of each slice in use.

        With ``norm="static-batch"`` each model is evaluated with running statistics
        recomputed from scratch on the server pool.
        """
        accuracy = {
            arch: self.accuracy_of(arch, arrays, self.env.global_test)
            for arch, arrays in self.evaluated_models().items()
        }
        out: dict[str, Any] = {
            "global_accuracy": accuracy[self.global_name],
            "global_accuracy_by_arch": {self.global_name: accuracy[self.global_name]},
            "submodel_accuracy": accuracy,
        }
        return out

    def accuracy_of(self, arch: str, arrays: Mapping[str, np.ndarray], data: ArrayDataset) -> float:
        """Accuracy on ``data``; with ``norm="static-batch"`` statistics come from the pool."""
        from tessera.training import evaluate_model, recompute_batch_statistics

        static = self.env.run.scheme.norm == "static-batch"
        model = self.build_model(arch, norm="batch" if static else None)
        model.load_state_dict(
            {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}, strict=False
        )
        if static:
            recompute_batch_statistics(model, self.env.server_pool, batch_size=256)
        _, acc = evaluate_model(model, data, batch_size=256, device=torch.device("cpu"))
        return acc

    # -------------------------------------------------------------- checkpoint
    def describe(self) -> dict[str, Any]:
        """Return the base description plus the global model and the slices allowed."""
        return {
            **super().describe(),
            "global_model": self.global_name,
            "slices": self.known_archs(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the base state plus the global (and per-slice) models."""
        return {**super().state_dict(), "group_models": self.models.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the base state and the models (entry ``group_models``).

        The entry is required, and after a round it must hold at least one group
        and every group of :meth:`checkpoint_groups`
        (:meth:`~strategies.core.groups.GroupModels.load_state_dict`): a run must
        never resume at round N with fresh weights.

        Raises
        ------
        CheckpointError
            Naming the checkpoint file, the field and the fix.
        """
        super().load_state_dict(state)
        after_a_round = self.completed_round >= 1
        self.models.load_state_dict(
            required_entry(state, "group_models"),
            required=self.checkpoint_groups() if after_a_round else (),
            nonempty=after_a_round,
        )
        self._index = {}

    def checkpoint_groups(self) -> tuple[str, ...]:
        """Return the groups of :attr:`models` a checkpoint written after a round holds.

        Default: the global model, into which every slice is folded (HeteroFL, NeFL,
        FedFA); a scheme whose groups are not the global model (FlexiFed's sharing
        sets) returns none by name.
        """
        return (self.global_name,)


def slice_counts(replies: Iterable[ClientReply]) -> dict[str, int]:
    """Count the replies per slice, by architecture name (for the round record)."""
    counts: dict[str, int] = {}
    for reply in replies:
        counts[reply.arch] = counts.get(reply.arch, 0) + 1
    return dict(sorted(counts.items()))
