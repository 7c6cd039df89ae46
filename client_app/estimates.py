"""How much memory and time training a model takes on a device: the cost model.

Deliberately simple; order of magnitude is what matters:

* memory (:func:`estimate_training_memory`): fp32 weights, gradients,
  optimiser momentum and one spare copy, saved activations of one batch with
  their gradients and workspace, plus a fixed runtime overhead;
* time (:func:`estimate_round_seconds`): a training step costs three forward
  passes (forward, gradient w.r.t. activations, gradient w.r.t. weights).

:func:`client_app.selection.choose_architecture` applies it to every candidate.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Final

from client_app.device import DeviceProfile

log = logging.getLogger(__name__)

__all__ = [
    "BYTES_PER_FLOAT",
    "RUNTIME_OVERHEAD_BYTES",
    "TRAINING_MACS_FACTOR",
    "CandidateCost",
    "SelectionError",
    "Workload",
    "available_training_memory",
    "estimate_round_seconds",
    "estimate_training_memory",
]


class SelectionError(ValueError):
    """Invalid input to architecture selection."""


BYTES_PER_FLOAT: Final = 4
"""fp32 training."""

PARAM_COPIES: Final = 4
"""Weights, gradients, SGD momentum and one copy (e.g. the global model of FedProx)."""

ACTIVATION_COPIES: Final = 3
"""Activations saved by the forward pass, their gradients, and kernel workspace."""

RUNTIME_OVERHEAD_BYTES: Final = 150 * 1024 * 1024
"""Fixed overhead of the training runtime: PyTorch's CPU allocator arenas, the
loaded libraries' data, the data loader batch and Python objects. Measured
resident-set growth of ``import torch`` plus a first tiny training step is
~100-200 MiB on x86 and aarch64; 150 MiB is the middle."""

TRAINING_MACS_FACTOR: Final = 3
"""Training MACs per sample, in forward passes: forward, input and weight gradients."""


@dataclass(frozen=True)
class CandidateCost:
    """Per-sample costs of one candidate architecture.

    Parameters
    ----------
    name : str
        Registry name of the model.
    size_rank : int
        Rank within its family; larger means a bigger model.
    params : int
        Number of trainable parameters.
    macs_per_sample : int
        Forward multiply-accumulates for one input sample.
    activations_per_sample : int
        Activation elements the forward pass produces for one sample.

    Raises
    ------
    SelectionError
        If a count is out of range.
    """

    name: str
    size_rank: int
    params: int
    macs_per_sample: int
    activations_per_sample: int

    def __post_init__(self) -> None:
        """Validate counts once, at construction."""
        if not self.name:
            raise SelectionError("CandidateCost name is empty; use the model's registry name")
        if self.params <= 0 or self.macs_per_sample <= 0 or self.activations_per_sample < 0:
            raise SelectionError(
                f"CandidateCost {self.name!r} has params={self.params}, "
                f"macs_per_sample={self.macs_per_sample}, "
                f"activations_per_sample={self.activations_per_sample}; "
                "params and MACs must be positive and activations non-negative"
            )


@dataclass(frozen=True)
class Workload:
    """Local training work of one round.

    Parameters
    ----------
    samples_per_round : int
        Samples processed per round (local epochs x local dataset size).
    batch_size : int
        Training batch size.
    input_shape : tuple of int
        Shape of one sample, e.g. ``(3, 32, 32)``.
    num_classes : int
        Number of output classes.

    Raises
    ------
    SelectionError
        If a value is out of range.
    """

    samples_per_round: int
    batch_size: int
    input_shape: tuple[int, ...]
    num_classes: int

    def __post_init__(self) -> None:
        """Validate values once, at construction."""
        if self.samples_per_round <= 0:
            raise SelectionError(
                f"Workload samples_per_round={self.samples_per_round} is invalid; "
                "use a positive count"
            )
        if self.batch_size <= 0:
            raise SelectionError(
                f"Workload batch_size={self.batch_size} is invalid; use a positive batch size"
            )
        if not self.input_shape or any(d <= 0 for d in self.input_shape):
            raise SelectionError(
                f"Workload input_shape={self.input_shape!r} is invalid; "
                "use positive dimensions such as (3, 32, 32)"
            )
        if self.num_classes < 2:
            raise SelectionError(
                f"Workload num_classes={self.num_classes} is invalid; use at least 2"
            )


def estimate_training_memory(c: CandidateCost, w: Workload) -> int:
    """Estimate the peak memory of training candidate ``c``.

    ``memory = params * 4 B * 4``
    ``+ activations_per_sample * batch_size * 4 B * 3``
    ``+ 150 MiB``

    * ``params * 4 B * 4``: fp32 weights, gradients, momentum, one spare copy;
    * ``activations * batch * 4 B * 3``: fp32 activations saved by the
      forward pass, their gradients, and kernel workspace;
    * 150 MiB: :data:`RUNTIME_OVERHEAD_BYTES`.

    Parameters
    ----------
    c : CandidateCost
        The candidate.
    w : Workload
        The workload (only ``batch_size`` is used).

    Returns
    -------
    int
        Bytes.
    """
    param_bytes = c.params * BYTES_PER_FLOAT * PARAM_COPIES
    activation_bytes = c.activations_per_sample * w.batch_size * BYTES_PER_FLOAT * ACTIVATION_COPIES
    return param_bytes + activation_bytes + RUNTIME_OVERHEAD_BYTES


def estimate_round_seconds(c: CandidateCost, w: Workload, profile: DeviceProfile) -> float:
    """Estimate the local training time of one round.

    ``seconds = 3 * macs_per_sample * samples_per_round / train_macs_per_second``

    Parameters
    ----------
    c : CandidateCost
        The candidate.
    w : Workload
        The workload (only ``samples_per_round`` is used).
    profile : DeviceProfile
        The device (only ``train_macs_per_second`` is used).

    Returns
    -------
    float
        Seconds; ``inf`` when the work is too large to represent.

    Raises
    ------
    SelectionError
        If ``profile.train_macs_per_second`` is not a positive finite number
        (a :class:`DeviceProfile` built normally cannot have one).
    """
    rate = profile.train_macs_per_second
    if not (math.isfinite(rate) and rate > 0):
        raise SelectionError(
            f"device profile {profile.name!r} has train_macs_per_second={rate!r}; "
            "it must be a positive, finite MAC rate (re-probe the device or fix the "
            "profile's 'train-macs-per-second')"
        )
    work = float(TRAINING_MACS_FACTOR) * float(c.macs_per_sample) * float(w.samples_per_round)
    return work / rate


def available_training_memory(profile: DeviceProfile) -> tuple[int, str]:
    """Return the memory training competes for and a description of it.

    Accelerator memory on CUDA/MPS devices; host memory on CPU-only devices
    and on Jetsons, whose GPU shares (unified) host memory.

    Parameters
    ----------
    profile : DeviceProfile
        The device.

    Returns
    -------
    tuple of (int, str)
        Bytes and a label such as ``"accelerator memory"``.
    """
    if profile.accelerator == "cpu":
        return profile.memory_bytes, "host memory"
    if profile.is_jetson:
        return profile.memory_bytes, "unified host memory (Jetson)"
    if profile.accelerator_memory_bytes is None:
        log.debug("profile %r has no accelerator memory; using host memory", profile.name)
        return profile.memory_bytes, "host memory (accelerator memory unknown)"
    return profile.accelerator_memory_bytes, "accelerator memory"
