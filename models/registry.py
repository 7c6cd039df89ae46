"""Registry of the model zoo, in the style of torchvision's ``models/_api.py``.

A model is registered as a frozen config that builds it (:class:`~models.base.ModelConfig`):
each family module registers its table of ``(name, config, description)`` with
:func:`register_family`, the size rank of a model being its place in the table.
Importing :mod:`models` imports every family module, so the registry is complete once
``models`` is imported. Models are then built by name with :func:`get_model`.

A config builds its model from keyword-only ``input_shape``, ``num_classes``,
``norm_layer`` and ``flat_input`` (:meth:`~models.base.ModelConfig.build`).
``flat_input`` (:data:`~models.inputs.FlatInput`) says how a convolutional model reads a
flat vector ``(L,)``: as a one-channel signal convolved in 1-d (``"signal"``, the
default) or reshaped to a square image (``"square"``); see :mod:`models.inputs`.

Besides the families of the registered models, the registry knows *cross-family
sets* (:mod:`models.cross_family`): a name such as ``"mixed"`` that :func:`list_models`
and :func:`list_families` treat like a family, standing for a fixed set of registered
models of different families, listed by ascending measured cost. It is an alias, not
a registration: every member keeps its own family and size rank, and
``list_models()`` lists it once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TypeAlias

from models.base import ModelConfig, TesseraModel
from models.cross_family import CROSS_FAMILY_SETS, measured_cost
from models.inputs import (
    FlatInput,
    validate_flat_input,
    validate_input_shape,
    validate_num_classes,
)
from models.norm import get_norm
from models.spec import ModelRef

__all__ = [
    "ModelEntry",
    "ModelRegistry",
    "Variant",
    "get_model",
    "list_families",
    "list_models",
    "model_entry",
    "register_family",
]

Variant: TypeAlias = tuple[str, ModelConfig, str]
"""One row of a family's table: ``(name, config, description)``."""


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
    config : ModelConfig
        The frozen architecture that builds the model (e.g. a
        :class:`~models.preresnet.PreResNetConfig`). Sectioned configs can be sliced
        (:mod:`models.slicing`).
    description : str
        One-line human-readable description.
    """

    name: str
    family: str
    size_rank: int
    config: ModelConfig
    description: str = ""


class ModelRegistry:
    """A set of named model configs that refuses duplicates.

    The package keeps one default instance, used by the module-level functions
    (:func:`register_family`, :func:`get_model`, ...); separate instances are useful
    in tests.

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
        config: ModelConfig,
        *,
        family: str,
        size_rank: int,
        description: str = "",
    ) -> ModelEntry:
        """Register ``config`` under ``name``.

        Parameters
        ----------
        name : str
            Unique model name.
        config : ModelConfig
            The frozen config that builds the model, exposed as ``ModelEntry.config``.
        family : str
            Architecture family.
        size_rank : int
            Rank by size within the family, 0 for the smallest; unique per family.
        description : str, optional
            One-line description.

        Returns
        -------
        ModelEntry
            The new entry.

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
        if name in self._entries:
            raise ValueError(f"A model named {name!r} is already registered; pick another name.")
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
            config=config,
            description=description,
        )
        return self._entries[name]

    def register_family(self, family: str, variants: Sequence[Variant]) -> None:
        """Register a family's table of ``(name, config, description)`` by ascending size.

        Each variant's size rank is its place in the table.

        Parameters
        ----------
        family : str
            Architecture family.
        variants : Sequence[Variant]
            The family's models, smallest first.

        Raises
        ------
        ValueError
            As :meth:`register`: a name or ``(family, rank)`` already registered, an
            empty name or family, or a family named like a cross-family set.
        """
        for rank, (name, config, description) in enumerate(variants):
            self.register(name, config, family=family, size_rank=rank, description=description)

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
        :data:`~models.cross_family.COST_INPUT_SHAPE` input
        (:func:`models.cost.count_macs`), then the parameter count, then the name.
        Measuring builds each member with batch norm on the meta device (shapes
        only), without touching torch's random state. With no ``family`` every
        registered model is listed once; the sets add no names.

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
            macs, parameters = measured_cost(
                lambda shape: self.build(name, input_shape=shape, num_classes=2)
            )
            return macs, parameters, name

        return sorted(members, key=cost)

    def build(
        self,
        name: str | ModelRef,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        norm: str = "batch",
        block_step: bool = False,
        flat_input: FlatInput = "signal",
    ) -> TesseraModel:
        """Build the model registered under ``name``, or a slice of a sectioned one.

        The parameters, return value and errors are those of :func:`get_model`: the
        inputs are validated, then the entry's config (with ``block_step`` set, then
        sliced, when asked) builds the model.
        """
        ref = name if isinstance(name, ModelRef) else ModelRef.parse(name)
        model, spec = ref.model, ref.spec
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
            config = replace(config, block_step=True)
        if spec is not None:
            sliced = getattr(config, "sliced", None)
            if sliced is None:
                raise ValueError(
                    f"model {model!r} has no sections, so it cannot be sliced as {ref.name!r}; "
                    "slice a preresnet or mobilenetv2 model"
                )
            config = sliced(spec.width, spec.depths)
        return config.build(
            input_shape=shape, num_classes=classes, norm_layer=norm_layer, flat_input=flat
        )


_REGISTRY = ModelRegistry(cross_family_sets=CROSS_FAMILY_SETS)
"""The zoo's registry, filled when the family modules are imported."""


def register_family(family: str, variants: Sequence[Variant]) -> None:
    """Register a family's table of ``(name, config, description)`` in the zoo.

    The size rank of each model is its place in the table, smallest first; its config
    is exposed as ``model_entry(name).config`` (:meth:`ModelRegistry.register_family`).

    Parameters
    ----------
    family : str
        Architecture family.
    variants : Sequence[Variant]
        The family's models, smallest first.

    Raises
    ------
    ValueError
        If a name or ``(family, rank)`` is already registered.
    """
    _REGISTRY.register_family(family, variants)


def get_model(
    name: str | ModelRef,
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
    name : str or ModelRef
        The model: a :class:`~models.spec.ModelRef` (a registered model, or a slice
        of a sectioned one), or its printed name, one of :func:`list_models` or
        ``"<model>@<tag>"`` (:attr:`models.spec.ModelRef.name`).
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
        invalid, or ``block_step`` is asked of a model without step sizes.
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

    ``list_models("mixed")`` (:data:`~models.cross_family.MIXED_FAMILY`) returns the
    cross-family set :data:`~models.cross_family.MIXED_MEMBERS`, one model per family,
    ordered by ascending multiply-accumulates on a one-channel 8x8 input
    (:func:`models.cost.count_macs`; ties by parameter count): each member keeps its
    own family and size rank. With no ``family``, every registered model is listed
    once.

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
        Its entry: family, size rank, config, description.

    Raises
    ------
    ValueError
        If no model is registered under ``name``.
    """
    return _REGISTRY.entry(name)
