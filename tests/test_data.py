"""Tests for tessera.data: loading, server pool, partitioning, client splits, plot."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import flwr_datasets
import numpy as np
import pytest
from PIL import Image

from tessera.data import (
    ArrayDataset,
    DataError,
    DatasetSpec,
    PartitionConfig,
    arrays_from_hf,
    bundle_from_hf,
    client_data,
    detect_hf_columns,
    load_bundle,
    local_data,
    parse_dataset_spec,
    partition_indices,
    plot_label_distribution,
    server_pool_indices,
    split_local,
    split_server_pool,
    validate_labels,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _save_npz(path: Path, **arrays: np.ndarray) -> str:
    np.savez(path, **arrays)
    return str(path)


def _id_npz(tmp_path: Path, n_train: int = 300, n_test: int = 60) -> str:
    """Vector data whose first feature is a unique sample id (train ids < 10_000)."""
    rng = np.random.default_rng(0)
    x_train = rng.normal(size=(n_train, 5)).astype(np.float32)
    x_train[:, 0] = np.arange(n_train)
    x_test = rng.normal(size=(n_test, 5)).astype(np.float32)
    x_test[:, 0] = 10_000 + np.arange(n_test)
    return _save_npz(
        tmp_path / "ids.npz",
        x_train=x_train,
        y_train=np.arange(n_train) % 5,
        x_test=x_test,
        y_test=np.arange(n_test) % 5,
    )


def _ids(dataset: ArrayDataset) -> set[int]:
    return {int(v) for v in dataset.x[:, 0]}


# --------------------------------------------------------------------------- #
# Dataset specs and digits
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("digits", DatasetSpec("digits")),
        (" Digits ", DatasetSpec("digits")),
        ("npz:/tmp/a.npz", DatasetSpec("npz", "/tmp/a.npz")),
        ("cifar10", DatasetSpec("hf", "uoft-cs/cifar10")),
        ("cifar100", DatasetSpec("hf", "uoft-cs/cifar100")),
        ("fashion_mnist", DatasetSpec("hf", "zalando-datasets/fashion_mnist")),
        ("mnist", DatasetSpec("hf", "ylecun/mnist")),
        ("hf:mnist", DatasetSpec("hf", "ylecun/mnist")),
        ("hf:someone/thing", DatasetSpec("hf", "someone/thing")),
        ("someone/thing", DatasetSpec("hf", "someone/thing")),
    ],
)
def test_parse_dataset_spec_forms(spec: str, expected: DatasetSpec) -> None:
    assert parse_dataset_spec(spec) == expected


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("imagenet-ish", "'imagenet-ish'"),
        ("csv:/a.csv", "'csv:/a.csv'"),
        ("", "''"),
        ("npz:", "'npz:' has no npz target; write 'npz:<path>'"),
        ("hf:", "'hf:' has no hf target; write 'hf:<name>'"),
    ],
)
def test_parse_dataset_spec_rejects_unknown(spec: str, named: str) -> None:
    with pytest.raises(DataError) as info:
        parse_dataset_spec(spec)
    assert named in str(info.value)


def test_unknown_spec_message_lists_the_forms() -> None:
    with pytest.raises(DataError) as info:
        parse_dataset_spec("imagenet-ish")
    message = str(info.value)
    for form in ("'imagenet-ish'", "digits", "npz:<path", "hf:<", "cifar10"):
        assert form in message


def test_digits_bundle_shapes_range_and_fixed_split() -> None:
    # Execute
    first = load_bundle("digits")
    second = load_bundle(DatasetSpec("digits"))

    # Assert: 1797 images, stratified 80/20 -> 1437 / 360
    assert first.train.x.shape == (1437, 1, 8, 8)
    assert first.test.x.shape == (360, 1, 8, 8)
    assert first.train.x.dtype == np.float32 and first.train.y.dtype == np.int64
    assert first.train.x.min() == 0.0 and first.train.x.max() == 1.0
    assert first.num_classes == 10 and first.input_shape == (1, 8, 8)
    assert np.bincount(first.test.y, minlength=10).min() >= 35  # stratified
    np.testing.assert_array_equal(first.train.x, second.train.x)
    np.testing.assert_array_equal(first.test.y, second.test.y)


# --------------------------------------------------------------------------- #
# npz loading
# --------------------------------------------------------------------------- #


def test_npz_vectors_round_trip(tmp_path: Path) -> None:
    # Prepare
    rng = np.random.default_rng(1)
    x_train, x_test = rng.normal(size=(30, 20)), rng.normal(size=(10, 20))
    path = _save_npz(
        tmp_path / "v.npz",
        x_train=x_train,
        y_train=np.arange(30) % 3,
        x_test=x_test,
        y_test=np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1]),
    )

    # Execute
    bundle = load_bundle(f"npz:{path}")

    # Assert
    assert bundle.input_shape == (20,)
    assert bundle.num_classes == 4  # max label over both splits + 1
    np.testing.assert_allclose(bundle.train.x, x_train.astype(np.float32))
    assert bundle.name == f"npz:{path}"


def test_npz_grayscale_uint8_gains_channel_and_is_scaled(tmp_path: Path) -> None:
    x = np.arange(4 * 6 * 5, dtype=np.uint8).reshape(4, 6, 5)
    path = _save_npz(
        tmp_path / "g.npz", x_train=x, y_train=[0, 1, 0, 1], x_test=x[:2], y_test=[1, 0]
    )

    bundle = load_bundle(f"npz:{path}")

    assert bundle.input_shape == (1, 6, 5)
    assert bundle.train.x[0, 0, 1, 2] == pytest.approx(x[0, 1, 2] / 255)


def test_npz_channels_last_rgb_is_transposed(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, size=(5, 7, 6, 3), dtype=np.uint8)
    path = _save_npz(
        tmp_path / "rgb.npz", x_train=x, y_train=np.arange(5), x_test=x, y_test=[0] * 5
    )

    bundle = load_bundle(f"npz:{path}")

    assert bundle.input_shape == (3, 7, 6)
    np.testing.assert_allclose(bundle.train.x[2, :, 4, 1], x[2, 4, 1, :] / 255)
    assert bundle.train.x.min() >= 0.0 and bundle.train.x.max() <= 1.0


def test_npz_channels_first_is_kept(tmp_path: Path) -> None:
    x = np.zeros((3, 3, 16, 16), dtype=np.float32)
    path = _save_npz(tmp_path / "c.npz", x_train=x, y_train=[0, 1, 2], x_test=x, y_test=[0, 1, 2])
    assert load_bundle(f"npz:{path}").input_shape == (3, 16, 16)


_GOOD = {
    "x_train": np.zeros((4, 3), dtype=np.float32),
    "y_train": np.array([0, 1, 0, 1]),
    "x_test": np.zeros((2, 3), dtype=np.float32),
    "y_test": np.array([0, 1]),
}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"y_test": None}, r"lacks array\(s\) \['y_test'\].*\['x_test', 'x_train'"),
        ({"y_train": np.array([0, 1, 0])}, r"4 samples but labels of shape \(3,\)"),
        ({"x_test": np.zeros((2, 4))}, r"test samples have shape \(4,\)"),
        ({"y_train": np.array([0, 1.5, 0, 1])}, r"label 1\.5 at index 1"),
        ({"y_train": np.array([0, -3, 0, 1])}, r"label -3 at index 1 is negative"),
        ({"y_train": np.array(["a", "b", "a", "b"])}, r"dtype <U1.*integer"),
        ({"y_train": np.zeros((4, 2), dtype=int)}, r"shape \(4, 2\).*argmax"),
        (
            {"x_train": np.zeros((0, 3)), "y_train": np.zeros(0, dtype=int)},
            r"train samples are empty \(shape \(0, 3\)\)",
        ),
        ({"x_test": np.zeros((2, 3, 3, 3, 3))}, r"shape \(2, 3, 3, 3, 3\)"),
        ({"x_train": np.full((4, 3), np.nan)}, r"NaN"),
    ],
)
def test_npz_errors_name_the_bad_value(
    tmp_path: Path, changes: dict[str, Any], expected: str
) -> None:
    # Prepare
    arrays = {**_GOOD, **changes}
    path = _save_npz(tmp_path / "bad.npz", **{k: v for k, v in arrays.items() if v is not None})

    # Execute / Assert
    with pytest.raises(DataError, match=expected):
        load_bundle(f"npz:{path}")


def test_npz_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.npz"
    with pytest.raises(DataError, match=r"nope\.npz.*does not exist"):
        load_bundle(f"npz:{missing}")


def test_npz_not_an_archive(tmp_path: Path) -> None:
    path = tmp_path / "text.npz"
    path.write_text("not numpy")
    with pytest.raises(DataError, match=r"text\.npz.*not a readable \.npz"):
        load_bundle(f"npz:{path}")


def test_validate_labels_rejects_out_of_range() -> None:
    assert validate_labels([0, 2, 1], 3).dtype == np.int64
    with pytest.raises(DataError, match=r"label 7 at index 2.*num_classes=3"):
        validate_labels(np.array([0, 1, 7]), 3)


def test_array_dataset_rejects_bad_dtypes_and_lengths() -> None:
    with pytest.raises(DataError, match="float32"):
        ArrayDataset(x=np.zeros((2, 3)), y=np.zeros(2, dtype=np.int64))
    with pytest.raises(DataError, match=r"y has shape \(3,\)|y must have shape"):
        ArrayDataset(x=np.zeros((2, 3), dtype=np.float32), y=np.zeros(3, dtype=np.int64))


# --------------------------------------------------------------------------- #
# Partitioning
# --------------------------------------------------------------------------- #


def test_iid_partitions_are_balanced() -> None:
    labels = np.arange(42) % 3

    parts = partition_indices(labels, num_partitions=4, config=PartitionConfig("iid", seed=3))

    assert sorted(len(p) for p in parts) == [10, 10, 11, 11]


def test_pathological_gives_each_client_exactly_k_classes() -> None:
    # Prepare: 40 labels, 4 classes of 10; deterministic assignment gives
    # partition i the classes {i, i+1 mod 4}, every class shared by 2 partitions.
    labels = np.repeat(np.arange(4), 10)
    config = PartitionConfig("pathological", classes_per_client=2, seed=0)

    # Execute
    parts = partition_indices(labels, num_partitions=4, config=config)

    # Assert
    for pid, part in enumerate(parts):
        assert set(labels[part].tolist()) == {pid, (pid + 1) % 4}
        assert len(part) == 10  # 5 of each of its two classes
        assert np.bincount(labels[part], minlength=4).max() == 5


def test_dirichlet_is_deterministic_per_seed() -> None:
    labels = np.arange(400) % 4

    def run(seed: int) -> list[np.ndarray]:
        config = PartitionConfig("dirichlet", alpha=0.5, seed=seed)
        return partition_indices(labels, num_partitions=5, config=config)

    same_a, same_b, other = run(7), run(7), run(8)

    for a, b in zip(same_a, same_b, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, c) for a, c in zip(same_a, other, strict=True))


@pytest.mark.parametrize(
    "config",
    [
        PartitionConfig("iid"),
        PartitionConfig("dirichlet", alpha=0.3),
        PartitionConfig("pathological", classes_per_client=2),
        PartitionConfig("pathological", classes_per_client=3, class_assignment="random"),
    ],
)
def test_partitions_are_disjoint_and_cover_the_pool(config: PartitionConfig) -> None:
    labels = np.random.default_rng(0).integers(0, 5, size=500)

    parts = partition_indices(labels, num_partitions=6, config=config)

    joined = np.concatenate(parts)
    assert len(joined) == len(np.unique(joined))  # disjoint
    np.testing.assert_array_equal(np.sort(joined), np.arange(500))  # covers
    assert all(p.dtype == np.int64 and len(p) >= 1 for p in parts)


def test_dirichlet_with_empty_partitions_raises_naming_a_partition() -> None:
    labels = np.arange(60) % 3
    config = PartitionConfig("dirichlet", alpha=0.01, seed=0)
    with pytest.raises(DataError, match=r"partition \d+ got \d+ samples.*larger alpha"):
        partition_indices(labels, num_partitions=30, config=config)


def test_more_partitions_than_samples_raises() -> None:
    with pytest.raises(DataError, match=r"num_partitions=11 exceeds the 10 samples"):
        partition_indices(np.zeros(10), num_partitions=11, config=PartitionConfig("iid"))


def test_more_classes_per_client_than_classes_raises() -> None:
    config = PartitionConfig("pathological", classes_per_client=5)
    with pytest.raises(DataError, match=r"classes_per_client=5 exceeds the 4 classes"):
        partition_indices(np.arange(40) % 4, num_partitions=4, config=config)


def test_min_partition_size_names_the_small_partition() -> None:
    config = PartitionConfig("iid", min_partition_size=4)
    with pytest.raises(DataError, match=r"partition \d+ of 3 \(iid\) has 3 samples"):
        partition_indices(np.arange(10) % 2, num_partitions=3, config=config)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"scheme": "shards"}, "'shards' is unknown"),
        ({"scheme": "dirichlet", "alpha": 0.0}, r"alpha=0\.0"),
        ({"scheme": "dirichlet", "alpha": float("nan")}, "alpha=nan"),
        ({"scheme": "pathological", "classes_per_client": 0}, "classes_per_client=0"),
        ({"scheme": "iid", "seed": -1}, "seed=-1"),
        ({"scheme": "iid", "class_assignment": "roundrobin"}, "'roundrobin'"),
    ],
)
def test_partition_config_validation(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(DataError, match=expected):
        PartitionConfig(**kwargs)


# --------------------------------------------------------------------------- #
# Server pool, federation and clients
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "config",
    [
        PartitionConfig("iid", seed=1),
        PartitionConfig("dirichlet", alpha=0.5, seed=2),
        PartitionConfig("pathological", classes_per_client=2, seed=3),
    ],
)
def test_server_pool_and_client_splits_never_overlap(
    tmp_path: Path, config: PartitionConfig
) -> None:
    # Prepare
    bundle = load_bundle(f"npz:{_id_npz(tmp_path)}")

    # Execute
    client_pool, server_pool = split_server_pool(bundle, pool_fraction=0.2, seed=config.seed)
    parts = partition_indices(client_pool.y, num_partitions=6, config=config)
    clients = [
        client_data(
            bundle,
            partition_id=pid,
            num_partitions=6,
            partition=config,
            pool_fraction=0.2,
            test_fraction=0.25,
        )
        for pid in range(6)
    ]

    # Assert
    pool = _ids(server_pool)
    assert len(pool) == 60  # 20% of 300, stratified
    seen = set(pool)
    for pid, (train, test) in enumerate(clients):
        own = _ids(train) | _ids(test)
        assert not own & seen, f"client {pid} overlaps earlier data"
        assert not _ids(train) & _ids(test)
        assert len(train) >= 1
        assert own == _ids(client_pool.subset(parts[pid]))  # exactly its partition
        assert len(test) == round(0.25 * len(parts[pid]))
        seen |= own
    assert seen == set(range(300))  # pool + all clients = whole train split


def test_split_server_pool_is_stratified_and_seeded() -> None:
    bundle = load_bundle("digits")

    client_pool, server_pool = split_server_pool(bundle, pool_fraction=0.1, seed=5)
    again = server_pool_indices(bundle.train.y, pool_fraction=0.1, seed=5)
    other = server_pool_indices(bundle.train.y, pool_fraction=0.1, seed=6)

    assert len(client_pool) + len(server_pool) == len(bundle.train)
    assert len(server_pool) == 144
    assert np.bincount(server_pool.y, minlength=10).min() >= 14
    np.testing.assert_array_equal(server_pool.y, bundle.train.y[again[1]])
    assert not np.array_equal(again[1], other[1])


def test_zero_pool_fraction_gives_empty_server_pool() -> None:
    bundle = load_bundle("digits")
    client_pool, server_pool = split_server_pool(bundle, pool_fraction=0.0, seed=0)
    assert len(server_pool) == 0 and server_pool.input_shape == (1, 8, 8)
    assert len(client_pool) == len(bundle.train)


@pytest.mark.parametrize("fraction", [1.0, -0.1, float("inf")])
def test_bad_pool_fraction_raises(fraction: float) -> None:
    with pytest.raises(DataError, match=f"pool_fraction={fraction!r}"):
        split_server_pool(load_bundle("digits"), pool_fraction=fraction, seed=0)


@pytest.mark.parametrize("partition_id", [-1, 4])
def test_client_partition_id_out_of_range(partition_id: int) -> None:
    with pytest.raises(DataError, match=f"partition_id={partition_id} is out of range"):
        client_data(
            "digits",
            partition_id=partition_id,
            num_partitions=4,
            partition=PartitionConfig("iid"),
            pool_fraction=0.1,
            test_fraction=0.2,
        )


def test_split_local_keeps_tiny_partitions_for_training() -> None:
    train, test = split_local([3], test_fraction=0.5, seed=0)
    assert train.tolist() == [0] and test.size == 0
    train, test = split_local([1, 2], test_fraction=0.9, seed=0)
    assert len(train) == 1 and len(test) == 1  # capped at n - 1
    labels = np.arange(40) % 4
    train, test = split_local(labels, test_fraction=0.25, seed=0)
    assert len(test) == 10 and not set(train.tolist()) & set(test.tolist())
    assert sorted(np.bincount(labels[test], minlength=4).tolist()) == [2, 2, 3, 3]


def test_partitions_match_across_processes() -> None:
    # The server and every client compute partitions independently.
    code = (
        "import hashlib, numpy as np\n"
        "from tessera.data import PartitionConfig, load_bundle, partition_indices, "
        "split_server_pool\n"
        "b = load_bundle('digits')\n"
        "pool, _ = split_server_pool(b, pool_fraction=0.1, seed=4)\n"
        "parts = partition_indices(pool.y, num_partitions=7, "
        "config=PartitionConfig('dirichlet', alpha=0.3, seed=4))\n"
        "print(hashlib.sha256(np.concatenate(parts + [pool.y]).tobytes()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    pool, _ = split_server_pool(load_bundle("digits"), pool_fraction=0.1, seed=4)
    parts = partition_indices(
        pool.y, num_partitions=7, config=PartitionConfig("dirichlet", alpha=0.3, seed=4)
    )
    digest = hashlib.sha256(np.concatenate([*parts, pool.y]).tobytes()).hexdigest()
    assert out.stdout.strip() == digest


# --------------------------------------------------------------------------- #
# Device-local data
# --------------------------------------------------------------------------- #


def test_local_data_with_and_without_test_split(tmp_path: Path) -> None:
    x = np.random.default_rng(0).integers(0, 256, size=(20, 8, 8), dtype=np.uint8)
    y = np.arange(20) % 4
    with_test = _save_npz(tmp_path / "a.npz", x_train=x, y_train=y, x_test=x[:3], y_test=y[:3])
    without = _save_npz(tmp_path / "b.npz", x_train=x, y_train=y)

    train, test, num_classes, shape = local_data(with_test, test_fraction=0.2, seed=0)
    assert (len(train), len(test), num_classes, shape) == (20, 3, 4, (1, 8, 8))

    train, test, num_classes, _ = local_data(without, test_fraction=0.2, seed=0, num_classes=10)
    assert (len(train), len(test), num_classes) == (16, 4, 10)
    assert sorted(test.y.tolist()) == [0, 1, 2, 3]  # stratified


def test_local_data_errors(tmp_path: Path) -> None:
    y = np.array([0, 1, 5])
    half = _save_npz(tmp_path / "h.npz", x_train=np.zeros((3, 2)), y_train=y, x_test=1)
    with pytest.raises(DataError, match="'x_test' but not its partner"):
        local_data(half, test_fraction=0.2, seed=0)
    full = _save_npz(tmp_path / "f.npz", x_train=np.zeros((3, 2)), y_train=y)
    with pytest.raises(DataError, match=r"label 5 at index 2.*num_classes=4"):
        local_data(full, test_fraction=0.2, seed=0, num_classes=4)
    no_train = _save_npz(tmp_path / "n.npz", x=np.zeros((3, 2)))
    with pytest.raises(DataError, match=r"lacks array 'x_train'; it has \['x'\]"):
        local_data(no_train, test_fraction=0.2, seed=0)


# --------------------------------------------------------------------------- #
# Plot
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("shape", [(10, 10), (4, 30)])
def test_plot_label_distribution_writes_png(tmp_path: Path, shape: tuple[int, int]) -> None:
    counts = np.random.default_rng(0).integers(0, 20, size=shape)
    path = tmp_path / "sub" / "labels.png"

    plot_label_distribution(counts, path, title="digits, dirichlet 0.5")

    assert path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_rejects_bad_counts(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"shape \(3,\)"):
        plot_label_distribution(np.array([1, 2, 3]), tmp_path / "x.png", title="t")


# --------------------------------------------------------------------------- #
# Hugging Face path (no network)
# --------------------------------------------------------------------------- #


def _hf_split(
    n: int,
    *,
    image_col: str = "img",
    label_col: str = "label",
    mode: str = "RGB",
    class_label: bool = True,
) -> datasets.Dataset:
    rng = np.random.default_rng(n)
    shape = (6, 5, 3) if mode == "RGB" else (6, 5)
    images = [Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8)) for _ in range(n)]
    label_feature = (
        datasets.ClassLabel(names=["a", "b", "c", "d"]) if class_label else datasets.Value("int64")
    )
    return datasets.Dataset.from_dict(
        {image_col: images, label_col: [i % 3 for i in range(n)]},
        features=datasets.Features({image_col: datasets.Image(), label_col: label_feature}),
    )


@pytest.mark.parametrize(
    ("image_col", "label_col", "class_label"),
    [
        ("img", "label", True),
        ("image", "fine_label", False),
        ("picture", "target", True),  # found by feature type
    ],
)
def test_detect_hf_columns(image_col: str, label_col: str, class_label: bool) -> None:
    split = _hf_split(3, image_col=image_col, label_col=label_col, class_label=class_label)
    assert detect_hf_columns(split.features) == (image_col, label_col)


def test_detect_hf_columns_missing_label_lists_columns() -> None:
    split = _hf_split(3, label_col="target", class_label=False)
    with pytest.raises(DataError, match=r"label column among \['img', 'target'\]"):
        detect_hf_columns(split.features)


def test_arrays_from_hf_converts_rgb_and_grayscale() -> None:
    rgb = _hf_split(4)
    x, y = arrays_from_hf(rgb)
    assert x.shape == (4, 3, 6, 5) and x.dtype == np.float32
    raw = np.asarray(rgb[1]["img"])
    np.testing.assert_allclose(x[1, :, 2, 3], raw[2, 3, :] / 255)
    assert y.tolist() == [0, 1, 2, 0] and y.dtype == np.int64

    gray, _ = arrays_from_hf(_hf_split(2, image_col="image", mode="L"))
    assert gray.shape == (2, 1, 6, 5)


def test_arrays_from_hf_rejects_mixed_sizes() -> None:
    images = [Image.new("L", (4, 4)), Image.new("L", (5, 4))]
    split = datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    )
    with pytest.raises(DataError, match="differ in size"):
        arrays_from_hf(split)


def test_bundle_from_hf_uses_class_label_count() -> None:
    bundle = bundle_from_hf(_hf_split(6), _hf_split(3), name="hf:toy")
    assert bundle.num_classes == 4  # ClassLabel has 4 names, data uses 3
    bundle = bundle_from_hf(
        _hf_split(6, class_label=False), _hf_split(3, class_label=False), name="hf:toy"
    )
    assert bundle.num_classes == 3


def test_hub_failure_becomes_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Offline:
        def __init__(self, **kwargs: Any) -> None:
            raise ConnectionError("Failed to resolve huggingface.co")

    monkeypatch.setattr(flwr_datasets, "FederatedDataset", Offline)
    with pytest.raises(DataError, match=r"'uoft-cs/cifar10'.*unreachable.*npz:<path>"):
        load_bundle("cifar10")


def test_hf_load_through_federated_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    splits = {"train": _hf_split(9), "test": _hf_split(3)}

    class Fake:
        def __init__(self, **kwargs: Any) -> None:
            calls.append(kwargs)

        def load_split(self, split: str) -> datasets.Dataset:
            if split not in splits:
                raise ValueError(f"The given split: '{split}' is not present")
            return splits[split]

    monkeypatch.setattr(flwr_datasets, "FederatedDataset", Fake)
    bundle = load_bundle("hf:mnist")
    assert calls == [{"dataset": "ylecun/mnist", "partitioners": {"train": 1}}]
    assert bundle.name == "hf:ylecun/mnist" and bundle.input_shape == (3, 6, 5)
    assert (len(bundle.train), len(bundle.test)) == (9, 3)

    del splits["test"]
    with pytest.raises(DataError, match="'ylecun/mnist' has no 'test' split"):
        load_bundle("hf:mnist")
