"""Common interface of every model in the zoo, and model-measuring helpers.

Every model is a :class:`TesseraModel`: a *body* (:meth:`TesseraModel.forward_features`)
that maps a batch of inputs to flat representations of size ``feature_dim``, and a
*head* (:meth:`TesseraModel.forward_head`), one linear layer mapping representations
to ``num_classes`` logits. Representation alignment (FedHeNN), feature/logit exchange
(Felo) and personalised heads all rely on this split, so it is part of the base class
rather than something probed for with ``hasattr``.

Inputs
------
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
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from numbers import Integral
from typing import Final, Literal, get_args

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from models.layers import SpatialLayers, spatial_layers

__all__ = [
    "FLAT_INPUTS",
    "FlatInput",
    "InputAdapter",
    "InputForm",
    "TesseraModel",
    "check_batch_shape",
    "count_activations",
    "count_macs",
    "count_parameters",
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


class TesseraModel(nn.Module, ABC):
    """Abstract base of every model in the zoo: a body and a linear head.

    Subclasses implement :meth:`forward_features` and assign ``self.head`` (an
    ``nn.Linear(feature_dim, num_classes)``); :meth:`forward` composes the two.

    Parameters
    ----------
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)``, ``(C, L)`` or ``(L,)``.
    feature_dim : int
        Size of the flat representation returned by :meth:`forward_features`.
    num_classes : int
        Number of output classes, at least 2.

    Attributes
    ----------
    input_shape : tuple[int, ...]
        Shape of one sample the model was built for.
    feature_dim : int
        Size of the representation returned by :meth:`forward_features`.
    num_classes : int
        Number of logits returned by :meth:`forward_head`.
    head : nn.Linear
        The classifier, mapping representations to logits.
    """

    input_shape: tuple[int, ...]
    feature_dim: int
    num_classes: int
    head: nn.Linear

    def __init__(self, *, input_shape: Sequence[int], feature_dim: int, num_classes: int) -> None:
        super().__init__()
        if feature_dim < 1:
            raise ValueError(f"feature_dim must be >= 1, got {feature_dim}.")
        self.input_shape = validate_input_shape(input_shape)
        self.feature_dim = int(feature_dim)
        self.num_classes = validate_num_classes(num_classes)

    @abstractmethod
    def forward_features(self, x: Tensor) -> Tensor:
        """Map a batch of inputs to flat representations.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Representations of shape ``(N, feature_dim)``.
        """

    def forward_head(self, z: Tensor) -> Tensor:
        """Map representations to logits.

        Parameters
        ----------
        z : Tensor
            Representations of shape ``(N, feature_dim)``.

        Returns
        -------
        Tensor
            Logits of shape ``(N, num_classes)``.
        """
        logits: Tensor = self.head(z)
        return logits

    def forward(self, x: Tensor) -> Tensor:
        """Return ``forward_head(forward_features(x))``.

        Parameters
        ----------
        x : Tensor
            Batch of shape ``(N, *input_shape)``.

        Returns
        -------
        Tensor
            Logits of shape ``(N, num_classes)``.
        """
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Linear:
        """Return the classifier head.

        Returns
        -------
        nn.Linear
            The linear layer mapping representations to logits.
        """
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head with a freshly initialised one for ``num_classes`` classes.

        Parameters
        ----------
        num_classes : int
            New number of classes, at least 2.
        """
        self.num_classes = validate_num_classes(num_classes)
        old = self.head
        self.head = nn.Linear(
            self.feature_dim,
            self.num_classes,
            device=old.weight.device,
            dtype=old.weight.dtype,
        )


def count_parameters(model: nn.Module) -> int:
    """Count the trainable parameters of a model.

    Parameters
    ----------
    model : nn.Module
        Any module.

    Returns
    -------
    int
        Number of elements of the parameters with ``requires_grad=True``.
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


_DUMMY_BATCH = 2
"""Batch size of the dummy forward pass used for counting.

Two samples rather than one: batch norm without running statistics (``static-batch``)
cannot normalise a single value per channel, which is what one sample gives at 1x1
spatial size. Every count is per sample, so the batch size does not change results.
"""


_Hook = Callable[[nn.Module, tuple[object, ...], object], None]


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode, restoring each one's own mode afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _dummy_forward(
    model: nn.Module,
    input_shape: Sequence[int],
    hooked: Sequence[nn.Module],
    hook: _Hook,
) -> None:
    """Run a no-grad dummy batch through ``model`` with ``hook`` on ``hooked``."""
    shape = tuple(input_shape)
    if not shape or not all(isinstance(d, Integral) and d >= 1 for d in shape):
        raise ValueError(
            f"input_shape must be a non-empty tuple of positive ints without the batch "
            f"dimension, e.g. (1, 8, 8) or (64,); got {input_shape!r}."
        )
    reference = next(iter(model.parameters()), None)
    device = reference.device if reference is not None else torch.device("cpu")
    dtype = reference.dtype if reference is not None else torch.float32
    x = torch.zeros((_DUMMY_BATCH, *shape), device=device, dtype=dtype)
    handles: list[RemovableHandle] = [m.register_forward_hook(hook) for m in hooked]
    try:
        with _eval_mode(model), torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()


def _per_sample_numel(output: object) -> int:
    """Count the elements per sample of a module output (tensor or tuple of them)."""
    if isinstance(output, Tensor):
        return output.numel() // _DUMMY_BATCH if output.dim() > 0 else 0
    if isinstance(output, (tuple, list)):
        return sum(_per_sample_numel(item) for item in output)
    return 0


def count_macs(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Count the multiply-accumulates of one forward pass of one sample.

    Forward hooks on every ``Conv1d``, ``Conv2d`` and ``Linear`` count, per sample,
    ``output elements * (in_channels / groups) * kernel size`` for convolutions and
    ``output elements * in_features`` for linear layers. Biases, normalisation,
    activations, pooling and resizing are not counted. The model's train/eval mode
    (of every submodule) is left as it was, and no running statistic is updated.

    Parameters
    ----------
    model : nn.Module
        The model to measure.
    input_shape : Sequence[int]
        Shape of one sample, without the batch dimension.

    Returns
    -------
    int
        Multiply-accumulates for one sample.
    """
    total = 0

    def hook(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
        nonlocal total
        out = _per_sample_numel(output)
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            kernel = math.prod(module.kernel_size)
            total += out * (module.in_channels // module.groups) * kernel
        elif isinstance(module, nn.Linear):
            total += out * module.in_features

    hooked = [m for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear))]
    _dummy_forward(model, input_shape, hooked, hook)
    return total


def count_activations(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Count the output elements of all leaf modules for one sample.

    An estimate of activation memory: every leaf module (one without children)
    except ``nn.Identity``, whose output aliases its input, contributes the number of
    elements it outputs per sample, once per call. Functional operations in a
    ``forward`` (additions, reshapes) are not counted.

    Parameters
    ----------
    model : nn.Module
        The model to measure.
    input_shape : Sequence[int]
        Shape of one sample, without the batch dimension.

    Returns
    -------
    int
        Number of activation elements for one sample.
    """
    total = 0

    def hook(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
        nonlocal total
        total += _per_sample_numel(output)

    hooked = [
        m
        for m in model.modules()
        if next(m.children(), None) is None and not isinstance(m, nn.Identity)
    ]
    _dummy_forward(model, input_shape, hooked, hook)
    return total
