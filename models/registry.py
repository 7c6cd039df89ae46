"""Registry of the model zoo, in the style of torchvision's ``models/_api.py``.

Each family module decorates its builders with :func:`register_model`; importing
:mod:`models` imports every family module, so the registry is complete once
``models`` is imported. Models are then built by name with :func:`get_model`.

A builder is a function taking keyword-only ``input_shape``, ``num_classes``,
``norm_layer`` and ``flat_input`` and returning a :class:`~models.base.TesseraModel`.
``flat_input`` (:data:`~models.base.FlatInput`) says how a convolutional model reads a
flat vector ``(L,)``: as a one-channel signal convolved in 1-d (``"signal"``, the
default) or reshaped to a square image (``"square"``); see :mod:`models.base`.

Besides the families of the registered models, the registry knows *cross-family
sets*: a name such as ``"mixed"`` (:data:`MIXED_FAMILY`) that :func:`list_models` and
:func:`list_families` treat like a family, standing for a fixed set of registered
models of different families (:data:`MIXED_MEMBERS`), listed by ascending measured
cost (:data:`COST_INPUT_SHAPE`). It is an alias, not a registration: every member
keeps its own family and size rank, and ``list_models()`` lists it once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from types import MappingProxyType
from typing import Final, Protocol, TypeVar

import torch

from models.base import (
    FlatInput,
    TesseraModel,
    count_macs,
    count_parameters,
    validate_flat_input,
    validate_input_shape,
    validate_num_classes,
)
from models.norm import NormFactory, get_norm
from models.spec import split_name

__all__ = [
    "COST_INPUT_SHAPE",
    "CROSS_FAMILY_SETS",
    "MIXED_FAMILY",
    "MIXED_MEMBERS",
    "ModelBuilder",
    "ModelEntry",
    "ModelRegistry",
    "get_model",
    "list_families",
    "list_models",
    "model_entry",
    "register_model",
]


class ModelBuilder(Protocol):
    """Signature of a registered model builder."""

    def __call__(
        self,
        *,
        input_shape: tuple[int, ...],
        num_classes: int,
        norm_layer: NormFactory,
        flat_input: FlatInput = "signal",
    ) -> TesseraModel:
        """Build a model for inputs of ``input_shape`` and ``num_classes`` classes."""
        ...


BuilderT = TypeVar("BuilderT", bound=ModelBuilder)

MIXED_FAMILY: Final = "mixed"
"""Name of the cross-family candidate set of the heterogeneous ensemble."""

MIXED_MEMBERS: Final[tuple[str, ...]] = (
    "mobilenetv2_035",
    "resnet10",
    "vgg11_0125",
    "densenet76_k12",
)
"""The models of :data:`MIXED_FAMILY`, one per family (Thonglek et al.'s fleet of
MobileNet, DenseNet, ResNet and VGG models chosen by device capacity).

Chosen so that parameters and MACs, on 8x8 and on 32x32 inputs alike, grow in the
same order: vgg11_0125 < mobilenetv2_035 < densenet76_k12 < resnet10. Listed here in
any order; :func:`list_models` orders them by measured cost.
"""

CROSS_FAMILY_SETS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {MIXED_FAMILY: MIXED_MEMBERS}
)
"""Cross-family sets of the zoo's registry: name -> member models."""

COST_INPUT_SHAPE: Final[tuple[int, ...]] = (1, 8, 8)
"""Input of the cost measurement ordering a cross-family set: one 8x8 channel."""


@dataclass(frozen=True)
class ModelEntry:
    """One registered model.

    Attributes
    ----------
    name : str
        Unique model name, e.g. ``"resnet18"``; it encodes the scale.
    family : str
        Architecture family, e.g. ``"resnet"``.
    size_rank : int
        Rank of the model by size within its family, 0 for the smallest.
    builder : ModelBuilder
        Function building the model.
    description : str
        One-line human-readable description.
    config : object or None
        The frozen architecture config the builder builds (e.g. a
        :class:`~models.preresnet.PreResNetConfig`), None where the family has none.
        Sectioned configs can be sliced (:mod:`models.slicing`).
    """

    name: str
    family: str
    size_rank: int
    builder: ModelBuilder
    description: str = ""
    config: object | None = None


class ModelRegistry:
    """A set of named model builders that refuses duplicates.

    The package keeps one default instance, used by the module-level functions
    (:func:`register_model`, :func:`get_model`, ...); separate instances are useful in
    tests.

    Parameters
    ----------
    cross_family_sets : Mapping[str, Sequence[str]], optional
        Names listed like families that stand for sets of registered models, at most
        one per family (see :meth:`names`); none by default. Members may be
        registered later, but must be registered when the set is listed.

    Raises
    ------
    ValueError
        If a set is empty or names a model twice.
    """

    def __init__(self, *, cross_family_sets: Mapping[str, Sequence[str]] | None = None) -> None:
        self._entries: dict[str, ModelEntry] = {}
        self._sets: dict[str, tuple[str, ...]] = {}
        self._set_order: dict[str, list[str]] = {}
        """Each set's members by measured cost, measured once (cleared on registration)."""
        for set_name, members in (cross_family_sets or {}).items():
            chosen = tuple(members)
            if not set_name or not chosen or len(set(chosen)) != len(chosen):
                raise ValueError(
                    f"Cross-family set {set_name!r} must have a name and distinct member "
                    f"models, got {chosen}."
                )
            self._sets[set_name] = chosen

    def register(
        self,
        name: str,
        *,
        family: str,
        size_rank: int,
        description: str = "",
        config: object | None = None,
    ) -> Callable[[BuilderT], BuilderT]:
        """Return a decorator registering a builder under ``name``.

        Parameters
        ----------
        name : str
            Unique model name.
        family : str
            Architecture family.
        size_rank : int
            Rank by size within the family, 0 for the smallest; unique per family.
        description : str, optional
            One-line description.
        config : object or None, optional
            The frozen config the builder builds, exposed as ``ModelEntry.config``.

        Returns
        -------
        Callable[[BuilderT], BuilderT]
            A decorator that registers the builder and returns it unchanged.

        Raises
        ------
        ValueError
            If ``name`` is taken, ``(family, size_rank)`` is taken, ``name`` or
            ``family`` is empty or ``family`` names a cross-family set, or
            ``size_rank`` is negative.
        """
        if not name or not family:
            raise ValueError(
                f"Model name and family must be non-empty, got name={name!r}, family={family!r}."
            )
        if family in self._sets:
            raise ValueError(
                f"Family {family!r} is the name of a cross-family set of models; register "
                f"{name!r} under its own family."
            )
        if size_rank < 0:
            raise ValueError(
                f"size_rank must be >= 0 (0 = smallest in its family), got "
                f"{size_rank} for model {name!r}."
            )

        def decorator(builder: BuilderT) -> BuilderT:
            if name in self._entries:
                raise ValueError(
                    f"A model named {name!r} is already registered; pick another name."
                )
            for entry in self._entries.values():
                if entry.family == family and entry.size_rank == size_rank:
                    raise ValueError(
                        f"Family {family!r} already has size_rank {size_rank} "
                        f"(model {entry.name!r}); give {name!r} another size_rank."
                    )
            self._set_order.clear()
            self._entries[name] = ModelEntry(
                name=name,
                family=family,
                size_rank=size_rank,
                builder=builder,
                description=description,
                config=config,
            )
            return builder

        return decorator

    def entry(self, name: str) -> ModelEntry:
        """Return the entry registered under ``name``.

        Parameters
        ----------
        name : str
            Model name.

        Returns
        -------
        ModelEntry
            The registered entry.

        Raises
        ------
        ValueError
            If no model is registered under ``name``.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"Unknown model '{name}'. Available: {', '.join(self.names())}."
            ) from None

    def families(self) -> list[str]:
        """Return the registered families and cross-family sets, sorted alphabetically.

        Returns
        -------
        list[str]
            Family names.
        """
        return sorted({entry.family for entry in self._entries.values()} | set(self._sets))

    def names(self, family: str | None = None) -> list[str]:
        """Return model names ordered by family, then by ascending size rank.

        A cross-family set (e.g. ``"mixed"``) lists its members by ascending measured
        cost instead: multiply-accumulates of one forward pass on a
        :data:`COST_INPUT_SHAPE` input (:func:`models.base.count_macs`), then the
        parameter count, then the name. Measuring builds each member with batch norm
        on the meta device (shapes only), without touching torch's random state. With
        no ``family`` every registered model is listed once; the sets add no names.

        Parameters
        ----------
        family : str or None, optional
            Restrict to this family or cross-family set; all families when None.

        Returns
        -------
        list[str]
            Model names.

        Raises
        ------
        ValueError
            If ``family`` is given and is neither a family nor a cross-family set, or
            the set names an unregistered model or two models of one family.
        """
        if family is not None and family not in self.families():
            raise ValueError(
                f"Unknown model family {family!r}. Available families: "
                f"{', '.join(self.families())}."
            )
        if family is not None and family in self._sets:
            return self._by_cost(family)
        entries = sorted(self._entries.values(), key=lambda e: (e.family, e.size_rank))
        return [e.name for e in entries if family is None or e.family == family]

    def _by_cost(self, set_name: str) -> list[str]:
        """Return the members of a cross-family set by ascending measured cost."""
        if set_name not in self._set_order:
            self._set_order[set_name] = self._measure_set(set_name)
        return list(self._set_order[set_name])

    def _measure_set(self, set_name: str) -> list[str]:
        members = self._sets[set_name]
        families = [self.entry(name).family for name in members]
        if len(set(families)) != len(families):
            raise ValueError(
                f"Cross-family set {set_name!r} must name at most one model per family, got "
                f"{', '.join(f'{n} ({f})' for n, f in zip(members, families, strict=True))}."
            )

        def cost(name: str) -> tuple[int, int, str]:
            # On the meta device: shapes only, no memory, no initialisation to pay for.
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                model = self.build(name, input_shape=COST_INPUT_SHAPE, num_classes=2)
            return count_macs(model, COST_INPUT_SHAPE), count_parameters(model), name

        return sorted(members, key=cost)

    def build(
        self,
        name: str,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        norm: str = "batch",
        block_step: bool = False,
        flat_input: FlatInput = "signal",
    ) -> TesseraModel:
        """Build the model registered under ``name``.

        Parameters
        ----------
        name : str
            Model name, or a slice of a sectioned one: ``"<model>@w<width>-d<depths>"``
            (:func:`models.spec.slice_name`).
        input_shape : Sequence[int]
            Shape of one sample without the batch dimension: ``(C, H, W)``, ``(C, L)``
            or ``(L,)``.
        num_classes : int
            Number of classes, at least 2.
        norm : str, optional
            Normalisation name, see :func:`models.norm.get_norm`; ``"batch"`` by
            default.
        block_step : bool, optional
            Give every residual block a learnable step size (the config's
            ``block_step``; NeFL). Only for families whose config has that field.
        flat_input : FlatInput, optional
            How a convolutional model reads a flat vector ``(L,)``: ``"signal"``
            (default, 1-d convolutions) or ``"square"`` (a zero-padded square image,
            2-d convolutions). Images are always 2-d and ``(C, L)`` signals 1-d
            (``"square"`` is refused for them); the ``mlp`` family ignores it.

        Returns
        -------
        TesseraModel
            A freshly initialised model.

        Raises
        ------
        ValueError
            If the name, input shape, number of classes, norm or ``flat_input`` is
            invalid, or ``block_step`` is asked of a model without step sizes.
        """
        model, spec = split_name(name)
        entry = self.entry(model)
        shape = validate_input_shape(input_shape)
        classes = validate_num_classes(num_classes)
        norm_layer = get_norm(norm)
        flat = validate_flat_input(flat_input, shape)
        config = entry.config
        if block_step:
            if not is_dataclass(config) or "block_step" not in {f.name for f in fields(config)}:
                raise ValueError(
                    f"model {model!r} has no residual blocks with step sizes, so it cannot "
                    "be built with block_step; use a preresnet or mobilenetv2 model"
                )
            config = replace(config, block_step=True)  # type: ignore[type-var]
            if spec is None:
                build = getattr(config, "build")  # noqa: B009 - config is typed object
                built_full: TesseraModel = build(
                    input_shape=shape, num_classes=classes, norm_layer=norm_layer, flat_input=flat
                )
                return built_full
        if spec is None:
            return entry.builder(
                input_shape=shape, num_classes=classes, norm_layer=norm_layer, flat_input=flat
            )
        sliced = getattr(config, "sliced", None)
        if sliced is None:
            raise ValueError(
                f"model {model!r} has no sections, so it cannot be sliced as {name!r}; "
                "slice a preresnet or mobilenetv2 model"
            )
        built: TesseraModel = sliced(spec.width, spec.depths).build(
            input_shape=shape, num_classes=classes, norm_layer=norm_layer, flat_input=flat
        )
        return built


_REGISTRY = ModelRegistry(cross_family_sets=CROSS_FAMILY_SETS)
"""The zoo's registry, filled when the family modules are imported."""


def register_model(
    name: str,
    *,
    family: str,
    size_rank: int,
    description: str = "",
    config: object | None = None,
) -> Callable[[BuilderT], BuilderT]:
    """Return a decorator registering a builder in the zoo (:meth:`ModelRegistry.register`).

    The parameters, return value and errors are those of
    :meth:`ModelRegistry.register`; ``config`` is exposed as
    ``model_entry(name).config``.
    """
    return _REGISTRY.register(
        name, family=family, size_rank=size_rank, description=description, config=config
    )


class BuildableConfig(Protocol):
    """A frozen family config that builds its model (the table-driven families)."""

    def build(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        norm_layer: NormFactory,
        flat_input: FlatInput = "signal",
    ) -> TesseraModel:
        """Build the model this config describes."""
        ...


def register_variants(family: str, variants: Sequence[tuple[str, BuildableConfig, str]]) -> None:
    """Register a family's table of ``(name, config, description)`` by ascending size.

    Each variant's builder is its config's ``build``; its size rank is its place in
    the table, and the config is exposed as ``model_entry(name).config``.

    Raises
    ------
    ValueError
        If a name or ``(family, rank)`` is already registered.
    """
    for rank, (name, config, description) in enumerate(variants):

        def build(
            *,
            input_shape: tuple[int, ...],
            num_classes: int,
            norm_layer: NormFactory,
            flat_input: FlatInput = "signal",
            config: BuildableConfig = config,
        ) -> TesseraModel:
            return config.build(
                input_shape=input_shape,
                num_classes=num_classes,
                norm_layer=norm_layer,
                flat_input=flat_input,
            )

        register_model(name, family=family, size_rank=rank, description=description, config=config)(
            build
        )


def get_model(
    name: str,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    norm: str = "batch",
    block_step: bool = False,
    flat_input: FlatInput = "signal",
) -> TesseraModel:
    """Build a registered model by name.

    Parameters
    ----------
    name : str
        Model name, one of :func:`list_models`, or a slice ``"<model>@<tag>"`` of a
        sectioned one (:func:`models.spec.slice_name`).
    input_shape : Sequence[int]
        Shape of one sample without the batch dimension: ``(C, H, W)`` for images,
        ``(C, L)`` for signals or ``(L,)`` for flat vectors.
    num_classes : int
        Number of classes, at least 2.
    norm : str, optional
        Normalisation: ``"batch"`` (default), ``"static-batch"``, ``"group"`` or
        ``"none"``.
    block_step : bool, optional
        Give every residual block a learnable step size (NeFL); preresnet and
        mobilenetv2 only.
    flat_input : {"signal", "square"}, optional
        How a convolutional model reads a flat vector ``(L,)``: ``"signal"``
        (default) convolves it in 1-d as a one-channel signal ``(1, L)``
        (``Conv1d``, ``BatchNorm1d``, 1-d pooling); ``"square"`` zero-pads it to
        ``ceil(sqrt(L))**2`` values and convolves a one-channel square image in 2-d.
        Images ``(C, H, W)`` are always 2-d and signals ``(C, L)`` always 1-d
        (``"square"`` is refused for them); the ``mlp`` family ignores it.

    Returns
    -------
    TesseraModel
        A freshly initialised model.

    Raises
    ------
    ValueError
        If the name, input shape, number of classes, norm or ``flat_input`` is
        invalid.
    """
    return _REGISTRY.build(
        name,
        input_shape=input_shape,
        num_classes=num_classes,
        norm=norm,
        block_step=block_step,
        flat_input=flat_input,
    )


def list_models(family: str | None = None) -> list[str]:
    """Return registered model names, ordered by family then ascending size rank.

    ``list_models("mixed")`` (:data:`MIXED_FAMILY`) returns the cross-family set
    :data:`MIXED_MEMBERS`, one model per family, ordered by ascending
    multiply-accumulates on a one-channel 8x8 input (:func:`models.base.count_macs`;
    ties by parameter count): each member keeps its own family and size rank. With no
    ``family``, every registered model is listed once.

    Parameters
    ----------
    family : str or None, optional
        Restrict to this family or cross-family set; all families when None.

    Returns
    -------
    list[str]
        Model names.

    Raises
    ------
    ValueError
        If ``family`` is neither a registered family nor a cross-family set.
    """
    return _REGISTRY.names(family)


def list_families() -> list[str]:
    """Return the registered model families and ``"mixed"``, sorted alphabetically.

    Returns
    -------
    list[str]
        Family names.
    """
    return _REGISTRY.families()


def model_entry(name: str) -> ModelEntry:
    """Return the registry entry of a model.

    Parameters
    ----------
    name : str
        Model name.

    Returns
    -------
    ModelEntry
        Its entry: family, size rank, builder, description, config.

    Raises
    ------
    ValueError
        If no model is registered under ``name``.
    """
    return _REGISTRY.entry(name)
