"""Sub-models of a sectioned family: any width x depth slice of a global config.

A *sectioned* family (``preresnet``, ``mobilenetv2``) names its residual blocks
``sections.{s}.{b}.<param>``: block ``b`` of section ``s`` (a run of blocks with
the same output channels). Its frozen config (:class:`SectionedConfig`) is the
architecture as data, and slicing it is a pure function of the config and a
:class:`~models.spec.SubModelSpec`:

- **depth**: section ``s`` keeps its first ``spec.depths[s]`` blocks;
- **width**: every internal channel count ``c`` of the global model becomes
  ``ceil(spec.width * c)`` (:func:`models.layers.slice_channels`), with no
  ``make_divisible`` rounding, so the slice's parameters are exactly the channel
  prefixes :func:`strategies.submodel.extract` cuts out of the global state dict.
  The stem keeps the data's channels and the head keeps every class.

A block's structure (projection shortcut, residual connection, expansion) is the
global block's, whatever the slice's channel counts. Where a section's first block
differs from the others (stride, input channels, shortcut), grafting a one-block
section cannot restore it, so such families keep at least two blocks per section
(:attr:`SectionedConfig.min_section_depth`, :attr:`Layout.min_depth`).

:func:`build_submodel` builds a slice, :func:`family_layout` returns the
:class:`~models.spec.Layout` that extraction and grafting need.
Both take a registered model name (its entry's config is the global model), a
family name (its largest registered model) or a config. The sub-model maths lives
in :mod:`strategies.submodel`, heavy to import, so it is imported when these
functions are called, not when :mod:`models` is.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Final, TypeVar

from models.base import FamilyConfig, TesseraModel
from models.inputs import (
    FlatInput,
    validate_flat_input,
    validate_input_shape,
    validate_num_classes,
)
from models.norm import get_norm
from models.registry import list_models, model_entry
from models.spec import Layout, SubModelSpec

__all__ = [
    "HEAD_KEYS",
    "SECTIONS_PREFIX",
    "SectionedConfig",
    "build_submodel",
    "check_slice",
    "family_layout",
    "full_spec",
    "global_config",
]

SECTIONS_PREFIX: Final = "sections"
"""Attribute (and state-dict prefix) holding a sectioned model's blocks."""

HEAD_KEYS: Final = ("head.weight", "head.bias")
"""The classifier's entries, which keep every class (every model's head is ``head``)."""


SectionedT = TypeVar("SectionedT", bound="SectionedConfig")


class SectionedConfig(FamilyConfig):
    """Base of a frozen family config whose blocks are ``sections.{s}.{b}``, sliceable by spec.

    A subclass is a frozen dataclass with a ``slice_width`` field (1 for a global
    model) that tells its section depths, minimum section depth and stem key, and
    applies a checked slice in :meth:`with_slice`.
    """

    slice_width: float
    """Width ratio of this config relative to its global model, 1 for the global."""

    @property
    @abstractmethod
    def section_depths(self) -> tuple[int, ...]:
        """Blocks in each section."""

    @property
    @abstractmethod
    def min_section_depth(self) -> int:
        """Fewest blocks a slice keeps per section: 2 if a first block is special."""

    @property
    @abstractmethod
    def stem_key(self) -> str:
        """State-dict key of the first layer's weight (it keeps the data's channels)."""

    def sliced(self: SectionedT, width: float, depths: Sequence[int]) -> SectionedT:
        """Return the config of a sub-model of this global model.

        Parameters
        ----------
        width : float
            Share of every channel count kept, in ``(0, 1]``.
        depths : Sequence[int]
            Blocks kept per section (the first ones), at least
            :attr:`min_section_depth` (or the section's depth if smaller).

        Returns
        -------
        SectionedConfig
            The slice: ``depths`` blocks per section, ``slice_width=width``.

        Raises
        ------
        ValueError
            If this config is already a slice or the slice does not fit it.
        """
        checked_width, kept = check_slice(self, width, depths)
        return self.with_slice(checked_width, kept)

    @abstractmethod
    def with_slice(self: SectionedT, width: float, depths: tuple[int, ...]) -> SectionedT:
        """Return this config with ``depths`` blocks per section and ``slice_width=width``.

        Parameters
        ----------
        width : float
            Width ratio, already checked.
        depths : tuple[int, ...]
            Blocks per section, already checked.

        Returns
        -------
        SectionedConfig
            The sliced config.
        """


def check_slice(
    config: SectionedConfig, width: float, depths: Sequence[int]
) -> tuple[float, tuple[int, ...]]:
    """Validate a width x depth slice of a global config; return it normalised.

    Parameters
    ----------
    config : SectionedConfig
        The global model's config (``slice_width == 1``).
    width : float
        Width ratio in ``(0, 1]``.
    depths : Sequence[int]
        Blocks kept per section, between ``min(min_section_depth, D_s)`` and the
        section's global depth ``D_s``.

    Returns
    -------
    tuple[float, tuple[int, ...]]
        The width as a float and the depths as a tuple of ints.

    Raises
    ------
    ValueError
        If the config is already a slice, the width is out of range, or the depths
        do not fit the global sections.
    """
    if config.slice_width != 1.0:
        raise ValueError(
            f"{type(config).__name__} is already a slice (slice_width="
            f"{config.slice_width}); slice the global model's config instead"
        )
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 < width <= 1:
        raise ValueError(f"slice width must be a number in (0, 1], got {width!r}")
    kept = tuple(depths)
    total = config.section_depths
    if len(kept) != len(total):
        raise ValueError(
            f"slice keeps blocks of {len(kept)} sections {kept} but the global model has "
            f"{len(total)} sections {total}; give one count per section"
        )
    for s, (d, n) in enumerate(zip(kept, total, strict=True)):
        least = min(config.min_section_depth, n)
        if isinstance(d, bool) or not isinstance(d, int) or not least <= d <= n:
            raise ValueError(
                f"slice keeps {d!r} blocks of section {s}; keep between {least} and {n} "
                f"(the first block of a section differs from the others, so grafting "
                f"needs at least {config.min_section_depth})"
            )
    return float(width), kept


def global_config(model: str | SectionedConfig) -> SectionedConfig:
    """Return the global config behind a model name, a family name or a config.

    Parameters
    ----------
    model : str or SectionedConfig
        A registered model name (its entry's config), a family name (the config of
        its largest registered model), or a config (returned as it is).

    Returns
    -------
    SectionedConfig
        The global model's config.

    Raises
    ------
    ValueError
        If the name is unknown, or its model is not sectioned (it cannot be sliced).
    """
    if isinstance(model, SectionedConfig):
        return model
    names = [model]
    if model not in list_models():
        try:
            names = list_models(model)
        except ValueError:
            raise ValueError(
                f"Unknown model or family {model!r}. Models: {', '.join(list_models())}."
            ) from None
    config = model_entry(names[-1]).config
    if not isinstance(config, SectionedConfig):
        sectioned = [n for n in list_models() if isinstance(model_entry(n).config, SectionedConfig)]
        raise ValueError(
            f"Model {names[-1]!r} has no sections, so it cannot be sliced; use one of "
            f"{', '.join(sectioned)} (or their families)."
        )
    return config


def full_spec(model: str | SectionedConfig) -> SubModelSpec:
    """Return the spec of the global model itself: width 1, every block.

    Parameters
    ----------
    model : str or SectionedConfig
        A model name, family name or config (see :func:`global_config`).

    Returns
    -------
    SubModelSpec
        ``SubModelSpec(1.0, section_depths)``.
    """
    return SubModelSpec.full(global_config(model).section_depths)


def family_layout(model: str | SectionedConfig) -> Layout:
    """Return how a sectioned model's state dict is laid out for extraction and grafting.

    Parameters
    ----------
    model : str or SectionedConfig
        A model name, family name or config (see :func:`global_config`).

    Returns
    -------
    Layout
        Prefix ``"sections"``, the stem's weight as the entry keeping its inputs,
        the head's weight and bias as the entries keeping their outputs, and the
        family's minimum section depth.
    """
    config = global_config(model)
    return Layout(
        prefix=SECTIONS_PREFIX,
        keep_inputs=frozenset({config.stem_key}),
        keep_outputs=frozenset(HEAD_KEYS),
        min_depth=config.min_section_depth,
    )


def build_submodel(
    model: str | SectionedConfig,
    spec: SubModelSpec,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    norm: str = "batch",
    flat_input: FlatInput = "signal",
) -> TesseraModel:
    """Build the sub-model ``spec`` of a global model (module docstring).

    Parameters
    ----------
    model : str or SectionedConfig
        The global model: a registered name, a family name (its largest model) or a
        config.
    spec : SubModelSpec
        Width ratio and blocks kept per section; ``full_spec(model)`` builds the
        global model itself.
    input_shape : Sequence[int]
        Shape of one sample without the batch dimension: ``(C, H, W)``, ``(C, L)``
        or ``(L,)``.
    num_classes : int
        Number of classes, at least 2.
    norm : str, optional
        Normalisation name, see :func:`models.norm.get_norm`; ``"batch"`` by default.
    flat_input : FlatInput, optional
        How a flat vector ``(L,)`` is read: ``"signal"`` (default, the 1-d form) or
        ``"square"``; see :func:`models.get_model`. A 1-d slice has the same
        state-dict keys as the 2-d one, with 1-d kernels ``(out, in, k)``.

    Returns
    -------
    TesseraModel
        A freshly initialised sub-model whose state-dict keys are a subset of the
        global model's and whose entries have the shapes ``extract`` gives.

    Raises
    ------
    ValueError
        If the model cannot be sliced, the spec does not fit it, or the input shape,
        number of classes, norm or ``flat_input`` is invalid.
    """
    config = global_config(model).sliced(spec.width, spec.depths)
    shape = validate_input_shape(input_shape)
    return config.build(
        input_shape=shape,
        num_classes=validate_num_classes(num_classes),
        norm_layer=get_norm(norm),
        flat_input=validate_flat_input(flat_input, shape),
    )
