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
  an architecture name ``<global>@w<width>-d<depths>`` (:func:`models.spec.slice_name`),
  so the handshake, the reply schema, the model builders and the results work on it
  as on any registered model. The device picks the largest slice that fits its
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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict
from torch import nn

from models.base import TesseraModel
from models.spec import Layout, SubModelSpec, slice_name, split_name
from strategies.core.aggregators import Index
from strategies.core.client import ClientAlgorithm, RoundInput
from strategies.core.context import RoundContext
from strategies.core.groups import GroupModels, GroupRound, without_arrays
from strategies.core.strategy import HeteroStrategy
from strategies.core.validation import ClientReply, ReplySchema
from strategies.submodel.extract import extract
from tessera import wire
from tessera.config import ConfigError, ConfigReader, RunConfig
from tessera.data import ArrayDataset
from tessera.node_state import NodeState
from tessera.training import LossFn

log = logging.getLogger("flwr.tessera")

__all__ = [
    "DEFAULT_WIDTHS",
    "SubModelClient",
    "SubModelOptions",
    "SubModelStrategy",
    "attach_scaler",
    "candidate_specs",
    "depth_levels",
    "masked_cross_entropy",
    "norm_entries",
    "resolve_global",
    "slice_counts",
]

COVERAGE_AGGREGATORS = ("mean", "norm-clip")
"""Aggregators that fold partial (sliced) updates by coverage; the buffered robust
rules (median, trimmed mean, Krum) compare whole updates and refuse slices."""

DEFAULT_WIDTHS = (1.0, 0.5, 0.25, 0.125)
"""HeteroFL's width levels a-d (``submodel-widths``)."""


def _parse_widths(text: str) -> tuple[float, ...]:
    try:
        widths = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        widths = []
    if not widths or any(not 0 < w <= 1 for w in widths) or len(set(widths)) != len(widths):
        raise ConfigError(
            f"run-config 'submodel-widths' is {text!r}; give distinct width ratios in "
            f"(0, 1] separated by commas, e.g. '1,0.5,0.25,0.125'"
        )
    return tuple(sorted(widths, reverse=True))


@dataclass(frozen=True)
class SubModelOptions:
    """Options every sub-model scheme reads (run-config ``submodel-*``).

    Attributes
    ----------
    global_model : str or None
        Registered sectioned model to slice (``submodel-global``); None: the
        family's smallest sectioned model.
    widths : tuple[float, ...]
        Width ratios a node may train (``submodel-widths``), largest first.
    mask_classes : bool
        Mask the logits of classes absent from a node's training data in its loss
        (``submodel-mask-classes``, default true; HeteroFL's masked cross-entropy).
    scaler : bool
        Divide every convolution's output by the width ratio in training
        (``submodel-scaler``, default true; HeteroFL's scaler).
    width_flexible, depth_flexible : bool
        Whether a node may cut its slice in width, in depth: the scheme's own, not
        run-config keys (each scheme's options class sets its defaults).
    """

    global_model: str | None = None
    widths: tuple[float, ...] = DEFAULT_WIDTHS
    mask_classes: bool = True
    scaler: bool = True
    width_flexible: bool = True
    depth_flexible: bool = True

    @classmethod
    def read(cls, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """Return the common options as keyword arguments (for subclasses' ``parse``)."""
        r = ConfigReader(run_config, "run-config")
        global_model = r.optional_str("submodel-global")
        if global_model is not None:
            from models.slicing import global_config

            try:
                global_config(global_model)
            except ValueError as err:
                raise ConfigError(f"run-config 'submodel-global': {err}") from None
        return {
            "global_model": global_model,
            "widths": _parse_widths(r.get("submodel-widths", str, "1,0.5,0.25,0.125")),
            "mask_classes": r.get("submodel-mask-classes", bool, True),
            "scaler": r.get("submodel-scaler", bool, True),
        }

    @classmethod
    def parse(cls, run_config: Mapping[str, Any]) -> SubModelOptions:
        """Read the options from the run config."""
        return cls(**cls.read(run_config))

    def model_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of :func:`models.get_model` for every slice (none).

        Client and server build their models with these, so both build the same
        architecture (NeFL adds ``block_step``).
        """
        return {}


def resolve_global(name: str | None, family: str) -> str:
    """Return the global model: ``name``, or the smallest sectioned model of ``family``.

    Raises
    ------
    ConfigError
        If ``family`` has no sectioned model (nothing to slice).
    """
    from models import list_models, model_entry
    from models.slicing import SectionedConfig

    if name:
        return name
    for model in list_models(family):
        if isinstance(model_entry(model).config, SectionedConfig):
            return model
    raise ConfigError(
        f"model family '{family}' has no model with sections to slice; set run-config "
        f"'model-family' to 'preresnet' or 'mobilenetv2' (or leave it empty), or name "
        f"one with 'submodel-global'"
    )


def depth_levels(depths: Sequence[int], min_depth: int) -> list[tuple[int, ...]]:
    """Return the depth slices of a global model, deepest first.

    Level ``k`` keeps ``min(D_s, k)`` blocks of section ``s`` (at least
    ``min(min_depth, D_s)``), for ``k`` from the deepest section down to
    ``min_depth``; repeated levels are listed once.

    Examples
    --------
    >>> depth_levels((1, 2, 3, 4, 3, 3, 1), 2)
    [(1, 2, 3, 4, 3, 3, 1), (1, 2, 3, 3, 3, 3, 1), (1, 2, 2, 2, 2, 2, 1)]
    """
    levels: list[tuple[int, ...]] = []
    for k in range(max(depths), min_depth - 1, -1):
        level = tuple(max(min(d, k), min(min_depth, d)) for d in depths)
        if level not in levels:
            levels.append(level)
    return levels or [tuple(depths)]


def candidate_specs(
    full: SubModelSpec, min_depth: int, widths: Sequence[float], *, width: bool, depth: bool
) -> list[SubModelSpec]:
    """Return the slices a scheme allows: widths x depth levels, largest first.

    Parameters
    ----------
    full : SubModelSpec
        The global model's spec (width 1, every block).
    min_depth : int
        Fewest blocks a section keeps (:attr:`models.spec.Layout.min_depth`).
    widths : Sequence[float]
        Width ratios (used when ``width``).
    width, depth : bool
        Whether the scheme slices in width and in depth.
    """
    ws = sorted(set(widths) | {1.0}, reverse=True) if width else [1.0]
    ds = depth_levels(full.depths, min_depth) if depth else [full.depths]
    return [SubModelSpec(w, d) for w in ws for d in ds]


def norm_entries(model: nn.Module) -> frozenset[str]:
    """Return the state-dict keys that belong to normalisation layers of ``model``."""
    kinds = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    keys: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            keys.update(f"{name}.{k}" if name else k for k in module.state_dict())
    return frozenset(keys)


def masked_cross_entropy(present: torch.Tensor) -> LossFn:
    """Return cross-entropy over the classes in ``present`` only (a boolean mask).

    Logits of absent classes are set to the dtype's lowest value before the
    softmax, so they get no probability and no gradient (HeteroFL's masked loss).
    """

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        mask = present.to(logits.device)
        masked = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        return nn.functional.cross_entropy(masked, y)

    return loss


def attach_scaler(model: nn.Module, width: float) -> int:
    """Divide every convolution's output by ``width`` in training (HeteroFL's scaler).

    In evaluation the convolutions are left as they are. Returns the number of
    convolutions scaled (0 when ``width`` is 1).
    """
    if width == 1.0:
        return 0

    def scale(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output / width if module.training else output

    count = 0
    for module in model.modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            module.register_forward_hook(scale)
            count += 1
    return count


def check_aggregator(scheme: str, aggregator: str, allowed: tuple[str, ...]) -> None:
    """Refuse an aggregator a sub-model scheme cannot use, naming those it can.

    Raises
    ------
    ConfigError
        If ``aggregator`` is not in ``allowed``.
    """
    if aggregator not in allowed:
        raise ConfigError(
            f"run-config 'aggregator' is '{aggregator}', which '{scheme}' cannot use: it "
            f"needs one that averages partial updates by coverage; use one of "
            f"{', '.join(allowed)}"
        )


def validate_submodel(run: RunConfig, options: SubModelOptions) -> None:
    """Refuse an aggregator the sub-model schemes cannot use (their ``validate`` hook)."""
    check_aggregator(run.scheme.strategy, run.aggregation.aggregator, COVERAGE_AGGREGATORS)


class SubModelClient(ClientAlgorithm):
    """A node of a sub-model scheme: trains the slice the server names.

    Its options' ``width_flexible`` and ``depth_flexible`` say which slices it may
    pick in the handshake.
    """

    def __init__(self, *, run: RunConfig, options: Any) -> None:
        super().__init__(run=run, options=options)
        self.present: torch.Tensor | None = None

    def slice_axes(self) -> tuple[bool, bool]:
        """Return whether a node may cut its slice in width and in depth."""
        return self.options.width_flexible, self.options.depth_flexible

    def candidate_archs(self, family: str) -> list[str]:
        """Return the slices of the global model this scheme lets a node train."""
        from models.slicing import family_layout, full_spec

        global_name = resolve_global(self.options.global_model, family)
        width, depth = self.slice_axes()
        specs = candidate_specs(
            full_spec(global_name),
            family_layout(global_name).min_depth,
            self.options.widths,
            width=width,
            depth=depth,
        )
        return [slice_name(global_name, s) for s in specs]

    def build_model(
        self, arch: str, *, input_shape: tuple[int, ...], num_classes: int
    ) -> TesseraModel:
        """Build slice ``arch`` with the scheme's options (:meth:`SubModelOptions.model_kwargs`)."""
        from models import get_model

        return get_model(
            arch,
            input_shape=input_shape,
            num_classes=num_classes,
            norm=self.run.scheme.norm,
            flat_input=self.run.scheme.flat_input,
            **self.options.model_kwargs(),
        )

    def prepare_data(
        self, train: ArrayDataset, test: ArrayDataset
    ) -> tuple[ArrayDataset, ArrayDataset]:
        """Note which classes the node has training data of (for the masked loss)."""
        self.present = None
        if self.options.mask_classes and len(train) > 0:
            labels = torch.as_tensor(np.unique(train.y), dtype=torch.long)
            self.present = torch.zeros(int(labels.max()) + 1, dtype=torch.bool)
            self.present[labels] = True
        return train, test

    def begin_round(self, model: nn.Module, rnd: RoundInput, state: NodeState) -> None:
        """Attach the scaler for a narrow slice; size the class mask to the task."""
        _, spec = split_name(rnd.arch)
        if self.options.scaler and spec is not None:
            attach_scaler(model, spec.width)
        if self.present is not None and len(self.present) != rnd.num_classes:
            mask = torch.zeros(rnd.num_classes, dtype=torch.bool)
            mask[: min(len(self.present), rnd.num_classes)] = self.present[: rnd.num_classes]
            self.present = mask

    def loss_fn(self) -> LossFn:
        """Masked cross-entropy when enabled, plain cross-entropy otherwise."""
        if self.present is None:
            return super().loss_fn()
        return masked_cross_entropy(self.present)


class SubModelStrategy(HeteroStrategy):
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
        self.models = GroupModels(self.aggregator, self.group_initial, self.pool_direction)
        self._index: dict[str, dict[str, Index]] = {}
        self._directions: tuple[int, dict[str, dict[str, np.ndarray] | None]] = (-1, {})
        """``(completed round, {slice: the server's own update of it})``, a round's cache."""
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
            arch,
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
        return [slice_name(self.global_name, s) for s in self.specs]

    def spec_of(self, arch: str) -> SubModelSpec:
        """Return the spec of slice ``arch`` (the global model's for its own name)."""
        model, spec = split_name(arch)
        if model != self.global_name:
            raise ValueError(f"'{arch}' is not a slice of the global model '{self.global_name}'")
        return self.full if spec is None else spec

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
        return slice_name(self.global_name, self.full)

    def slice_direction(self, arch: str) -> dict[str, np.ndarray] | None:
        """Return the server's own update of slice ``arch`` on its pool (once a round).

        A narrow slice learns differently from the same part of the whole model, so
        its update is compared with the slice's own training on the server pool
        (:meth:`~strategies.core.strategy.HeteroStrategy.pool_direction`, from the slice the
        node received), not with a cut of the whole model's. ``None`` for the
        full-size slice (the accumulator's own direction is that) or when the
        direction check is off.
        """
        if arch == self.full_arch:
            return None
        done, cache = self._directions
        if done != self.completed_round:
            cache = {}
            self._directions = (self.completed_round, cache)
        if arch not in cache:
            own = self.pool_direction(arch, self.sub_state(arch))
            cache[arch] = None if own is None else self.fold_view(own)
        return cache[arch]

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
        """Config plus the node's slice of the global model."""
        content = super().node_content(ctx, node_id, arch)
        content[wire.ARRAYS] = wire.numpy_to_record(self.sub_state(arch))
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
        own = self.slice_direction(reply.arch)
        rnd = ctx.state(GroupRound)
        self.models.fold(
            rnd,
            self.global_name,
            shared,
            weight,
            index={k: index[k] for k in shared},
            node=reply.node_id,
            direction=None if own is None else {k: v for k, v in own.items() if k in shared},
        )
        if private:
            own = {k: v for k, v in reply.arrays.items() if k in private}
            self.models.fold(rnd, reply.arch, own, weight, node=reply.node_id)
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
        """Restore the base state and the models."""
        super().load_state_dict(state)
        self.models.load_state_dict(state.get("group_models", {}))
        self._index = {}


def slice_counts(replies: Iterable[ClientReply]) -> dict[str, int]:
    """Count the replies per slice, by architecture name (for the round record)."""
    counts: dict[str, int] = {}
    for reply in replies:
        counts[reply.arch] = counts.get(reply.arch, 0) + 1
    return dict(sorted(counts.items()))
