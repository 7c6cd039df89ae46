"""Architecture choice: the largest model a device can train within budget.

:func:`choose_architecture` is a pure function of a :class:`DeviceProfile`,
the costs of the candidate models (:class:`CandidateCost`), the local
workload and a budget. :func:`candidate_costs` gathers the real costs of a
model family from the ``models`` registry.

The cost model (:func:`estimate_training_memory`, :func:`estimate_round_seconds`)
is :mod:`client_app.estimates`; its types are re-exported here, as the inputs of
:func:`choose_architecture`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from client_app.device import DeviceProfile
from client_app.estimates import (
    BYTES_PER_FLOAT,
    RUNTIME_OVERHEAD_BYTES,
    TRAINING_MACS_FACTOR,
    CandidateCost,
    SelectionError,
    Workload,
    available_training_memory,
    estimate_round_seconds,
    estimate_training_memory,
)
from tessera.config import FlatInput

if TYPE_CHECKING:
    from models.registry import ModelEntry
    from models.spec import ModelRef

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
    names: Sequence[str | ModelRef] | None = None,
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
    names : Sequence of ModelRef or str, optional
        The candidates (a printed name is read with :meth:`ModelRef.parse`); every
        model of ``family`` when omitted. Registered models of one family keep the
        registry's size rank; when any candidate is a slice or the candidates come
        from more than one family
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
    from models import list_models, model_entry
    from models.spec import ModelRef

    chosen = tuple(
        n if isinstance(n, ModelRef) else ModelRef.parse(n)
        for n in (list_models(family) if names is None else names)
    )
    question = (
        chosen,
        # the registry entries themselves: a model registered again under the same
        # name (a plug-in, a test) is a new question, never a stale answer
        tuple(model_entry(ref.model) for ref in chosen),
        tuple(int(d) for d in input_shape),
        int(num_classes),
        norm,
        flat_input,
    )
    try:
        hash(question)
    except TypeError:  # an entry with an unhashable config: measure it every time
        return list(_measure_costs(*question))
    return list(_measured_costs(*question))


def _measure_costs(
    chosen: tuple[ModelRef, ...],
    entries: tuple[ModelEntry, ...],
    shape: tuple[int, ...],
    num_classes: int,
    norm: str,
    flat_input: FlatInput,
) -> tuple[CandidateCost, ...]:
    """Build every candidate of :func:`candidate_costs` and count its costs."""
    # Imported lazily: building models needs torch; the pure selection does not.
    from models import count_activations, count_macs, count_parameters, get_model

    families = {entry.family for entry in entries}
    derived = len(families) > 1 or any(ref.spec is not None for ref in chosen)
    measured = []
    for ref in chosen:
        model = get_model(
            ref, input_shape=shape, num_classes=num_classes, norm=norm, flat_input=flat_input
        )
        measured.append(
            (
                ref.name,
                count_parameters(model),
                count_macs(model, shape),
                count_activations(model, shape),
            )
        )
    if derived:
        ranks = {m[0]: r for r, m in enumerate(sorted(measured, key=lambda m: (m[1], m[2])))}
    else:
        ranks = {ref.name: entry.size_rank for ref, entry in zip(chosen, entries, strict=True)}
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
    return tuple(sorted(costs, key=lambda c: c.size_rank))


_measured_costs = lru_cache(maxsize=32)(_measure_costs)
"""Building and counting every candidate takes about 10 ms; a simulation worker greets
hundreds of nodes with the same question (a deployed node asks it once), so a process
measures each question once."""
