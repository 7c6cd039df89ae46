"""Architecture choice: the largest model a device can train within budget.

:func:`choose_architecture` is a pure function of a :class:`DeviceProfile`,
the costs of the candidate models (:class:`CandidateCost`), the local
workload and a budget. :func:`candidate_costs` gathers the real costs of a
model family from the ``models`` registry.

Cost model (deliberately simple; order of magnitude is what matters):

* memory (:func:`estimate_training_memory`): fp32 weights, gradients,
  optimiser momentum and one spare copy, saved activations of one batch with
  their gradients and workspace, plus a fixed runtime overhead;
* time (:func:`estimate_round_seconds`): a training step costs three forward
  passes (forward, gradient w.r.t. activations, gradient w.r.t. weights).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from client_app.device import DeviceProfile
from tessera.config import FlatInput

log = logging.getLogger(__name__)

__all__ = [
    "BYTES_PER_FLOAT",
    "RUNTIME_OVERHEAD_BYTES",
    "TRAINING_MACS_FACTOR",
    "ArchChoice",
    "Budget",
    "CandidateCost",
    "SelectionError",
    "Workload",
    "available_training_memory",
    "candidate_costs",
    "choose_architecture",
    "estimate_round_seconds",
    "estimate_training_memory",
]

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


class SelectionError(ValueError):
    """Invalid input to architecture selection."""


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


@dataclass(frozen=True)
class Budget:
    """Resources a client grants local training.

    Parameters
    ----------
    max_round_seconds : float
        Longest acceptable local training time per round.
    memory_fraction : float
        Share of the available memory (accelerator memory, or host memory on
        CPU-only devices and Jetsons) training may use, in ``(0, 1]``.

    Raises
    ------
    SelectionError
        If a value is out of range.
    """

    max_round_seconds: float
    memory_fraction: float = 0.5

    def __post_init__(self) -> None:
        """Validate values once, at construction."""
        if not self.max_round_seconds > 0:
            raise SelectionError(
                f"Budget max_round_seconds={self.max_round_seconds} is invalid; "
                "use a positive number of seconds"
            )
        if not 0 < self.memory_fraction <= 1:
            raise SelectionError(
                f"Budget memory_fraction={self.memory_fraction} is invalid; use a value in (0, 1]"
            )


@dataclass(frozen=True)
class ArchChoice:
    """Outcome of :func:`choose_architecture`.

    Parameters
    ----------
    name : str
        Chosen candidate.
    estimated_memory_bytes : int
        Its estimated training memory.
    estimated_round_seconds : float
        Its estimated training time per round.
    fits : bool
        Whether it meets the memory and time budget; ``False`` when no
        candidate does and the smallest is used anyway.
    reason : str
        Human-readable explanation, naming the failed constraint (``memory``
        or ``time``) and by how much when ``fits`` is ``False``.
    candidates_considered : int
        Number of candidates examined.
    """

    name: str
    estimated_memory_bytes: int
    estimated_round_seconds: float
    fits: bool
    reason: str
    candidates_considered: int


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


def _mib(n: float) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def _percent(fraction: float) -> str:
    """Format a share; tiny shares keep their significant digits (not ``0%``)."""
    return f"{fraction:.0%}" if fraction >= 0.01 else f"{fraction * 100:.2g}%"


def _ratio(value: float, limit: float) -> str:
    """Format ``value / limit`` as ``"2.50x"`` without dividing by zero."""
    ratio = value / limit if limit > 0 else math.inf
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "beyond any multiple"


def _violations(memory: int, limit: int, seconds: float, budget: Budget) -> list[str]:
    """Describe each constraint a candidate breaks, with the excess.

    ``limit`` may be 0 (a tiny ``memory_fraction`` or a device with a few
    bytes of memory): every candidate then breaks the memory constraint, and
    the text says how to raise the budget instead of dividing by zero.
    """
    failed = []
    if memory > limit:
        excess = (
            f"{_ratio(memory, limit)}"
            if limit > 0
            else "the budget rounds to 0 B: raise run-config 'memory-fraction' "
            "or give the device more memory"
        )
        failed.append(
            f"memory {_mib(memory)} exceeds the {_mib(limit)} budget "
            f"by {_mib(memory - limit)} ({excess})"
        )
    if seconds > budget.max_round_seconds:
        failed.append(
            f"time {seconds:.1f} s exceeds the "
            f"{budget.max_round_seconds:.1f} s budget "
            f"by {seconds - budget.max_round_seconds:.1f} s "
            f"({_ratio(seconds, budget.max_round_seconds)})"
        )
    return failed


def choose_architecture(
    profile: DeviceProfile,
    candidates: Sequence[CandidateCost],
    workload: Workload,
    budget: Budget,
) -> ArchChoice:
    """Choose the largest candidate a device can train within budget.

    A candidate fits when :func:`estimate_training_memory` is at most
    ``budget.memory_fraction`` of :func:`available_training_memory` and
    :func:`estimate_round_seconds` is at most ``budget.max_round_seconds``.
    The fitting candidate with the highest ``size_rank`` wins. If none fits,
    the smallest is returned with ``fits=False`` and a warning is logged: a
    device still participates.

    Parameters
    ----------
    profile : DeviceProfile
        The device.
    candidates : Sequence of CandidateCost
        Candidates of one family, in any order, with distinct names and
        size ranks.
    workload : Workload
        Local work per round.
    budget : Budget
        Time and memory budget.

    Returns
    -------
    ArchChoice
        The choice and its estimates.

    Raises
    ------
    SelectionError
        If ``candidates`` is empty or has duplicate names or size ranks.
    """
    if not candidates:
        raise SelectionError(
            "no candidate architectures given; pass at least one CandidateCost "
            "(see candidate_costs())"
        )
    names = [c.name for c in candidates]
    ranks = [c.size_rank for c in candidates]
    if len(set(names)) != len(names) or len(set(ranks)) != len(ranks):
        raise SelectionError(
            f"candidates {list(zip(names, ranks, strict=True))} repeat a name "
            "or size_rank; "
            "give each candidate a unique name and size_rank"
        )

    available, memory_label = available_training_memory(profile)
    limit = int(budget.memory_fraction * available)
    ordered = sorted(candidates, key=lambda c: c.size_rank, reverse=True)
    rejected: list[str] = []
    for candidate in ordered:
        memory = estimate_training_memory(candidate, workload)
        seconds = estimate_round_seconds(candidate, workload, profile)
        failed = _violations(memory, limit, seconds, budget)
        if failed:
            rejected.append(f"{candidate.name} ({'; '.join(failed)})")
            continue
        reason = (
            f"{candidate.name} is the largest of {len(candidates)} candidates "
            "within budget: "
            f"memory {_mib(memory)} <= {_mib(limit)} ({_percent(budget.memory_fraction)} of "
            f"{_mib(available)} {memory_label}), time {seconds:.1f} s <= "
            f"{budget.max_round_seconds:.1f} s"
        )
        if rejected:
            reason += "; larger candidates rejected: " + ", ".join(rejected)
        log.info("profile %r: %s", profile.name, reason)
        return ArchChoice(
            name=candidate.name,
            estimated_memory_bytes=memory,
            estimated_round_seconds=seconds,
            fits=True,
            reason=reason,
            candidates_considered=len(candidates),
        )

    smallest = ordered[-1]
    memory = estimate_training_memory(smallest, workload)
    seconds = estimate_round_seconds(smallest, workload, profile)
    reason = (
        f"no candidate fits {_percent(budget.memory_fraction)} of {_mib(available)} "
        f"{memory_label} and {budget.max_round_seconds:.1f} s per round; "
        f"using the smallest, {smallest.name}: "
        + "; ".join(_violations(memory, limit, seconds, budget))
    )
    log.warning("profile %r: %s", profile.name, reason)
    return ArchChoice(
        name=smallest.name,
        estimated_memory_bytes=memory,
        estimated_round_seconds=seconds,
        fits=False,
        reason=reason,
        candidates_considered=len(candidates),
    )


def candidate_costs(
    family: str,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    norm: str = "batch",
    flat_input: FlatInput = "signal",
    names: Sequence[str] | None = None,
) -> list[CandidateCost]:
    """Build every candidate model and measure its costs.

    Parameters
    ----------
    family : str
        Model family of the ``models`` registry (``models.list_families()``), or
        the cross-family set ``"mixed"``.
    input_shape : Sequence of int
        Shape of one sample, e.g. ``(3, 32, 32)``.
    num_classes : int
        Number of output classes.
    norm : str
        Normalisation passed to ``models.get_model`` (it changes the
        activation count slightly).
    flat_input : {"signal", "square"}
        How conv models read flat ``(D,)`` samples (run-config ``flat-input``).
    names : Sequence of str, optional
        The candidates; every model of ``family`` when omitted. Registered models
        of one family keep the registry's size rank; when any candidate is a slice
        (``"<model>@<tag>"``) or the candidates come from more than one family
        (``"mixed"``: size ranks only order models within a family), ranks are
        derived from the measured cost instead (parameters, then MACs), so no
        candidate declares its own.

    Returns
    -------
    list of CandidateCost
        One entry per candidate, by ascending ``size_rank``.

    Raises
    ------
    ValueError
        From the registry, if the family, a name, the input shape, class count or
        norm is invalid.
    """
    # Imported lazily: building models needs torch; the pure selection does not.
    from models import (
        count_activations,
        count_macs,
        count_parameters,
        get_model,
        list_models,
        model_entry,
    )
    from models.spec import SLICE_SEPARATOR, split_name

    shape = tuple(int(d) for d in input_shape)
    chosen = list(list_models(family) if names is None else names)
    families = {model_entry(split_name(name)[0]).family for name in chosen}
    derived = len(families) > 1 or any(SLICE_SEPARATOR in name for name in chosen)
    measured = []
    for name in chosen:
        model = get_model(
            name, input_shape=shape, num_classes=num_classes, norm=norm, flat_input=flat_input
        )
        measured.append(
            (
                name,
                count_parameters(model),
                count_macs(model, shape),
                count_activations(model, shape),
            )
        )
    if derived:
        ranks = {m[0]: r for r, m in enumerate(sorted(measured, key=lambda m: (m[1], m[2])))}
    else:
        ranks = {m[0]: model_entry(m[0]).size_rank for m in measured}
    costs = [
        CandidateCost(
            name=name,
            size_rank=ranks[name],
            params=params,
            macs_per_sample=macs,
            activations_per_sample=acts,
        )
        for name, params, macs, acts in measured
    ]
    return sorted(costs, key=lambda c: c.size_rank)
