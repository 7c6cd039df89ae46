"""Bad input found by review: each case raises a clear error or degrades gracefully.

* selection: a memory budget that rounds to 0 B (``memory-fraction=1e-10``, a
  1-byte device) or a vanishing time budget gives "nothing fits", never
  ``ZeroDivisionError``;
* data files: a ``.npy`` named ``.npz``, truncated or foreign zips, object arrays
  and malformed arrays raise :class:`DataError` naming the file, array or value;
* labels of a whole dataset must be the class indices ``0..C-1``;
* run-config ``seed`` must lie in numpy's seed range.
"""

from __future__ import annotations

import logging
import re
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_app.device import DeviceProfile, DeviceProfileError, predefined_profile
from client_app.selection import (
    Budget,
    CandidateCost,
    SelectionError,
    Workload,
    choose_architecture,
    estimate_round_seconds,
)
from tessera.config import ConfigError, RunConfig
from tessera.data import DataError, load_bundle, local_data

RunConfigFactory = Callable[..., dict[str, Any]]

MiB = 1024 * 1024

FAMILY = (
    CandidateCost("tiny", 0, params=100_000, macs_per_sample=2_000_000, activations_per_sample=1),
    CandidateCost("big", 1, params=900_000, macs_per_sample=9_000_000, activations_per_sample=1),
)
WORKLOAD = Workload(samples_per_round=100, batch_size=8, input_shape=(3, 8, 8), num_classes=10)
CPU_MEDIUM = predefined_profile("cpu-medium")  # 4 GiB host memory, 1e10 MAC/s
GPU = predefined_profile("gpu-server")  # 80 GiB accelerator memory


# --------------------------------------------------------------------------- #
# 1. Architecture selection with a zero memory or time budget
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("profile", "fraction"),
    [
        (CPU_MEDIUM, 1e-10),  # 0.43 B of 4 GiB rounds to 0 B
        (replace(CPU_MEDIUM, memory_bytes=1), 0.5),  # a 1-byte device
        (replace(GPU, accelerator_memory_bytes=1), 0.5),  # a 1-byte accelerator
    ],
    ids=["memory-fraction-1e-10", "1-byte-host", "1-byte-accelerator"],
)
def test_zero_memory_budget_chooses_smallest_with_reason(
    profile: DeviceProfile, fraction: float
) -> None:
    # Execute
    choice = choose_architecture(profile, FAMILY, WORKLOAD, Budget(600.0, fraction))

    # Assert: the usual "nothing fits" outcome, naming the fix, not ZeroDivisionError
    assert (choice.name, choice.fits) == ("tiny", False)
    assert "no candidate fits" in choice.reason
    assert "exceeds the 0.0 MiB budget" in choice.reason
    assert "the budget rounds to 0 B: raise run-config 'memory-fraction'" in choice.reason


def test_run_config_memory_fraction_1e_10_selects_gracefully(
    run_config: RunConfigFactory,
) -> None:
    # Prepare: the path of the ClientApp, run config -> Budget
    run = RunConfig.from_flower(run_config({"memory-fraction": 1e-10}))
    budget = Budget(
        max_round_seconds=run.training.train_time_budget,
        memory_fraction=run.training.memory_fraction,
    )

    # Execute
    choice = choose_architecture(CPU_MEDIUM, FAMILY, WORKLOAD, budget)

    # Assert: the tiny share is shown with its digits, not as "0%"
    assert not choice.fits
    assert choice.reason.startswith("no candidate fits 1e-08% of 4096.0 MiB host memory")


def test_vanishing_time_budget_has_no_ratio_error() -> None:
    # Execute: 0.06 s of work against a 5e-324 s budget overflows the ratio to inf
    choice = choose_architecture(CPU_MEDIUM, FAMILY, WORKLOAD, Budget(5e-324))

    # Assert
    assert not choice.fits
    assert "(beyond any multiple)" in choice.reason


def test_estimate_round_seconds_rejects_a_zero_mac_rate() -> None:
    # Prepare: a profile whose validation was bypassed (a frozen copy patched in place)
    broken = replace(CPU_MEDIUM)
    object.__setattr__(broken, "train_macs_per_second", 0.0)

    # Execute / Assert
    with pytest.raises(SelectionError, match=r"train_macs_per_second=0\.0; .*re-probe"):
        estimate_round_seconds(FAMILY[0], WORKLOAD, broken)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("memory_bytes", 0),
        ("accelerator_memory_bytes", 0),
        ("cpu_cores", 0.0),
        ("train_macs_per_second", 0.0),
    ],
)
def test_device_profile_rejects_zero_resources(field: str, value: float) -> None:
    # Execute / Assert: the divisors of selection are validated at the profile's edge
    with pytest.raises(DeviceProfileError, match=f"{field}={value!r}"):
        replace(CPU_MEDIUM, **{field: value})


# --------------------------------------------------------------------------- #
# 2. Malformed .npz files
# --------------------------------------------------------------------------- #


def _good_arrays(n: int = 12, classes: int = 3) -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).random((n, 4), dtype=np.float32)
    y = np.arange(n, dtype=np.int64) % classes
    return {"x_train": x, "y_train": y, "x_test": x[:classes], "y_test": y[:classes]}


def _save(path: Path, **arrays: Any) -> Path:
    np.savez(path, **arrays)
    return path


def _local(path: Path, num_classes: int | None = None) -> Any:
    return local_data(str(path), test_fraction=0.25, seed=0, num_classes=num_classes)


def test_npy_named_npz_is_a_data_error(tmp_path: Path) -> None:
    # Prepare: np.save writes .npy; the name says .npz
    path = tmp_path / "single.npz"
    with path.open("wb") as handle:
        np.save(handle, np.zeros((4, 2)))
    expected = (
        rf"data file '{re.escape(str(path))}' holds a single \.npy array \(np\.save\), "
        r"not an \.npz archive of the named arrays \['x_train', 'y_train', 'x_test', "
        r"'y_test'\]; save it with np\.savez\(path, x_train=\.\.\."
    )

    # Execute / Assert: both readers of npz files
    with pytest.raises(DataError, match=expected):
        load_bundle(f"npz:{path}")
    with pytest.raises(DataError, match=expected):
        _local(path)


def test_truncated_npz_is_a_data_error(tmp_path: Path) -> None:
    # Prepare: the first 100 bytes of a real archive (zip signature, no directory)
    whole = _save(tmp_path / "whole.npz", **_good_arrays())
    path = tmp_path / "cut.npz"
    path.write_bytes(whole.read_bytes()[:100])

    # Execute / Assert
    with pytest.raises(DataError, match=r"cut\.npz' is not a readable \.npz archive"):
        _local(path)


def test_zip_not_written_by_savez_is_a_data_error(tmp_path: Path) -> None:
    # Prepare: a zip whose member is raw bytes, not a .npy array
    path = tmp_path / "foreign.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x_train.npy", b"not an array")

    # Execute / Assert
    with pytest.raises(DataError, match=r"'x_train' of data file .*foreign\.npz"):
        _local(path)


@pytest.mark.parametrize("key", ["x_train", "y_train"])
def test_object_arrays_are_refused_naming_the_array(tmp_path: Path, key: str) -> None:
    # Prepare: np.savez pickles object arrays; loading them would unpickle
    arrays: dict[str, Any] = _good_arrays()
    arrays[key] = np.array([{"a": 1}] * len(arrays[key]), dtype=object)
    path = _save(tmp_path / "objects.npz", **arrays)

    # Execute / Assert
    with pytest.raises(DataError, match=rf"array '{key}' of data file .*dtype=object"):
        load_bundle(f"npz:{path}")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"y_train": None}, r"lacks array 'y_train'; it has \['x_test', 'x_train', 'y_test'\]"),
        ({"x_train": None}, r"lacks array 'x_train'"),
        ({"y_train": np.zeros(5, dtype=np.int64)}, r"12 samples but labels of shape \(5,\)"),
        ({"y_train": np.full(12, 0.5)}, r"label 0\.5 at index 0 is not an integer"),
        ({"y_train": np.array(["cat", "dog"] * 6)}, r"dtype <U3; labels must be integer"),
        ({"y_train": np.full(12, 2**63 + 5, dtype=np.uint64)}, r"9223372036854775813 .*too large"),
        ({"y_train": np.full(12, 1e30)}, r"label 1e\+30 at index 0 is too large"),
        ({"x_train": np.float32(1.0)}, r"samples are a scalar"),
    ],
)
def test_malformed_local_npz_names_the_value(
    tmp_path: Path, changes: dict[str, Any], expected: str
) -> None:
    # Prepare
    arrays = {**_good_arrays(), **changes}
    path = _save(tmp_path / "bad.npz", **{k: v for k, v in arrays.items() if v is not None})

    # Execute / Assert
    with pytest.raises(DataError, match=expected):
        _local(path)


def test_nan_features_name_the_first_bad_sample(tmp_path: Path) -> None:
    # Prepare: samples 5 and 7 hold NaN and inf
    arrays = _good_arrays()
    arrays["x_train"][5, 2] = np.nan
    arrays["x_train"][7, 0] = np.inf
    path = _save(tmp_path / "nan.npz", **arrays)

    # Execute / Assert
    with pytest.raises(
        DataError, match=r"NaN or infinite values in 2 sample\(s\), the first is sample 5"
    ):
        load_bundle(f"npz:{path}")


# --------------------------------------------------------------------------- #
# 3. Labels must be class indices 0..C-1
# --------------------------------------------------------------------------- #


def test_one_based_labels_of_a_dataset_are_an_error(tmp_path: Path) -> None:
    # Prepare: labels 1..10, as in many CSV exports
    arrays = _good_arrays(n=20, classes=10)
    arrays["y_train"] = arrays["y_train"] + 1
    arrays["y_test"] = arrays["y_test"] + 1
    path = _save(tmp_path / "one_based.npz", **arrays)

    # Execute / Assert: not silently 11 classes
    with pytest.raises(DataError) as info:
        load_bundle(f"npz:{path}")
    message = str(info.value)
    assert "the labels found are [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]" in message
    assert "not the class indices 0..10: 1 class(es) (0) have no sample" in message
    assert "the labels look 1-based: subtract 1" in message
    assert "Remap the labels to 0..9 over train and test together" in message


def test_label_gaps_of_a_dataset_are_an_error(tmp_path: Path) -> None:
    # Prepare: classes 0 and 5 only
    arrays = _good_arrays(classes=2)
    arrays["y_train"] = arrays["y_train"] * 5
    arrays["y_test"] = arrays["y_test"] * 5
    path = _save(tmp_path / "gaps.npz", **arrays)

    # Execute / Assert
    with pytest.raises(
        DataError, match=r"labels found are \[0, 5\].*4 class\(es\) \(1, 2, 3, 4\) have no"
    ):
        load_bundle(f"npz:{path}")


def test_huge_label_gap_is_reported_briefly(tmp_path: Path) -> None:
    # Prepare: one stray label of 2**40 among 0..2
    arrays = _good_arrays()
    arrays["y_test"] = np.array([0, 1, 2**40])
    path = _save(tmp_path / "stray.npz", **arrays)

    # Execute / Assert: a short message, not 2**40 listed classes
    with pytest.raises(DataError, match=r"\(3, 4, 5, 6, 7, \.\.\.\) have no sample") as info:
        load_bundle(f"npz:{path}")
    assert len(str(info.value)) < 600


def test_class_missing_from_one_split_is_fine(tmp_path: Path) -> None:
    # Prepare: class 3 appears only in the test split; together they are 0..3
    arrays = _good_arrays()
    arrays["y_test"] = np.array([0, 3, 1])
    path = _save(tmp_path / "split.npz", **arrays)

    # Execute
    bundle = load_bundle(f"npz:{path}")

    # Assert
    assert bundle.num_classes == 4


def test_negative_labels_are_an_error(tmp_path: Path) -> None:
    # Prepare
    arrays = _good_arrays()
    arrays["y_train"] = arrays["y_train"] - 1
    path = _save(tmp_path / "negative.npz", **arrays)

    # Execute / Assert
    with pytest.raises(DataError, match=r"label -1 at index 0 is negative"):
        load_bundle(f"npz:{path}")
    with pytest.raises(DataError, match=r"label -1 at index 0 is negative"):
        _local(path)


def test_one_based_local_labels_warn_and_fail_against_the_federation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a node may hold a subset of the classes (non-IID), so its own file
    # with gaps is allowed, with a warning; against the federation's count it fails
    arrays = _good_arrays(n=20, classes=10)
    path = _save(tmp_path / "mine.npz", x_train=arrays["x_train"], y_train=arrays["y_train"] + 1)

    # Execute
    with caplog.at_level(logging.WARNING, logger="tessera.data"):
        _, _, num_classes, _ = _local(path)

    # Assert
    assert num_classes == 11
    assert any(
        "labels found are [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]" in r.getMessage()
        and "1-based: subtract 1" in r.getMessage()
        for r in caplog.records
    )
    with pytest.raises(DataError, match=r"label 10 at index 9 is out of range for num_classes=10"):
        _local(path, num_classes=10)


# --------------------------------------------------------------------------- #
# 4. run-config seed range
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("seed", [-1, 2**32, 2**64])
def test_seed_outside_numpy_range_names_the_key(run_config: RunConfigFactory, seed: int) -> None:
    # Execute / Assert
    with pytest.raises(
        ConfigError,
        match=rf"run-config key 'seed' has invalid value {seed}: use an integer in "
        r"\[0, 2\*\*32 - 1\]",
    ):
        RunConfig.from_flower(run_config({"seed": seed}))


@pytest.mark.parametrize("seed", [0, 2**32 - 1])
def test_seed_range_bounds_are_accepted(run_config: RunConfigFactory, seed: int) -> None:
    assert RunConfig.from_flower(run_config({"seed": seed})).seed == seed
