"""How a family's state dict is laid out, and which slice of it a sub-model keeps.

A family with depth flexibility names the parameters of its residual blocks
``{prefix}.{s}.{b}.<param>``: block ``b`` (0-based) of section ``s`` (a run of
blocks with the same channel counts, FedFA's "section"). Keys outside the prefix
(stem, final convolution, classifier) belong to no section and are never dropped.

Width is a channel prefix. Which dimensions of an entry are channels is read from
its rank, as PyTorch lays parameters out:

- ``ndim >= 2`` (convolution ``(out, in, kh, kw)``, linear ``(out, in)``):
  dimension 0 is the output channels, dimension 1 the input channels, the rest
  (kernel) is kept whole;
- ``ndim == 1`` (bias, batch-norm weight, bias and running statistics): the output
  channels;
- ``ndim == 0`` (batch-norm step counter): kept.

Two roles need the layout's word: the first layer keeps all its inputs (the data's
channels, :attr:`Layout.keep_inputs`) and the classifier keeps all its outputs (the
classes, :attr:`Layout.keep_outputs`, its weight and its bias). A depthwise
convolution (``groups == channels``) has weight ``(channels, 1, kh, kw)``: its
input dimension of size 1 stays 1 under :func:`sub_channels` (a prefix of at least
one channel), so it needs no role.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np


class SubModelError(ValueError):
    """A state dict, layout or spec does not describe a valid slice of a global model."""


@dataclass(frozen=True)
class SubModelSpec:
    """One sub-model of a global model: its width ratio and the blocks kept per section.

    Attributes
    ----------
    width : float
        Share of every layer's channels kept, in ``(0, 1]`` (a channel prefix of
        ``sub_channels(n, width)`` of ``n``).
    depths : tuple[int, ...]
        Blocks kept in each section (the first ones), each at least 1; empty for a
        family without sections (width only).
    """

    width: float
    depths: tuple[int, ...]

    def __post_init__(self) -> None:
        """Validate the width and the depths."""
        width = self.width
        if (
            isinstance(width, bool)
            or not isinstance(width, (int, float))
            or not math.isfinite(width)
            or not 0 < width <= 1
        ):
            raise ValueError(
                f"SubModelSpec.width must be a number in (0, 1], got {width!r}; give the "
                f"share of each layer's channels to keep, e.g. 0.5 (1.0 for the full width)"
            )
        object.__setattr__(self, "width", float(width))
        depths = self.depths
        if isinstance(depths, (str, bytes)) or not isinstance(depths, Iterable):
            raise ValueError(
                f"SubModelSpec.depths must be a tuple of block counts, one per section, "
                f"got {depths!r}"
            )
        depths = tuple(depths)
        for s, d in enumerate(depths):
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
                raise ValueError(
                    f"SubModelSpec.depths[{s}] is {d!r}; every section keeps a whole "
                    f"number of blocks, at least 1 (got depths {depths!r})"
                )
        object.__setattr__(self, "depths", tuple(int(d) for d in depths))

    @classmethod
    def full(cls, depths: Iterable[int]) -> SubModelSpec:
        """Return the spec of the global model itself (width 1, every block)."""
        return cls(width=1.0, depths=tuple(depths))

    @property
    def tag(self) -> str:
        """The spec as text, ``w<width>-d<d0>.<d1>...``, e.g. ``w0.5-d2.2.3.2``."""
        return f"w{self.width:g}-d" + ".".join(str(d) for d in self.depths)

    @classmethod
    def from_tag(cls, tag: str) -> SubModelSpec:
        """Parse :attr:`tag`.

        Raises
        ------
        ValueError
            If ``tag`` is not ``w<width>-d<d0>.<d1>...`` with a valid width and depths.
        """
        match = re.fullmatch(r"w([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)-d([0-9]+(?:\.[0-9]+)*)", tag)
        if match is None:
            raise ValueError(
                f"sub-model tag {tag!r} is not 'w<width>-d<blocks per section>', "
                f"e.g. 'w0.5-d2.2.3.2'"
            )
        return cls(float(match[1]), tuple(int(d) for d in match[2].split(".")))


SLICE_SEPARATOR = "@"
"""Separates a registered model's name from a sub-model tag in a printed name."""

MODEL_KEY = "model"
"""Message key of a :class:`ModelRef`'s registered model."""
SLICE_WIDTH_KEY = "slice-width"
"""Message key of a slice's width ratio (absent for a whole model)."""
SLICE_DEPTHS_KEY = "slice-depths"
"""Message key of a slice's blocks per section (absent for a whole model)."""


@dataclass(frozen=True)
class ModelRef:
    """A model the registry builds: a registered model, or a slice of a sectioned one.

    Code, messages and results carry the structure; :attr:`name` prints it for
    people (logs, tables, result keys), and :meth:`parse` reads a name a person
    typed (node-config ``arch``, the command line) back.

    Attributes
    ----------
    model : str
        The registered model (the global model of a slice).
    spec : SubModelSpec or None
        The slice of ``model``; ``None`` for the whole registered model.

    Examples
    --------
    >>> ModelRef("preresnet26_025", SubModelSpec(0.5, (3, 3, 2, 2))).name
    'preresnet26_025@w0.5-d3.3.2.2'
    >>> ModelRef.parse("cnn-3")
    ModelRef(model='cnn-3', spec=None)
    """

    model: str
    spec: SubModelSpec | None = None

    def __post_init__(self) -> None:
        """Validate the model name: non-empty, without the slice separator."""
        if not isinstance(self.model, str) or not self.model or SLICE_SEPARATOR in self.model:
            raise ValueError(
                f"ModelRef.model must be a registered model's name, got {self.model!r}; "
                f"give the slice as a SubModelSpec, not in the name"
            )

    @property
    def name(self) -> str:
        """The printable name: ``model``, or ``model@w<width>-d<depths>`` for a slice."""
        return self.model if self.spec is None else f"{self.model}{SLICE_SEPARATOR}{self.spec.tag}"

    def __str__(self) -> str:
        """Return :attr:`name`."""
        return self.name

    @classmethod
    def parse(cls, name: str) -> ModelRef:
        """Read a printed :attr:`name` back (what a person typed).

        Raises
        ------
        ValueError
            If the part after ``@`` is not a valid :attr:`SubModelSpec.tag`.
        """
        model, sep, tag = str(name).partition(SLICE_SEPARATOR)
        return cls(model, SubModelSpec.from_tag(tag) if sep else None)

    def to_config(self) -> dict[str, str | float | list[int]]:
        """Return the reference as message values (a Flower ``ConfigRecord``'s types).

        ``model`` always; ``slice-width`` and ``slice-depths`` for a slice.
        """
        out: dict[str, str | float | list[int]] = {MODEL_KEY: self.model}
        if self.spec is not None:
            out[SLICE_WIDTH_KEY] = self.spec.width
            out[SLICE_DEPTHS_KEY] = list(self.spec.depths)
        return out

    @classmethod
    def from_config(cls, values: Mapping[str, object], *, where: str) -> ModelRef:
        """Read :meth:`to_config`'s values from an untrusted message.

        Parameters
        ----------
        values : Mapping[str, object]
            The record holding the keys.
        where : str
            What the record is, for the error message (``"handshake profile"``).

        Raises
        ------
        ValueError
            Naming the key and the value: ``model`` missing or not a name, only one of
            the slice keys, or a width or depths that :class:`SubModelSpec` refuses.
        """
        model = values.get(MODEL_KEY)
        if not isinstance(model, str):
            raise ValueError(f"{where} has {MODEL_KEY}={model!r}; it must name a model")
        width, depths = values.get(SLICE_WIDTH_KEY), values.get(SLICE_DEPTHS_KEY)
        if width is None and depths is None:
            return cls(model)
        if width is None or depths is None:
            raise ValueError(
                f"{where} has {SLICE_WIDTH_KEY}={width!r} and {SLICE_DEPTHS_KEY}={depths!r}; "
                "a slice needs both, a whole model neither"
            )
        if isinstance(width, bool) or not isinstance(width, (int, float)):
            raise ValueError(f"{where} has {SLICE_WIDTH_KEY}={width!r}; it must be a number")
        if not isinstance(depths, (list, tuple)):
            raise ValueError(f"{where} has {SLICE_DEPTHS_KEY}={depths!r}; it must be a list")
        blocks = [d for d in depths if isinstance(d, int) and not isinstance(d, bool)]
        if len(blocks) != len(depths):
            raise ValueError(
                f"{where} has {SLICE_DEPTHS_KEY}={list(depths)!r}; it must list whole block counts"
            )
        return cls(model, SubModelSpec(float(width), tuple(blocks)))

    def to_record(self) -> dict[str, object]:
        """Return the reference for a results file: model, and the slice or ``None``."""
        spec = (
            None
            if self.spec is None
            else {"width": self.spec.width, "depths": list(self.spec.depths)}
        )
        return {"model": self.model, "slice": spec}


def _as_keys(value: Iterable[str], name: str) -> frozenset[str]:
    if isinstance(value, str):
        raise ValueError(
            f"Layout.{name} must be a collection of state-dict keys, got the string "
            f"{value!r}; wrap it, e.g. frozenset({{{value!r}}})"
        )
    keys = frozenset(value)
    bad = [k for k in keys if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"Layout.{name} holds {bad!r}; give non-empty state-dict keys")
    return keys


@dataclass(frozen=True)
class Layout:
    """How one family's state dict is named and which entries keep whole channels.

    Attributes
    ----------
    prefix : str
        Keys ``{prefix}.{s}.{b}.<param>`` are block ``b`` of section ``s``.
    keep_inputs : frozenset[str]
        Entries whose input dimension (1) is never sliced: the first layer's weight.
    keep_outputs : frozenset[str]
        Entries whose output dimension (0) is never sliced: the classifier's weight
        and bias.
    min_depth : int
        Fewest blocks a sub-model may keep in a section (capped at the section's
        global depth). Grafting repeats a section's last block, which yields the
        global model's shapes only if that block is interchangeable with the ones
        it stands in for: where a section's first block differs from the others
        (a projection shortcut, other input channels, as in Pre-ResNet and
        MobileNetV2), set this to 2.
    """

    prefix: str = "sections"
    keep_inputs: frozenset[str] = field(default_factory=frozenset)
    keep_outputs: frozenset[str] = field(default_factory=frozenset)
    min_depth: int = 1

    def __post_init__(self) -> None:
        """Validate the prefix and minimum depth; store the key sets as frozensets."""
        if not isinstance(self.prefix, str) or not re.fullmatch(r"[A-Za-z_][\w.]*", self.prefix):
            raise ValueError(
                f"Layout.prefix must be a module path such as 'sections', got {self.prefix!r}"
            )
        if self.prefix.endswith("."):
            raise ValueError(f"Layout.prefix {self.prefix!r} must not end with '.'; drop it")
        object.__setattr__(self, "keep_inputs", _as_keys(self.keep_inputs, "keep_inputs"))
        object.__setattr__(self, "keep_outputs", _as_keys(self.keep_outputs, "keep_outputs"))
        if isinstance(self.min_depth, bool) or not isinstance(self.min_depth, int):
            raise ValueError(f"Layout.min_depth must be an integer, got {self.min_depth!r}")
        if self.min_depth < 1:
            raise ValueError(f"Layout.min_depth must be at least 1, got {self.min_depth}")

    def parse(self, key: str) -> tuple[int, int, str] | None:
        """Return ``(section, block, rest)`` of a block entry, ``None`` for other keys."""
        head = self.prefix + "."
        if not key.startswith(head):
            return None
        match = re.fullmatch(r"(\d+)\.(\d+)\.(.+)", key[len(head) :])
        if match is None:
            raise SubModelError(
                f"key '{key}' is under '{self.prefix}' but not '{self.prefix}.<section>."
                f"<block>.<param>'; name block entries that way or change Layout.prefix"
            )
        return int(match[1]), int(match[2]), match[3]

    def key(self, section: int, block: int, rest: str) -> str:
        """Return the key of entry ``rest`` of block ``block`` of section ``section``."""
        return f"{self.prefix}.{section}.{block}.{rest}"


def section_depths(keys: Iterable[str], layout: Layout) -> tuple[int, ...]:
    """Return the number of blocks of each section present among ``keys``.

    Parameters
    ----------
    keys : Iterable[str]
        State-dict keys.
    layout : Layout
        Naming of the block entries.

    Returns
    -------
    tuple[int, ...]
        Blocks per section, ``()`` when no key is a block entry.

    Raises
    ------
    SubModelError
        If a section or a block is missing in between (sections ``0..S-1`` and, in
        each, blocks ``0..d-1`` must all be there).
    """
    blocks: dict[int, set[int]] = {}
    for key in keys:
        parsed = layout.parse(key)
        if parsed is not None:
            blocks.setdefault(parsed[0], set()).add(parsed[1])
    if not blocks:
        return ()
    sections = sorted(blocks)
    if sections != list(range(len(sections))):
        raise SubModelError(
            f"sections {sections} under '{layout.prefix}' are not numbered 0..{len(sections) - 1}"
        )
    depths = []
    for s in sections:
        present = sorted(blocks[s])
        if present != list(range(len(present))):
            raise SubModelError(
                f"section {s} has blocks {present}; a sub-model keeps a section's first "
                f"blocks 0..d-1 with none missing"
            )
        depths.append(len(present))
    return tuple(depths)


def sub_channels(channels: int, width: float) -> int:
    """Return the channels a width ratio keeps of ``channels``: ``ceil(width * channels)``.

    At least one channel is kept, and ``width * channels`` is rounded to 9 decimals
    first so that float error cannot add a channel (``0.3 * 10`` keeps 3, not 4).
    """
    if channels < 1:
        raise SubModelError(f"a layer with {channels} channels cannot be sliced")
    if not 0 < width <= 1:
        raise SubModelError(f"width ratio {width!r} is not in (0, 1]")
    return max(1, math.ceil(round(width * channels, 9)))


def sub_shape(key: str, shape: tuple[int, ...], width: float, layout: Layout) -> tuple[int, ...]:
    """Return the shape a width ratio keeps of the global entry ``key`` (module docstring)."""
    if len(shape) == 0:
        return ()
    dims = list(shape)
    if key not in layout.keep_outputs:
        dims[0] = sub_channels(shape[0], width)
    if len(shape) >= 2 and key not in layout.keep_inputs:
        dims[1] = sub_channels(shape[1], width)
    return tuple(dims)


def shapes_of(state: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Return the shape of every entry of a state dict."""
    return {key: tuple(value.shape) for key, value in state.items()}
