"""What a model costs: trainable parameters, multiply-accumulates and activations.

The counts are per sample. MACs and activations are measured with forward hooks on a
dummy batch (:func:`count_macs`, :func:`count_activations`), which leaves the
model's train/eval modes and running statistics as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from numbers import Integral

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["count_activations", "count_macs", "count_parameters"]


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
