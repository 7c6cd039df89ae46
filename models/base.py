"""Common interface of every model in the zoo, and model-measuring helpers.

Every model is a :class:`TesseraModel`: a *body* (:meth:`TesseraModel.forward_features`)
that maps a batch of inputs to flat representations of size ``feature_dim``, and a
*head* (:meth:`TesseraModel.forward_head`), one linear layer mapping representations
to ``num_classes`` logits. Representation alignment (FedHeNN), feature/logit exchange
(Felo) and personalised heads all rely on this split, so it is part of the base class
rather than something probed for with ``hasattr``.

Inputs
------
``input_shape`` never includes the batch dimension. Two input kinds are accepted:

* images ``(C, H, W)``, e.g. ``(1, 8, 8)`` for sklearn digits, ``(3, 32, 32)``;
* flat vectors ``(D,)``, e.g. ``(64,)`` or ``(20,)`` for tabular data.

Convolutional families turn a flat vector into a one-channel square image with
:class:`ImageAdapter`: the vector is zero-padded from ``D`` to ``s * s`` values,
``s = ceil(sqrt(D))``, and reshaped to ``(1, s, s)``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from numbers import Integral

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "ImageAdapter",
    "TesseraModel",
    "check_batch_shape",
    "count_activations",
    "count_macs",
    "count_parameters",
    "image_shape",
    "validate_input_shape",
    "validate_num_classes",
]


def validate_input_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """Check an input shape and return it as a tuple of ints.

    Parameters
    ----------
    input_shape : Sequence[int]
        Shape of one sample, without the batch dimension: ``(C, H, W)`` for images
        or ``(D,)`` for flat vectors.

    Returns
    -------
    tuple[int, ...]
        The same shape as a tuple of Python ints.

    Raises
    ------
    ValueError
        If the shape does not have 1 or 3 entries, or an entry is not a positive int.
    """
    shape = tuple(input_shape)
    if len(shape) not in (1, 3):
        raise ValueError(
            f"input_shape must be (C, H, W) for images or (D,) for flat vectors, "
            f"without the batch dimension; got {input_shape!r} with {len(shape)} "
            f"entries."
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


def image_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    """Return the ``(C, H, W)`` image a convolutional model sees for an input shape.

    Parameters
    ----------
    input_shape : Sequence[int]
        ``(C, H, W)`` for images or ``(D,)`` for flat vectors.

    Returns
    -------
    tuple[int, int, int]
        ``input_shape`` itself for images, ``(1, s, s)`` with ``s = ceil(sqrt(D))``
        for flat vectors.
    """
    shape = validate_input_shape(input_shape)
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
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


class ImageAdapter(nn.Module):
    """Turn a batch of inputs into the image batch a convolutional body expects.

    Images pass through unchanged. Flat vectors of size ``D`` are zero-padded to
    ``s * s`` values, ``s = ceil(sqrt(D))``, and reshaped to one-channel ``s x s``
    images. The batch is checked against ``input_shape`` so that a mismatch fails
    with a readable message instead of deep inside a convolution.

    Parameters
    ----------
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)`` or ``(D,)``.
    """

    def __init__(self, *, input_shape: Sequence[int]) -> None:
        super().__init__()
        self.input_shape = validate_input_shape(input_shape)
        self.output_shape = image_shape(self.input_shape)

    def forward(self, x: Tensor) -> Tensor:
        """Return ``x`` as a batch of images.

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
        if len(self.input_shape) == 3:
            return x
        channels, height, width = self.output_shape
        padding = height * width - self.input_shape[0]
        if padding:
            x = F.pad(x, (0, padding))
        return x.reshape(x.shape[0], channels, height, width)

    def extra_repr(self) -> str:
        """Describe the adaptation in the module's ``repr``."""
        return f"input_shape={self.input_shape}, output_shape={self.output_shape}"


class TesseraModel(nn.Module, ABC):
    """Abstract base of every model in the zoo: a body and a linear head.

    Subclasses implement :meth:`forward_features` and assign ``self.head`` (an
    ``nn.Linear(feature_dim, num_classes)``); :meth:`forward` composes the two.

    Parameters
    ----------
    input_shape : Sequence[int]
        Shape of one sample, ``(C, H, W)`` or ``(D,)``.
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
