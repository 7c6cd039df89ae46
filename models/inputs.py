"""What a model reads: input shapes, their validation, and the adapter of the conv families.

``input_shape`` never includes the batch dimension. Three input kinds are accepted:

* images ``(C, H, W)``, e.g. ``(1, 8, 8)`` for sklearn digits, ``(3, 32, 32)``;
* multi-channel signals ``(C, L)``, e.g. ``(3, 128)`` for a three-axis sensor stream;
* flat vectors ``(L,)``, e.g. ``(40,)`` for a one-channel signal or ``(20,)`` for
  tabular data.

Convolutional families see their input through :class:`InputAdapter`, which decides
the *form* of the model (:data:`FlatInput`, keyword ``flat_input`` of
:func:`models.get_model`):

* an image is convolved in 2-d, whatever ``flat_input`` says;
* a signal ``(C, L)`` is convolved in 1-d along ``L`` (``Conv1d``, ``BatchNorm1d``,
  1-d pooling), whatever ``flat_input`` says, except that ``"square"`` is refused;
* a flat vector ``(L,)`` is, with ``flat_input="signal"`` (the default), a
  one-channel signal ``(1, L)`` convolved in 1-d, so a kernel sees neighbouring
  entries; with ``flat_input="square"`` it is zero-padded from ``L`` to ``s * s``
  values, ``s = ceil(sqrt(L))``, and reshaped to a one-channel square image
  ``(1, s, s)`` convolved in 2-d (the only form before 1-d models existed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral
from typing import Final, Literal, get_args

import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import Tensor, nn

from models.layers import SpatialLayers, spatial_layers

__all__ = [
    "FLAT_INPUTS",
    "FlatInput",
    "InputAdapter",
    "InputForm",
    "check_batch_shape",
    "image_shape",
    "validate_flat_input",
    "validate_input_shape",
    "validate_num_classes",
]


FlatInput = Literal["signal", "square"]
"""How a convolutional model reads a flat vector ``(L,)`` (module docstring)."""

FLAT_INPUTS: Final[tuple[FlatInput, ...]] = get_args(FlatInput)
"""The valid values of ``flat_input``: ``("signal", "square")``."""

InputForm = Literal["image", "signal", "square"]
"""What a convolutional body convolves: an image, a 1-d signal, a reshaped square."""


def validate_input_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """Check an input shape and return it as a tuple of ints.

    Parameters
    ----------
    input_shape : Sequence[int]
        Shape of one sample, without the batch dimension: ``(C, H, W)`` for images,
        ``(C, L)`` for multi-channel signals or ``(L,)`` for flat vectors.

    Returns
    -------
    tuple[int, ...]
        The same shape as a tuple of Python ints.

    Raises
    ------
    ValueError
        If the shape does not have 1, 2 or 3 entries, or an entry is not a positive
        int.
    """
    shape = tuple(input_shape)
    if len(shape) not in (1, 2, 3):
        raise ValueError(
            f"input_shape must be (C, H, W) for images, (C, L) for signals or (L,) for "
            f"flat vectors, without the batch dimension; got {input_shape!r} with "
            f"{len(shape)} entries."
        )
    if not all(isinstance(d, Integral) and not isinstance(d, bool) for d in shape):
        raise ValueError(
            f"input_shape entries must be ints, got {input_shape!r}; pass e.g. (1, 8, 8) or (64,)."
        )
    if any(int(d) < 1 for d in shape):
        raise ValueError(
            f"input_shape entries must be positive, got {input_shape!r}; "
            f"pass e.g. (1, 8, 8) or (64,)."
        )
    return tuple(int(d) for d in shape)


def validate_num_classes(num_classes: int) -> int:
    """Check a number of classes.

    Parameters
    ----------
    num_classes : int
        Number of output classes.

    Returns
    -------
    int
        ``num_classes`` as a Python int.

    Raises
    ------
    ValueError
        If ``num_classes`` is not an int of at least 2.
    """
    if not isinstance(num_classes, Integral) or isinstance(num_classes, bool):
        raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}.")
    if num_classes < 2:
        raise ValueError(
            f"num_classes must be >= 2 (a classifier needs at least two classes), "
            f"got {num_classes}."
        )
    return int(num_classes)


def validate_flat_input(flat_input: object, input_shape: Sequence[int]) -> FlatInput:
    """Check a ``flat_input`` value against the input shape it will be used with.

    Parameters
    ----------
    flat_input : object
        ``"signal"`` or ``"square"`` (see the module docstring).
    input_shape : Sequence[int]
        Shape of one sample (already valid, see :func:`validate_input_shape`).

    Returns
    -------
    FlatInput
        ``flat_input``, typed.

    Raises
    ------
    ValueError
        If ``flat_input`` is neither value, or is ``"square"`` for a ``(C, L)`` signal
        (only a flat vector can be reshaped to a square).
    """
    if not isinstance(flat_input, str) or flat_input not in FLAT_INPUTS:
        raise ValueError(
            f"flat_input must be 'signal' (convolve a flat vector (L,) in 1-d along L) or "
            f"'square' (zero-pad it and reshape it to a square image), got {flat_input!r}; "
            f"pass flat_input='signal' or flat_input='square' (run-config 'flat-input')."
        )
    shape = tuple(input_shape)
    if flat_input == "square" and len(shape) == 2:
        raise ValueError(
            f"flat_input='square' reshapes a flat vector (L,) into a square image, but "
            f"input_shape {shape} is a (C, L) signal of {shape[0]} channels, which is "
            f"always convolved in 1-d along L; drop flat_input='square', or give the data "
            f"as flat vectors of shape ({math.prod(shape)},) to reshape them."
        )
    return "signal" if flat_input == "signal" else "square"


def image_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    """Return the ``(C, H, W)`` image a 2-d convolutional model sees for an input shape.

    Parameters
    ----------
    input_shape : Sequence[int]
        ``(C, H, W)`` for images or ``(L,)`` for flat vectors read as a square
        (``flat_input="square"``).

    Returns
    -------
    tuple[int, int, int]
        ``input_shape`` itself for images, ``(1, s, s)`` with ``s = ceil(sqrt(L))``
        for flat vectors.

    Raises
    ------
    ValueError
        If ``input_shape`` is a ``(C, L)`` signal, which has no image form.
    """
    shape = validate_input_shape(input_shape)
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    if len(shape) == 2:
        raise ValueError(
            f"input_shape {shape} is a (C, L) signal, which has no image form; build the "
            f"model for it as it is (1-d convolutions)."
        )
    side = math.isqrt(shape[0] - 1) + 1
    return 1, side, side


def check_batch_shape(x: Tensor, input_shape: tuple[int, ...]) -> None:
    """Check that ``x`` is a batch of samples of shape ``input_shape``.

    Parameters
    ----------
    x : Tensor
        Batch whose first dimension is the batch dimension.
    input_shape : tuple[int, ...]
        Expected shape of one sample.

    Raises
    ------
    ValueError
        If ``x.shape[1:]`` differs from ``input_shape``.
    """
    if tuple(x.shape[1:]) != input_shape or x.dim() != len(input_shape) + 1:
        raise ValueError(
            f"Model was built for input_shape {input_shape} (batch dimension "
            f"excluded) but got a tensor of shape {tuple(x.shape)}; pass a batch of "
            f"shape (N, {', '.join(map(str, input_shape))}) or rebuild the model "
            f"with the input_shape of your data."
        )


class InputAdapter(nn.Module):
    """Turn a batch of inputs into what a convolutional body convolves.

    The form (:attr:`form`) follows from the input shape and ``flat_input`` (module
    docstring): images pass through unchanged (``"image"``, 2-d); ``(C, L)``
    signals pass through unchanged and flat vectors ``(L,)`` gain a channel
    dimension (``"signal"``, 1-d); with ``flat_input="square"`` flat vectors are
    zero-padded to ``s * s`` values, ``s = ceil(sqrt(L))``, and reshaped to
    one-channel ``s x s`` images (``"square"``, 2-d). The batch is checked against
    ``input_shape`` so that a mismatch fails with a readable message instead of deep
    inside a convolution.

    Parameters
    ----------
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)``, ``(C, L)`` or ``(L,)``.
    flat_input : FlatInput, optional
        ``"signal"`` (default) or ``"square"``; see :func:`validate_flat_input`.

    Attributes
    ----------
    form : InputForm
        ``"image"``, ``"signal"`` or ``"square"``.
    output_shape : tuple[int, ...]
        Shape of one adapted sample: ``(C, H, W)`` in 2-d, ``(C, L)`` in 1-d.
    ndim : int
        Spatial dimensionality of the convolutions that follow: 1 or 2.
    layers : SpatialLayers
        The layer types of that dimensionality, for the body to build with.
    """

    def __init__(self, *, input_shape: Sequence[int], flat_input: FlatInput = "signal") -> None:
        super().__init__()
        self.input_shape = validate_input_shape(input_shape)
        self.flat_input = validate_flat_input(flat_input, self.input_shape)
        self.form: InputForm
        self.output_shape: tuple[int, ...]
        if len(self.input_shape) == 3:
            self.form, self.output_shape = "image", self.input_shape
        elif len(self.input_shape) == 2:
            self.form, self.output_shape = "signal", self.input_shape
        elif self.flat_input == "signal":
            self.form, self.output_shape = "signal", (1, self.input_shape[0])
        else:
            self.form, self.output_shape = "square", image_shape(self.input_shape)

    @property
    def ndim(self) -> int:
        """Spatial dimensionality of the adapted batch: 1 for signals, 2 for images."""
        return len(self.output_shape) - 1

    @property
    def layers(self) -> SpatialLayers:
        """Convolution, pooling and norm types of the model's form (1-d or 2-d)."""
        return spatial_layers(self.ndim)

    def forward(self, x: Tensor) -> Tensor:
        """Return ``x`` in the model's form.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Batch of shape ``(N, *output_shape)``.
        """
        check_batch_shape(x, self.input_shape)
        if self.output_shape == self.input_shape:
            return x
        if self.form == "signal":
            return x.unsqueeze(1)
        _, height, width = self.output_shape
        padding = height * width - self.input_shape[0]
        if padding:
            x = F.pad(x, (0, padding))
        return x.reshape(x.shape[0], *self.output_shape)

    def extra_repr(self) -> str:
        """Describe the adaptation in the module's ``repr``."""
        return (
            f"input_shape={self.input_shape}, form={self.form!r}, output_shape={self.output_shape}"
        )
