"""Tests for 1-D multi-channel signals ``(N, C, L)`` in the npz and array loaders."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tessera.data import (
    ArrayDataset,
    DataError,
    PartitionConfig,
    load_bundle,
    local_data,
    node_local_data,
    node_partition_data,
)
from tessera.data.cache_memory import clear_memory_cache


def _signals(n: int, channels: int = 2, length: int = 32) -> np.ndarray:
    """``x[i, c, t] = 1000 i + 100 c + t``: every value names its sample, channel and step."""
    i, c, t = np.meshgrid(np.arange(n), np.arange(channels), np.arange(length), indexing="ij")
    return (1000 * i + 100 * c + t).astype(np.float32)


def _save(path: Path, **arrays: Any) -> Path:
    np.savez(path, **arrays)
    return path


def test_ncl_signals_are_kept_as_they_are(tmp_path: Path) -> None:
    # Prepare: 12 train and 4 test signals, 2 channels of 32 steps
    x_train, x_test = _signals(12), _signals(4)
    path = _save(
        tmp_path / "ecg.npz",
        x_train=x_train,
        y_train=np.arange(12) % 3,
        x_test=x_test,
        y_test=np.arange(4) % 3,
        layout="NCL",
    )

    # Execute
    bundle = load_bundle(f"npz:{path}")

    # Assert
    assert bundle.input_shape == (2, 32)
    assert bundle.train.x.dtype == np.float32
    np.testing.assert_array_equal(bundle.train.x, x_train)
    assert bundle.train.x[5, 1, 7] == 5107.0
    np.testing.assert_array_equal(bundle.test.x, x_test)


def test_nlc_signals_are_transposed_to_channels_first(tmp_path: Path) -> None:
    channels_last = np.transpose(_signals(6, channels=3, length=10), (0, 2, 1))  # (6, 10, 3)
    path = _save(
        tmp_path / "imu.npz",
        x_train=channels_last,
        y_train=[0, 1, 0, 1, 0, 1],
        x_test=channels_last[:2],
        y_test=[0, 1],
        layout=" nlc ",  # case and spaces ignored
    )

    bundle = load_bundle(f"npz:{path}")

    assert bundle.input_shape == (3, 10)
    assert bundle.train.x[4, 2, 9] == 4209.0  # sample 4, channel 2, step 9


def test_uint8_signals_are_scaled_like_images(tmp_path: Path) -> None:
    x = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = _save(tmp_path / "u8.npz", x_train=x, y_train=[0, 1], x_test=x, y_test=[1, 0])
    with np.load(path) as npz:
        arrays = dict(npz)
    _save(path, **arrays, layout="NCL")

    bundle = load_bundle(f"npz:{path}")

    assert bundle.input_shape == (3, 4)
    assert bundle.train.x[1, 2, 3] == pytest.approx(23 / 255)


def test_explicit_image_layouts_override_the_guess(tmp_path: Path) -> None:
    # (N, 3, 5, 3) could be channels-last or channels-first; unnamed it is taken
    # as channels-last, named NCHW it is kept
    x = np.random.default_rng(0).random((4, 3, 5, 3)).astype(np.float32)
    arrays = {"x_train": x, "y_train": [0, 1, 0, 1], "x_test": x, "y_test": [0, 1, 0, 1]}
    guessed = load_bundle(f"npz:{_save(tmp_path / 'a.npz', **arrays)}")
    named = load_bundle(f"npz:{_save(tmp_path / 'b.npz', **arrays, layout='NCHW')}")
    plain = {**arrays, "x_train": x[..., 0], "x_test": x[..., 0]}  # (4, 3, 5)
    gray = load_bundle(f"npz:{_save(tmp_path / 'c.npz', **plain, layout='NHW')}")

    assert guessed.input_shape == (3, 3, 5)
    assert named.input_shape == (3, 5, 3)
    np.testing.assert_array_equal(named.train.x, x)
    assert gray.input_shape == (1, 3, 5)


def test_unnamed_3d_signals_are_read_as_images_with_a_hint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x = _signals(4, channels=12, length=200)
    path = _save(tmp_path / "ecg.npz", x_train=x, y_train=[0, 1, 0, 1], x_test=x, y_test=[0] * 4)

    with caplog.at_level(logging.WARNING, logger="tessera.data"):
        bundle = load_bundle(f"npz:{path}")

    assert bundle.input_shape == (1, 12, 200)
    assert "layout='NCL'" in caplog.text and "12 channels" in caplog.text


@pytest.mark.parametrize(
    ("layout", "x", "expected"),
    [
        ("NCT", _signals(3), r"'NCT'; use one of \['ND', 'NCL'"),
        ("NCL", np.zeros((3, 2, 4, 4)), r"shape \(3, 2, 4, 4\) \(4 axes\) but the layout 'NCL'"),
        ("NCHW", _signals(3), r"\(3 axes\) but the layout 'NCHW' names 4"),
        (np.array(["NCL", "NCL"]), _signals(3), r"shape \(2,\).*save one string"),
        (np.int64(3), _signals(3), r"dtype int64.*layout='NCL'"),
    ],
)
def test_bad_layouts_name_the_value_and_the_fix(
    tmp_path: Path, layout: Any, x: np.ndarray, expected: str
) -> None:
    path = _save(tmp_path / "bad.npz", x_train=x, y_train=[0, 1, 2], x_test=x, y_test=[0, 1, 2])
    with np.load(path) as npz:
        arrays = dict(npz)
    _save(path, **arrays, layout=layout)

    with pytest.raises(DataError, match=expected):
        load_bundle(f"npz:{path}")


def test_array_dataset_accepts_signals() -> None:
    data = ArrayDataset(x=_signals(5), y=np.arange(5, dtype=np.int64))
    assert data.input_shape == (2, 32)
    assert data.subset([4, 0]).x[0, 1, 3] == 4103.0


def test_local_signal_file_is_split_and_cached(tmp_path: Path) -> None:
    # Prepare: 40 signals, 4 classes, no test split -> 30 train / 10 test
    path = _save(
        tmp_path / "mine.npz", x_train=_signals(40), y_train=np.arange(40) % 4, layout="NCL"
    )
    clear_memory_cache()

    # Execute
    train, test, num_classes, shape = local_data(str(path), test_fraction=0.25, seed=0)
    cached = node_local_data(str(path), test_fraction=0.25, seed=0, cache_dir=tmp_path / "c")
    clear_memory_cache()
    reread = node_local_data(str(path), test_fraction=0.25, seed=0, cache_dir=tmp_path / "c")

    # Assert
    assert (len(train), len(test), num_classes, shape) == (30, 10, 4, (2, 32))
    for got in (cached, reread):
        assert got.input_shape == (2, 32)
        np.testing.assert_array_equal(got.train.x, train.x)
        np.testing.assert_array_equal(got.test.y, test.y)
    clear_memory_cache()


def test_a_signal_dataset_is_partitioned(tmp_path: Path) -> None:
    x = _signals(80, channels=3, length=16)
    path = _save(
        tmp_path / "sig.npz",
        x_train=x,
        y_train=np.arange(80) % 4,
        x_test=x[:8],
        y_test=np.arange(8) % 4,
        layout="NCL",
    )
    clear_memory_cache()

    splits = node_partition_data(
        f"npz:{path}",
        partition_id=0,
        num_partitions=4,
        partition=PartitionConfig("iid", seed=1),
        pool_fraction=0.0,
        test_fraction=0.25,
    )

    # 80 samples over 4 iid partitions -> 20, of which 5 local test
    assert (len(splits.train), len(splits.test)) == (15, 5)
    assert splits.input_shape == (3, 16) and splits.train.x.shape == (15, 3, 16)
    ids = splits.train.x[:, 0, 0] / 1000  # x[i, 0, 0] = 1000 i
    np.testing.assert_array_equal(splits.train.x, _signals(80, 3, 16)[ids.astype(int)])
    clear_memory_cache()
