"""Table tests for client_app.selection: cost estimates and architecture choice."""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from typing import Any

import pytest

from client_app.device import DeviceProfile, predefined_profile
from client_app.selection import (
    ArchChoice,
    Budget,
    CandidateCost,
    SelectionError,
    Workload,
    candidate_costs,
    choose_architecture,
    estimate_round_seconds,
    estimate_training_memory,
)

MiB = 1024 * 1024
GiB = 1024 * MiB

# A hand-made family, CIFAR-sized (3x32x32). Memory at batch 32, computed by hand as
# params * 16 + activations * 32 * 12 + 157_286_400 (150 MiB):
#   tiny     1_600_000 +  19_200_000 + 157_286_400 = 178_086_400  (~169.8 MiB)
#   small    8_000_000 +  57_600_000 + 157_286_400 = 222_886_400  (~212.6 MiB)
#   medium  32_000_000 + 153_600_000 + 157_286_400 = 342_886_400  (~327.0 MiB)
#   large  176_000_000 + 576_000_000 + 157_286_400 = 909_286_400  (~867.2 MiB)
# Training MACs per round of 5000 samples: 3 * macs * 5000 =
#   tiny 3e10, small 1.5e11, medium 6e11, large 8.25e12.
FAMILY = (
    CandidateCost(
        "tiny",
        0,
        params=100_000,
        macs_per_sample=2_000_000,
        activations_per_sample=50_000,
    ),
    CandidateCost(
        "small",
        1,
        params=500_000,
        macs_per_sample=10_000_000,
        activations_per_sample=150_000,
    ),
    CandidateCost(
        "medium",
        2,
        params=2_000_000,
        macs_per_sample=40_000_000,
        activations_per_sample=400_000,
    ),
    CandidateCost(
        "large",
        3,
        params=11_000_000,
        macs_per_sample=550_000_000,
        activations_per_sample=1_500_000,
    ),
)
MEMORY = {
    "tiny": 178_086_400,
    "small": 222_886_400,
    "medium": 342_886_400,
    "large": 909_286_400,
}

WORKLOAD = Workload(samples_per_round=5000, batch_size=32, input_shape=(3, 32, 32), num_classes=10)
TEN_MINUTES = Budget(max_round_seconds=600.0)

CPU_SMALL = predefined_profile("cpu-small")  # 2e8 MAC/s, 512 MiB -> 256 MiB budget
CPU_MEDIUM = predefined_profile("cpu-medium")  # 1e10 MAC/s, 4 GiB
CPU_LARGE = predefined_profile("cpu-large")  # 8e10 MAC/s, 16 GiB
JETSON = predefined_profile("jetson-orin")  # 1e11 MAC/s, 8 GiB unified
GPU = predefined_profile("gpu-server")  # 2e12 MAC/s, 80 GiB accelerator, 256 GiB host

# Fast CPU, 1 GiB host memory: 512 MiB budget, large needs 867 MiB.
CPU_LARGE_1GIB = replace(CPU_LARGE, memory_bytes=1 * GiB)
# A GPU with 1 GiB of its own memory on a host with 256 GiB.
GPU_1GIB = replace(GPU, accelerator_memory_bytes=1 * GiB)
# A Jetson whose (unified) host memory is 1 GiB; a misleading 64 GiB accelerator figure.
JETSON_1GIB = replace(JETSON, memory_bytes=1 * GiB, accelerator_memory_bytes=64 * GiB)
# Too little memory for anything: 256 MiB -> 128 MiB budget < tiny's 169.8 MiB.
CPU_256MIB = replace(CPU_SMALL, memory_bytes=256 * MiB)


# --- estimates ----------------------------------------------------------------


@pytest.mark.parametrize("candidate", FAMILY, ids=lambda c: c.name)
def test_estimate_training_memory_by_hand(candidate: CandidateCost) -> None:
    # Execute / Assert
    assert estimate_training_memory(candidate, WORKLOAD) == MEMORY[candidate.name]


def test_estimate_training_memory_scales_activations_with_batch() -> None:
    # Prepare
    tiny = FAMILY[0]
    batch_64 = replace(WORKLOAD, batch_size=64)

    # Execute
    delta = estimate_training_memory(tiny, batch_64) - estimate_training_memory(tiny, WORKLOAD)

    # Assert: 50_000 activations * 32 more samples * 4 bytes * 3
    assert delta == 19_200_000


@pytest.mark.parametrize(
    ("candidate", "profile", "expected"),
    [
        (FAMILY[0], CPU_SMALL, 150.0),  # 3 * 2e6 * 5000 / 2e8
        (FAMILY[1], CPU_SMALL, 750.0),  # 3 * 1e7 * 5000 / 2e8
        (FAMILY[2], CPU_MEDIUM, 60.0),  # 3 * 4e7 * 5000 / 1e10
        (FAMILY[3], CPU_MEDIUM, 825.0),  # 3 * 5.5e8 * 5000 / 1e10
        (FAMILY[3], GPU, 4.125),  # 3 * 5.5e8 * 5000 / 2e12
    ],
)
def test_estimate_round_seconds_by_hand(
    candidate: CandidateCost, profile: DeviceProfile, expected: float
) -> None:
    # Execute / Assert
    assert estimate_round_seconds(candidate, WORKLOAD, profile) == pytest.approx(expected)


# --- choose_architecture: the table -------------------------------------------

TABLE = [
    # id, profile, workload, budget, expected name, expected fits
    ("tiny-device-picks-smallest", CPU_SMALL, WORKLOAD, TEN_MINUTES, "tiny", True),
    ("big-device-picks-largest", GPU, WORKLOAD, TEN_MINUTES, "large", True),
    (
        "cpu-large-picks-largest",
        CPU_LARGE,
        WORKLOAD,
        TEN_MINUTES,
        "large",
        True,
    ),  # 103 s
    ("memory-bound", CPU_LARGE_1GIB, WORKLOAD, TEN_MINUTES, "medium", True),
    (
        "memory-bound-by-fraction",
        CPU_LARGE,
        WORKLOAD,
        Budget(600.0, memory_fraction=0.05),
        "medium",
        True,
    ),
    ("time-bound", CPU_MEDIUM, WORKLOAD, TEN_MINUTES, "medium", True),  # large 825 s
    (
        "time-bound-tighter",
        CPU_MEDIUM,
        WORKLOAD,
        Budget(30.0),
        "small",
        True,
    ),  # medium 60 s
    (
        "more-samples-smaller-model",
        CPU_MEDIUM,
        replace(WORKLOAD, samples_per_round=60_000),
        TEN_MINUTES,
        "small",
        True,
    ),  # medium 720 s
    (
        "bigger-batch-memory-bound",
        CPU_LARGE_1GIB,
        replace(WORKLOAD, batch_size=128),
        TEN_MINUTES,
        "small",
        True,
    ),
    ("time-limit-is-inclusive", CPU_SMALL, WORKLOAD, Budget(150.0), "tiny", True),
    ("nothing-fits-time", CPU_SMALL, WORKLOAD, Budget(60.0), "tiny", False),
    ("nothing-fits-memory", CPU_256MIB, WORKLOAD, TEN_MINUTES, "tiny", False),
    ("gpu-uses-accelerator-memory", GPU_1GIB, WORKLOAD, TEN_MINUTES, "medium", True),
    ("jetson-uses-host-memory", JETSON_1GIB, WORKLOAD, TEN_MINUTES, "medium", True),
    (
        "jetson-default-picks-largest",
        JETSON,
        WORKLOAD,
        TEN_MINUTES,
        "large",
        True,
    ),  # 82.5 s
]


@pytest.mark.parametrize(
    ("profile", "workload", "budget", "expected", "fits"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_choose_architecture_table(
    profile: DeviceProfile,
    workload: Workload,
    budget: Budget,
    expected: str,
    fits: bool,
) -> None:
    # Execute
    choice = choose_architecture(profile, FAMILY, workload, budget)

    # Assert
    assert (choice.name, choice.fits) == (expected, fits)
    assert choice.candidates_considered == len(FAMILY)
    chosen = next(c for c in FAMILY if c.name == expected)
    assert choice.estimated_memory_bytes == estimate_training_memory(chosen, workload)
    assert choice.estimated_round_seconds == estimate_round_seconds(chosen, workload, profile)


def test_nothing_fits_time_reason_says_by_how_much(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Execute
    with caplog.at_level(logging.WARNING, logger="client_app.selection"):
        choice = choose_architecture(CPU_SMALL, FAMILY, WORKLOAD, Budget(60.0))

    # Assert: tiny needs 150 s, 90 s (2.5x) over the budget; memory is fine
    assert not choice.fits
    assert "time 150.0 s exceeds the 60.0 s budget by 90.0 s (2.50x)" in choice.reason
    assert "memory 169.8 MiB exceeds" not in choice.reason
    assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_nothing_fits_memory_reason_says_by_how_much() -> None:
    # Execute
    choice = choose_architecture(CPU_256MIB, FAMILY, WORKLOAD, TEN_MINUTES)

    # Assert: tiny needs 169.8 MiB against 128 MiB, 41.8 MiB over
    assert not choice.fits
    assert "memory 169.8 MiB exceeds the 128.0 MiB budget by 41.8 MiB" in choice.reason
    assert "time" not in choice.reason.split("using the smallest")[1]


def test_nothing_fits_both_constraints_reported() -> None:
    # Execute
    choice = choose_architecture(CPU_256MIB, FAMILY, WORKLOAD, Budget(60.0))

    # Assert
    assert not choice.fits
    assert "memory 169.8 MiB exceeds" in choice.reason
    assert "time 150.0 s exceeds" in choice.reason


def test_fit_reason_names_rejected_larger_candidates() -> None:
    # Execute
    choice = choose_architecture(CPU_MEDIUM, FAMILY, WORKLOAD, TEN_MINUTES)

    # Assert
    assert choice.reason.startswith("medium is the largest of 4 candidates")
    assert "large (time 825.0 s exceeds" in choice.reason


def test_choice_does_not_depend_on_candidate_order() -> None:
    # Prepare
    shuffled = list(FAMILY)
    random.Random(0).shuffle(shuffled)

    # Execute
    expected = choose_architecture(CPU_MEDIUM, FAMILY, WORKLOAD, TEN_MINUTES)
    actual = choose_architecture(CPU_MEDIUM, shuffled, WORKLOAD, TEN_MINUTES)

    # Assert
    assert actual == expected


def test_single_candidate_is_used_even_if_it_does_not_fit() -> None:
    # Execute
    choice = choose_architecture(CPU_SMALL, FAMILY[3:], WORKLOAD, TEN_MINUTES)

    # Assert
    assert choice == ArchChoice(
        name="large",
        estimated_memory_bytes=909_286_400,
        estimated_round_seconds=pytest.approx(41_250.0),  # type: ignore[arg-type]
        fits=False,
        reason=choice.reason,
        candidates_considered=1,
    )


# --- invalid input ------------------------------------------------------------


def test_empty_candidates_raise() -> None:
    # Execute / Assert
    with pytest.raises(SelectionError, match="no candidate"):
        choose_architecture(CPU_SMALL, [], WORKLOAD, TEN_MINUTES)


@pytest.mark.parametrize(
    "extra",
    [
        CandidateCost("tiny", 9, params=1, macs_per_sample=1, activations_per_sample=1),
        CandidateCost("other", 0, params=1, macs_per_sample=1, activations_per_sample=1),
    ],
    ids=["duplicate-name", "duplicate-rank"],
)
def test_duplicate_candidates_raise(extra: CandidateCost) -> None:
    # Execute / Assert
    with pytest.raises(SelectionError, match="unique"):
        choose_architecture(CPU_SMALL, [*FAMILY, extra], WORKLOAD, TEN_MINUTES)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Budget(max_round_seconds=0.0),
        lambda: Budget(max_round_seconds=60.0, memory_fraction=0.0),
        lambda: Budget(max_round_seconds=60.0, memory_fraction=1.5),
        lambda: Workload(
            samples_per_round=0, batch_size=32, input_shape=(3, 32, 32), num_classes=10
        ),
        lambda: Workload(
            samples_per_round=10, batch_size=0, input_shape=(3, 32, 32), num_classes=10
        ),
        lambda: Workload(samples_per_round=10, batch_size=32, input_shape=(), num_classes=10),
        lambda: Workload(
            samples_per_round=10, batch_size=32, input_shape=(3, 0, 32), num_classes=10
        ),
        lambda: Workload(
            samples_per_round=10, batch_size=32, input_shape=(3, 32, 32), num_classes=1
        ),
        lambda: CandidateCost("x", 0, params=0, macs_per_sample=1, activations_per_sample=1),
        lambda: CandidateCost("", 0, params=1, macs_per_sample=1, activations_per_sample=1),
    ],
)
def test_invalid_inputs_raise_value_error(build: object) -> None:
    # Execute / Assert
    assert callable(build)
    with pytest.raises(ValueError, match=r"invalid|must|empty"):
        build()


# --- real models (needs the `models` registry) --------------------------------


def test_candidate_costs_real_models() -> None:
    # Execute
    costs = candidate_costs("cnn", (3, 32, 32), 10)

    # Assert: one entry per registered model, ascending rank, growing cost
    assert [c.name for c in costs] == ["cnn-1", "cnn-2", "cnn-3", "cnn-4", "cnn-5"]
    assert [c.size_rank for c in costs] == sorted(c.size_rank for c in costs)
    assert all(c.params > 0 and c.macs_per_sample > 0 for c in costs)
    assert costs[-1].params > costs[0].params
    assert costs[-1].macs_per_sample > costs[0].macs_per_sample
    # Assert: and selection accepts them end to end
    small = choose_architecture(CPU_SMALL, costs, WORKLOAD, TEN_MINUTES)
    big = choose_architecture(GPU, costs, WORKLOAD, TEN_MINUTES)
    assert small.candidates_considered == big.candidates_considered == len(costs)
    assert big.name == "cnn-5"


def test_candidate_costs_are_measured_once_per_question(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: count the models built (a simulation worker greets hundreds of nodes
    # with the same question; each answer builds every candidate)
    import models

    built: list[str] = []
    real = models.get_model

    def counting(ref: Any, **kwargs: Any) -> Any:
        built.append(str(ref))
        return real(ref, **kwargs)

    monkeypatch.setattr(models, "get_model", counting)

    # Execute: the same question twice (a fresh shape so no earlier test answered
    # it), then another norm, then the first again
    first = candidate_costs("cnn", (1, 13, 13), 7, names=["cnn-1", "cnn-2"])
    again = candidate_costs("cnn", (1, 13, 13), 7, names=["cnn-1", "cnn-2"])
    first.append(first[0])  # a caller's list is its own
    other = candidate_costs("cnn", (1, 13, 13), 7, norm="group", names=["cnn-1", "cnn-2"])
    third = candidate_costs("cnn", (1, 13, 13), 7, names=["cnn-1", "cnn-2"])

    # Assert: built for the first question and for the other norm, not again
    assert len(built) == 4
    assert again == third and len(third) == 2
    assert [c.name for c in other] == ["cnn-1", "cnn-2"]


def test_candidate_costs_unknown_family_raises() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="no-such-family"):
        candidate_costs("no-such-family", (3, 32, 32), 10)
